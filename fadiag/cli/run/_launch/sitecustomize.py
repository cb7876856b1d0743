"""Attach fadiag to a Python process started by `fadiag run`, with no change to its code.

`fadiag run` puts this directory first on PYTHONPATH, so Python's `site` imports this module at
start-up. It first runs the sitecustomize that would otherwise have been found, then — in
processes that train — calls `fadiag.attach()` as soon as `torch` has finished importing, so
processes that never import torch pay nothing.

Which processes attach (FADIAG_AUTOATTACH=1 must be set; `fadiag run` sets it):

1. never a multiprocessing child (DataLoader workers, spawn/forkserver pools): they do not train;
2. never torch's own helper processes (inductor compile workers, `python -m torch.*` tools);
3. never a launcher: torchrun / `python -m torch.distributed.run` / `torch.distributed.launch`,
   `accelerate`, `deepspeed` — they import torch but do not train (even where the environment
   already holds a LOCAL_RANK, as some cluster wrappers export);
4. any other process that imports torch: a worker started by a launcher (LOCAL_RANK set), or a
   single training process.

Processes started by `torch.multiprocessing.spawn` are multiprocessing children too and do not
attach: call `fadiag.attach()` in the function they run.

An error while attaching is written once to stderr and the program carries on without fadiag.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))

LAUNCHER_MODULES = frozenset({
    "torch.distributed.run", "torch.distributed.launch",
    "accelerate.commands.launch", "accelerate.commands.accelerate_cli",
    "deepspeed.launcher.runner", "deepspeed.launcher.launch",
})
LAUNCHER_SCRIPTS = frozenset({"torchrun", "accelerate", "deepspeed"})
# Interpreter options that take a value as the next argument.
_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})


def program(orig_argv: Sequence[str]) -> tuple[str, str]:
    """What the interpreter was asked to run: ("module", name), ("script", path), ("command", "")
    or ("interactive", "")."""
    args = list(orig_argv[1:])
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-m":
            return ("module", args[i + 1] if i + 1 < len(args) else "")
        if a.startswith("-m") and len(a) > 2 and not a.startswith("--"):
            return ("module", a[2:])
        if a == "-c" or (a.startswith("-c") and not a.startswith("--")):
            return ("command", "")
        if a in _OPTIONS_WITH_VALUE:
            i += 2
            continue
        if a == "-" or not a.startswith("-"):
            return ("script", a) if a != "-" else ("interactive", "")
        i += 1
    return ("interactive", "")


def should_attach(orig_argv: Sequence[str], environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether this process attaches, and why (the rules in this module's docstring)."""
    if environ.get("FADIAG_AUTOATTACH") != "1":
        return False, "FADIAG_AUTOATTACH is not 1"
    joined = " ".join(orig_argv)
    if "multiprocessing" in joined and ("spawn_main" in joined or "forkserver" in joined):
        return False, "multiprocessing child"
    if "--multiprocessing-fork" in orig_argv:
        return False, "multiprocessing child"
    kind, name = program(orig_argv)
    if kind == "module" and name.startswith("torch.") and name not in LAUNCHER_MODULES:
        return False, f"torch helper module {name}"
    if kind == "script" and _inside_torch(name):
        return False, f"torch helper script {name}"
    if kind == "module" and name in LAUNCHER_MODULES:
        return False, f"launcher {name}"
    if kind == "script" and os.path.basename(name) in LAUNCHER_SCRIPTS:
        return False, f"launcher {os.path.basename(name)}"
    if "LOCAL_RANK" in environ:
        return True, f"LOCAL_RANK={environ['LOCAL_RANK']}"
    return True, "training process"


def _inside_torch(path: str) -> bool:
    parts = os.path.abspath(path).split(os.sep)
    for i, part in enumerate(parts[:-1]):
        if part == "torch" and (parts[i + 1] in ("_inductor", "distributed", "utils")
                                or (i > 0 and parts[i - 1] in ("site-packages", "dist-packages"))):
            return True
    return False


def overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """attach() overrides from the environment `fadiag run` sets (FADIAG_CONFIG is read by attach)."""
    out: dict[str, Any] = {}
    if environ.get("FADIAG_PORT"):
        out["port"] = int(environ["FADIAG_PORT"])
    if environ.get("FADIAG_JSONL"):
        out["jsonl"] = environ["FADIAG_JSONL"]
    return out


def attach() -> None:
    """attach() and tell `fadiag run` where the metrics are (fadiag detaches at exit); never
    raise."""
    pending = sys.modules.get("fadiag")
    if pending is not None and not hasattr(pending, "attach"):
        # The program imported fadiag first, and torch is being imported by fadiag's own
        # __init__: attach once fadiag has finished importing (its __init__ calls this back).
        pending._attach_when_imported = attach  # type: ignore[attr-defined]
        return
    try:
        import fadiag

        session = fadiag.attach(**overrides(os.environ))
        _announce(session)
    except Exception as e:
        sys.stderr.write(f"fadiag: could not attach in process {os.getpid()} "
                         f"({type(e).__name__}: {e}); it runs on without fadiag\n")


def _announce(session: Any) -> None:
    run_dir = os.environ.get("FADIAG_RUN_DIR")
    if not run_dir or not os.path.isdir(run_dir):
        return
    import json

    rank = getattr(session, "rank", None)
    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    record = {"pid": os.getpid(), "rank": int(rank), "port": session.port,
              "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "addr": _addr(session)}
    tmp = os.path.join(run_dir, f".{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(run_dir, f"{os.getpid()}.json"))


def _addr(session: Any) -> str:
    try:
        addr = str(session.config.exporter.addr)
    except AttributeError:
        return "127.0.0.1"
    return "127.0.0.1" if addr in ("", "0.0.0.0", "::") else addr


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps torch's loader so attach() runs once torch has imported."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_attach(module: Any) -> None:
            exec_module(module)
            attach()

        spec.loader.exec_module = exec_then_attach  # type: ignore[method-assign]
        return spec


def _chain() -> None:
    """Run the sitecustomize this one shadows (a distribution's or a virtualenv's), if any."""
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.stderr.write(f"fadiag: error in {spec.origin}: {type(e).__name__}: {e}\n")


def _main() -> None:
    me = sys.modules.get(__name__)
    _chain()
    # Our directory leaves sys.path: the program sees the path it would have seen without us.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    if __name__ == "sitecustomize" and me is not None and sys.modules.get("sitecustomize") is not me:
        sys.modules["fadiag_sitecustomize"] = me
    ok, _ = should_attach(getattr(sys, "orig_argv", sys.argv), os.environ)
    if not ok:
        return
    if "torch" in sys.modules:
        attach()
    else:
        sys.meta_path.insert(0, _AfterTorchImport())


if __name__ == "sitecustomize":
    _main()
