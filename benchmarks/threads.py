"""Where a launch-bound step's extra time lands, thread by thread.

A launch-bound step is host work in series: the training thread queues the forward pass, the
autograd engine's device thread queues the backward, the training thread the optimizer. What a
variant adds to that work shows as CPU time on the thread that does it; what it adds as waiting
(for the GIL, a lock, the device) shows as wall time that no thread's CPU time explains. This
script runs `overhead.py`'s launch-bound step (a small GPT on CPU) in interleaved blocks (plain,
variant, plain, variant, ...) and reports, per step, the medians over the blocks of: wall time,
CPU time of the training thread, of fadiag's resolver thread and of every other thread (the
autograd engine's), each against the plain block beside it. For fadiag variants it also counts
where the resolver ran: inside a backward window (the training thread then blocked in
backward() without the GIL) from start to end, or not. Usage:

    python benchmarks/threads.py [--device cuda] [--pairs 20] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from in_situ import phased_step, setup_device  # noqa: E402
from overhead import median_ci95, variant  # noqa: E402

import fadiag  # noqa: E402

COLUMNS = ("wall", "training", "resolver", "other")


def _run_seconds(tid: int) -> float | None:
    """A thread's CPU time so far in ns resolution (the scheduler's own count), or None where
    the kernel does not give it."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) * 1e-9
    except (OSError, ValueError, IndexError):
        return None


def cpu_by_thread(resolver_tid: int | None) -> dict[str, float]:
    """CPU seconds so far of the training thread, the resolver and all other threads (from
    /proc's schedstat; psutil's clock-tick counts, 10 ms, where there is none)."""
    main = threading.main_thread().native_id
    out = dict.fromkeys(COLUMNS[1:], 0.0)
    for t in psutil.Process().threads():
        who = "training" if t.id == main else "resolver" if t.id == resolver_tid else "other"
        run = _run_seconds(t.id)
        out[who] += run if run is not None else t.user_time + t.system_time
    return out


class WindowCount:
    """Counts the resolver's _try_resolve calls by whether a backward window was open when each
    began and still open when it ended (the timer it waits for, as `_await_window` picks it)."""

    def __init__(self, session):
        self.resolver = session.resolver
        self.inner = self.resolver._try_resolve
        self.counts = {"in_window": 0, "began_in_window": 0, "outside": 0}

        def counted(step):
            t = self.resolver._window_timer()
            began = t is not None and t.window()
            try:
                return self.inner(step)
            finally:
                ended = t is not None and t.window()
                key = "in_window" if began and ended else "began_in_window" if began else "outside"
                self.counts[key] += 1

        self.resolver._try_resolve = counted


def block(name: str, model, step, steps: int, windows: dict) -> dict[str, float]:
    """Per-step wall and CPU seconds of one block of `steps` steps under `name`."""
    cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
    with variant(name, model):
        session = fadiag.current_session() if name.startswith("fadiag") else None
        tid = session.resolver._thread.native_id if session is not None else None
        count = WindowCount(session) if session is not None else None
        step([])  # untimed: signatures learned on the first measured step
        if cuda:
            torch.cuda.synchronize()
        before, t0 = cpu_by_thread(tid), time.perf_counter()
        for _ in range(steps):
            step([])
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if session is not None:
            session.flush(30)  # the resolver's work on these steps counts, done in or after them
        after = cpu_by_thread(tid)
        if count is not None:
            for k, v in count.counts.items():
                windows.setdefault(name, dict.fromkeys(count.counts, 0))[k] += v
    out = {"wall": wall / steps}
    out.update({k: (after[k] - before[k]) / steps for k in after})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--variants", default="floor_native,fadiag_tap_only,fadiag")
    p.add_argument("--out", default="")
    args = p.parse_args()
    setup_device(args.device)
    variants = [v for v in args.variants.split(",")
                if not (args.device == "cpu" and v.startswith("floor"))]  # the floor is CUDA's
    if not variants:
        p.error(f"no variant of --variants {args.variants!r} runs on {args.device} "
                "(the floor's marks are CUDA's)")
    model, step = phased_step(args.device)
    for _ in range(20):
        step([])
    deltas: dict[str, dict[str, list[float]]] = {}
    plain_wall: list[float] = []
    windows: dict[str, dict[str, int]] = {}
    for v in variants:
        block(v, model, step, 3, {})  # warm the variant
    for _ in range(args.pairs):
        for v in variants:
            a = block("plain", model, step, args.steps, {})
            b = block(v, model, step, args.steps, windows)
            plain_wall.append(a["wall"])
            for k in COLUMNS:
                deltas.setdefault(v, {}).setdefault(k, []).append(b[k] - a[k])
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {args.device} ({name}), torch {torch.__version__}; launch-bound GPT step, "
          f"{args.pairs} pairs x {args.steps} steps per variant; plain "
          f"{statistics.median(plain_wall) * 1e3:.2f} ms a step")
    print("us per step against the plain block beside it: median (95 % CI of the median)")
    print(f"{'':18s}" + "".join(f"{c:>26s}" for c in COLUMNS))
    result: dict = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "command": " ".join(sys.argv),
                    "plain_ms": statistics.median(plain_wall) * 1e3, "variants": {}}
    for v in variants:
        cells, row = [], {}
        for k in COLUMNS:
            xs = deltas[v][k]
            lo, hi = median_ci95(xs)
            row[k] = {"median_us": statistics.median(xs) * 1e6, "ci95_us": [lo * 1e6, hi * 1e6]}
            cells.append(f"{statistics.median(xs) * 1e6:+8.1f} ({lo * 1e6:+.0f}..{hi * 1e6:+.0f})")
        print(f"{v:18s}" + "".join(f"{c:>26s}" for c in cells))
        if v in windows:
            row["resolves"] = windows[v]
        result["variants"][v] = row
    for v, counts in windows.items():
        print(f"{v}: resolves {counts}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
