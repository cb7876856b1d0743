"""Where the launch-bound step's CPU time goes, thread by thread and library by library (perf).

`overhead.py` reads a variant's cost as the ratio of two noisy walls, and `threads.py` splits it
into CPU time per thread. This script says what that CPU time is: it runs the same interleaved
blocks (`overhead.py`'s launch-bound step; `phased_step`'s smaller model on CPU) in a child
process under `perf record -e cpu-clock` (a sample every millisecond of a thread's CPU time, no
call chains: the cost is the kernel's timer interrupt), and attributes every sample to the block
it fell in (block boundaries in CLOCK_MONOTONIC, perf's `-k` clock) and to its thread's role:
the training thread, the autograd engine's threads (`pt_autograd_*`), fadiag's resolver, the
rest. Per variant, against the plain blocks: CPU µs a step per role, and for the training thread
and the autograd threads per shared object (libpython is Python itself, whoever's code it runs,
and the cyclic collector; `fadiag_marks_*` is fadiag's C++; libcuda the driver's calls) and per
symbol. Python's collections are counted by generation as well (`gc.callbacks`). Usage:

    python benchmarks/profile_step.py [--device cuda] [--variants floor_native,fadiag]
        [--seconds 60] [--steps 120] [--out profile.json]

Needs `perf` with permission to sample (root, or perf_event_paranoid <= 1); PERF, if set, is the
command that runs it (e.g. `/lib64/ld-linux-x86-64.so.2 --library-path DIR DIR/perf` for a copy
with its libraries beside it, which the profiled process then does not load).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from in_situ import phased_step, setup_device  # noqa: E402
from overhead import variant  # noqa: E402

import fadiag  # noqa: E402

PERIOD_NS = 1_000_000
"""perf's cpu-clock period: one sample a millisecond of a thread's CPU time."""
ROLES = ("training", "autograd", "resolver", "other")
_SAMPLE = re.compile(r"^\s*(?P<comm>.+?)\s+(?P<tid>\d+)\s+(?P<time>\d+\.\d+):\s+"
                     r"(?:\S+\s+)?(?P<sym>.*?)\s+\((?P<dso>[^()]*)\)\s*$")


def short_dso(path: str) -> str:
    name = Path(path).name or path
    name = re.sub(r"\.so(\.[\d.]+)?$", ".so", name)
    return "fadiag_marks" if name.startswith("fadiag_marks") else name


def attribute(lines, blocks: list[dict], main_tid: int, resolvers: dict[int, str]) -> dict:
    """perf script's samples, per variant: by role, and by shared object and by symbol for the
    training thread and the autograd threads."""
    edges = [(b["t0"], b["t1"], b["variant"]) for b in blocks]
    edges.sort()
    starts = [e[0] for e in edges]
    out: dict = collections.defaultdict(lambda: {
        "role": collections.Counter(), "dso": collections.Counter(), "sym": collections.Counter(),
        "autograd_dso": collections.Counter(), "autograd_sym": collections.Counter(),
        "other_comm": collections.Counter()})
    for line in lines:
        m = _SAMPLE.match(line)
        if m is None:
            continue
        t = float(m["time"])
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t > edges[i][1]:
            continue  # between blocks: attach, detach, warm-up
        v = edges[i][2]
        tid, comm = int(m["tid"]), m["comm"]
        role = ("training" if tid == main_tid else "resolver" if tid in resolvers
                else "autograd" if comm.startswith("pt_autograd") else "other")
        cell = out[v]
        cell["role"][role] += 1
        dso = short_dso(m["dso"])
        if role == "training":
            cell["dso"][dso] += 1
            cell["sym"][f"{m['sym']} ({dso})"] += 1
        elif role == "autograd":
            cell["autograd_dso"][dso] += 1
            cell["autograd_sym"][f"{m['sym']} ({dso})"] += 1
        elif role == "other":
            cell["other_comm"][comm] += 1
    return out


# ---- the child: interleaved blocks, their boundaries on perf's clock ----------------------

class GcTimes:
    """Collections by generation and their seconds, while `current` names a variant."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.t0 = 0.0
        self.seen: dict[str, dict[str, list[float]]] = collections.defaultdict(
            lambda: collections.defaultdict(lambda: [0, 0.0]))
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        elif self.current is not None:
            cell = self.seen[self.current][str(info["generation"])]
            cell[0] += 1
            cell[1] += time.perf_counter() - self.t0


