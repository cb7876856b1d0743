"""What a thread's Python bursts cost a launch-bound training step, beside it.

The resolver thread holds the GIL while it runs Python; a training step releases and takes the
GIL back at every torch op, and the autograd engine takes it during backward to free tensors
that Python once held. This runs the small CPU GPT step of in_situ.py alone, then beside a thread
that runs Python for 200 µs and sleeps 1 ms (a resolver's duty: ~17 % of one core), then alone
again, and prints each phase's median host time. Usage:

    python benchmarks/gil_bursts.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from in_situ import phased_step  # noqa: E402


def phases(step, n: int) -> list[float]:
    """Median host µs of forward, backward and optimizer over `n` steps."""
    out: list[tuple[float, float, float]] = []
    for _ in range(n):
        step(out)
    return [round(statistics.median(c) * 1e6) for c in zip(*out, strict=True)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--burst-us", type=float, default=200.0)
    p.add_argument("--sleep-us", type=float, default=1000.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    _, step = phased_step("cpu")
    phases(step, 20)
    stop = threading.Event()

    def bursts() -> None:
        burst, pause = args.burst_us * 1e-6, args.sleep_us * 1e-6
        while not stop.is_set():
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < burst:
                pass
            time.sleep(pause)

    print(f"torch {torch.__version__}; forward / backward / optimizer, median µs over "
          f"{args.steps} steps")
    print("alone                ", phases(step, args.steps))
    thread = threading.Thread(target=bursts, daemon=True)
    thread.start()
    print(f"beside {args.burst_us:.0f} µs bursts ", phases(step, args.steps))
    stop.set()
    thread.join()
    print("alone again          ", phases(step, args.steps))


if __name__ == "__main__":
    main()
