"""Native timing marks: `_native/marks.cpp`, built with torch's extension builder on first use.

With them a measured call costs four C++ marks and no Python on the backward: the two backward
marks are autograd node hooks written in C++, so the autograd engine never takes the GIL for
fadiag. Building needs a C++ compiler and ninja (and the CUDA headers for the CUDA build); the
result is cached by torch per torch/Python/CUDA version, so later processes only load it.
Without a toolchain everything works the same with Python marks, at a higher host cost.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

try:
    import fcntl
except ImportError:  # Windows: torch's lock alone, cleared by age
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("fadiag")

SOURCES = tuple(Path(__file__).parent / "_native" / name
                for name in ("marks.cpp", "tap.cpp", "eager.cpp"))
"""marks.cpp: the marks and autograd hooks; tap.cpp: the dispatcher tap (fadiag/capture/tap.py); both
share _native/pool.h; eager.cpp: the eager SDPA wrapper as a builtin (fadiag/capture/eager.py)."""

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}
_failures: dict[str, str] = {}
_building: set[str] = set()
_waiters: dict[str, list[Callable[[ModuleType], None]]] = {}


def module_name(kind: str) -> str:
    return f"fadiag_marks_{kind}"


def load(kind: str) -> ModuleType | None:
    """Build (or load the cached build of) the extension for `kind` ("cuda" or "cpu").

    Blocks while building. Returns None, and remembers why, if it cannot be built here.
    """
    with _lock:
        if kind in _modules:
            return _modules[kind]
        if kind in _failures:
            return None
    try:
        module = _build(kind)
    except Exception as e:  # no compiler, no ninja, no CUDA headers, a failed compile
        reason = f"{type(e).__name__}: {_first_line(e)}"
        with _lock:
            _failures[kind] = reason
        log.info("fadiag: native marks for %s unavailable (%s); using Python marks", kind, reason)
        return None
    with _lock:
        _modules[kind] = module
    return module


def load_in_background(kind: str, on_ready: Callable[[ModuleType], None]) -> None:
    """Build or load in a daemon thread and call `on_ready(module)` there if it works.

    Callers that ask while a build is under way are called when it ends. torch's extension
    builder is imported here, on the caller's thread, and not on the build thread: it imports
    setuptools, whose distutils shim inserts a finder into `sys.meta_path` and removes it again,
    and a thread importing at that moment can step past the path finder and fail with
    ModuleNotFoundError (seen in a torchrun rank: `No module named 'torch._dynamo'`, in the
    user's import, while this thread loaded the marks).
    """
    from torch.utils import cpp_extension  # noqa: F401  (~40 ms, once)

    with _lock:
        module = _modules.get(kind)
        if module is None:
            if kind in _failures:
                return
            _waiters.setdefault(kind, []).append(on_ready)
            if kind in _building:
                return
            _building.add(kind)
    if module is not None:
        _call(on_ready, module)
        return

    def work() -> None:
        m = None
        try:
            m = load(kind)
        finally:
            with _lock:
                _building.discard(kind)
                waiters = _waiters.pop(kind, [])
        if m is not None:
            for w in waiters:
                _call(w, m)

    threading.Thread(target=work, name=f"fadiag-native-build-{kind}", daemon=True).start()


def _call(on_ready: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        on_ready(module)
    except Exception as e:  # a timer that cannot be made: Python marks stay in place
        log.warning("fadiag: native marks loaded but not used (%s: %s)", type(e).__name__, e)


def status(kind: str) -> str:
    """"loaded", "building", "not built" or "unavailable: <why>" (for `fadiag doctor`)."""
    with _lock:
        if kind in _modules:
            return "loaded"
        if kind in _building:
            return "building"
        if kind in _failures:
            return f"unavailable: {_failures[kind]}"
    return "not built"


def toolchain() -> dict[str, str | None]:
    """Where the C++ compiler and ninja the build needs are (None: not found)."""
    compiler = os.environ.get("CXX", "c++")
    return {"compiler": shutil.which(compiler) or shutil.which("g++"), "ninja": shutil.which("ninja")}


def cached(kind: str) -> bool:
    """Whether a build for `kind` is already in torch's extension cache (loading is then fast)."""
    folder = _build_dir(kind)
    return folder is not None and any(_builds(folder, kind))


def fresh(kind: str) -> bool:
    """Whether `kind` loads from torch's extension cache with no build: a cached build newer than
    every source it is built from (headers included), and no build under way in its folder. Only
    then is loading it quick enough (~0.1 s) to do at attach(); a stale cache is rebuilt (a
    minute or more)."""
    folder = _build_dir(kind)
    if folder is None or (folder / "lock").exists():
        return False
    try:
        built = max((p.stat().st_mtime for p in _builds(folder, kind)), default=None)
        newest = max(p.stat().st_mtime for p in SOURCES[0].parent.iterdir() if p.is_file())
    except OSError:
        return False
    return built is not None and built >= newest


def _builds(folder: Path, kind: str) -> list[Path]:
    """The built extension files for `kind` in its cache folder (.so, or .pyd on Windows)."""
    return [p for ext in ("so", "pyd") for p in folder.glob(f"{module_name(kind)}*.{ext}")]


def _build_dir(kind: str) -> Path | None:
    """This build's cache folder: torch's (through a private helper of torch's; None if gone),
    one sub-folder per torch installation and fadiag checkout. torch keys its cache by the
    extension's name only, so two environments (a virtualenv beside the system's Python, say) or
    two checkouts would otherwise rebuild over each other's build in turn, each build waiting on
    the other's lock."""
    try:
        import torch
        from torch.utils import cpp_extension

        where = f"{torch.__file__}|{torch.__version__}|{SOURCES[0].parent}"
        env = hashlib.sha1(where.encode()).hexdigest()[:12]
        return Path(cpp_extension._get_build_directory(module_name(kind), verbose=False)) / env
    except Exception:
        return None


STALE_LOCK_S = 600.0
"""torch's build lock left by a process killed mid-build makes every later build wait forever."""
CLAIM = "fadiag-build.claim"
"""The file whose lock (flock) a process holds while it builds in a build folder."""


def clear_stale_lock(folder: Path, now: float | None = None, *, claimed: bool = False) -> bool:
    """Remove torch's build lock in `folder` if it is stale: `claimed` (this process holds the
    folder's build claim, so no live process is building there) or older than any build takes."""
    lock = folder / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
        if claimed or age > STALE_LOCK_S:
            lock.unlink()
            log.warning("fadiag: removed a stale extension build lock (%.0f s old, %s): %s", age,
                        "its builder is gone" if claimed else "older than any build", lock)
            return True
    except OSError:
        pass
    return False


@contextlib.contextmanager
def build_claim(folder: Path) -> Iterator[bool]:
    """Hold `folder`'s build claim (waiting for a process that holds it) while building there;
    yields whether it is held (False where there is no flock: Windows).

    torch's own build lock is a file that a process removes when its build ends, so a process
    that exits mid-build leaves it behind and every later build in the folder waits for it: a
    short job (or one killed) that attached while the marks were building in the background
    leaves the next jobs on the machine with Python marks. The claim is an flock, which the
    kernel releases when its holder dies: under it, any torch lock in the folder is stale."""
    if fcntl is None:
        yield False
        return
    fd = os.open(folder / CLAIM, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # releases the flock


def _build(kind: str) -> ModuleType:
    from torch.utils import cpp_extension

    if os.environ.get("FADIAG_NATIVE_DISABLE", "") in ("1", "true", "yes"):
        raise RuntimeError("FADIAG_NATIVE_DISABLE is set")
    folder = _build_dir(kind)
    cuda = kind == "cuda"
    flags = ["-O2", "-DFADIAG_CUDA"] if cuda else ["-O2"]

    def build() -> ModuleType:
        return cpp_extension.load(name=module_name(kind), sources=[str(p) for p in SOURCES],
                                  extra_cflags=flags, with_cuda=cuda, verbose=False,
                                  build_directory=None if folder is None else str(folder))

    if folder is None:
        return build()
    folder.mkdir(parents=True, exist_ok=True)
    with build_claim(folder) as claimed:
        clear_stale_lock(folder, claimed=claimed)
        return build()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""