def child(args: argparse.Namespace) -> None:
    setup_device(args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    model, step = phased_step(args.device)
    for _ in range(20):
        step([])
    variants = args.variants.split(",")
    for v in variants:
        with variant(v, model):  # warm each variant once (signatures learned, pools filled)
            step([])
    blocks: list[dict] = []
    resolvers: dict[int, str] = {}
    gc_times = GcTimes()
    deadline = time.monotonic() + args.seconds
    i = 0
    while time.monotonic() < deadline:
        # plain, A, plain, B, ...; every other round the variant first, as overhead.py pairs them
        order = [(v, "plain") if i % 2 else ("plain", v) for v in variants]
        i += 1
        for v in (name for pair in order for name in pair):
            with variant(v, model) as settle:
                session = fadiag.current_session() if v.startswith("fadiag") else None
                if session is not None:
                    resolvers[session.resolver._thread.native_id] = v
                for _ in range(3):  # untimed, as overhead.py's warm steps (an order learned:
                    step([])        # the timed steps are bypassed, steps/bypass.py)
                settle()
                sync()
                gc_times.current = v
                t0 = time.monotonic()
                for _ in range(args.steps):
                    step([])
                sync()
                settle()  # the resolver's work on the block's steps, inside the block
                t1 = time.monotonic()
                gc_times.current = None
                blocks.append({"variant": v, "t0": t0, "t1": t1, "steps": args.steps})
    Path(args.stats).write_text(json.dumps({
        "blocks": blocks, "main_tid": threading_main_tid(),
        "resolvers": {str(k): v for k, v in resolvers.items()},
        "gc": {v: dict(g) for v, g in gc_times.seen.items()}}))


def threading_main_tid() -> int:
    return threading.main_thread().native_id or os.getpid()


# ---- the parent: perf around the child, then the attribution -----------------------------

def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default="floor_native,fadiag")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--steps", type=int, default=120, help="steps a block")
    p.add_argument("--top", type=int, default=12, help="symbols listed per variant")
    p.add_argument("--out", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stats", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device == "cpu":
        args.variants = ",".join(v for v in args.variants.split(",") if not v.startswith("floor"))
    if args.child:
        child(args)
        return
    perf = shlex.split(os.environ.get("PERF", "")) or [shutil.which("perf") or ""]
    if not perf[0]:
        sys.exit("profile_step.py: perf is not on PATH (set PERF to the command that runs it)")
    with tempfile.TemporaryDirectory() as tmp:
        stats_path, data = Path(tmp) / "stats.json", Path(tmp) / "perf.data"
        rc = subprocess.call(
            [*perf, "record", "-q", "-e", "cpu-clock", "-c", str(PERIOD_NS), "-k", "CLOCK_MONOTONIC",
             "-o", str(data), "--", sys.executable, __file__, "--child", "--device", args.device,
             "--variants", args.variants, "--seconds", str(args.seconds), "--steps",
             str(args.steps), "--stats", str(stats_path)])
        if rc != 0 or not stats_path.exists():
            sys.exit(f"profile_step.py: perf record or the child failed ({rc})")
        stats = json.loads(stats_path.read_text())
        script = subprocess.Popen([*perf, "script", "-i", str(data), "-F", "comm,tid,time,ip,sym,dso"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert script.stdout is not None
        samples = attribute(script.stdout, stats["blocks"], stats["main_tid"],
                            {int(k): v for k, v in stats["resolvers"].items()})
        script.wait()
    report(args, stats, samples)


def _cell(row: dict[str, float], base: dict[str, float] | None, key: str) -> str:
    """A figure and, with `base`, its difference from it."""
    x = row.get(key, 0.0)
    return f"{x:9.1f}" + (f" ({x - base.get(key, 0.0):+6.1f})" if base is not None else " " * 9)


def report(args: argparse.Namespace, stats: dict, samples: dict) -> None:
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    steps: collections.Counter[str] = collections.Counter()
    walls: collections.Counter[str] = collections.Counter()
    for b in stats["blocks"]:
        steps[b["variant"]] += b["steps"]
        walls[b["variant"]] += b["t1"] - b["t0"]
    print(f"device {args.device} ({name}), torch {torch.__version__}, Python "
          f"{sys.version.split()[0]}; launch-bound step, {args.steps}-step blocks for "
          f"{args.seconds:.0f} s; perf cpu-clock, a sample a ms of a thread's CPU")
    result: dict = {"device": name, "torch": torch.__version__, "python": sys.version.split()[0],
                    "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                    "variants": {}}

    def per_step(v: str, counter: collections.Counter, key: str) -> float:
        return counter.get(key, 0) * PERIOD_NS * 1e-3 / steps[v] if steps[v] else 0.0

    print(f"CPU µs a step by thread (against plain):\n{'':16s}{'wall':>16s}"
          + "".join(f"{r:>18s}" for r in ROLES))
    for v in ["plain"] + args.variants.split(","):
        if not steps[v]:
            continue
        cell = samples.get(v, {"role": {}, "dso": {}, "sym": {}, "autograd_dso": {},
                               "autograd_sym": {}, "other_comm": {}})
        row = {"blocks": sum(1 for b in stats["blocks"] if b["variant"] == v),
               "steps": steps[v], "wall_us": walls[v] / steps[v] * 1e6,
               "role_us": {r: per_step(v, cell["role"], r) for r in ROLES},
               "training_dso_us": {d: per_step(v, cell["dso"], d) for d in cell["dso"]},
               "autograd_dso_us": {d: per_step(v, cell["autograd_dso"], d)
                                   for d in cell["autograd_dso"]},
               "training_sym_us": {s: per_step(v, cell["sym"], s)
                                   for s, _ in collections.Counter(cell["sym"]).most_common(200)},
               "autograd_sym_us": {s: per_step(v, cell["autograd_sym"], s) for s, _ in
                                   collections.Counter(cell["autograd_sym"]).most_common(200)},
               "other_comm_us": {c: per_step(v, cell["other_comm"], c) for c in cell["other_comm"]},
               "gc": stats["gc"].get(v, {})}
        result["variants"][v] = row
        base = result["variants"].get("plain")

        print(f"{v:16s}{row['wall_us']:7.1f}" + (f" ({row['wall_us'] - base['wall_us']:+6.1f})"
                                                 if v != "plain" else " " * 9)
              + "".join(_cell(row["role_us"], base["role_us"] if v != "plain" else None, r)
                        for r in ROLES))
    base = result["variants"].get("plain")
    for v, row in result["variants"].items():
        if v == "plain" or base is None:
            continue
        for key, what in (("training_dso_us", "training thread by shared object"),
                          ("autograd_dso_us", "autograd threads by shared object"),
                          ("training_sym_us", "training thread by symbol"),
                          ("autograd_sym_us", "autograd threads by symbol"),
                          ("other_comm_us", "other threads by name")):
            keys = set(row[key]) | set(base[key])
            d = sorted(((row[key].get(k, 0.0) - base[key].get(k, 0.0), k) for k in keys),
                       key=lambda x: -abs(x[0]))
            print(f"{v}: {what}, µs a step against plain (largest differences):")
            for x, k in d[:args.top]:
                print(f"    {x:+8.1f}  ({row[key].get(k, 0.0):8.1f})  {k[:110]}")
    print("collections (count, ms a block) by generation:")
    for v, gens in stats["gc"].items():
        blocks = result["variants"].get(v, {}).get("blocks", 0) or 1
        print(f"  {v:14s} " + "  ".join(
            f"gen{g}: {n / blocks:.2f} a block, {s / blocks * 1e3:.2f} ms"
            for g, (n, s) in sorted(gens.items())))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
