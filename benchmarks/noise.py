"""Where the launch-bound step's block-to-block spread comes from: the host or the device.

`overhead.py` reads plain against plain ±5 points on the launch-bound GPT (BENCHMARKS.md, runs
81–91), with process CPU time moving with the wall pair by pair. That does not say whose speed
moves: a host waiting for a slower device spins in CUDA's synchronise (or in a launch once the
queue is full) and burns CPU time too. This script runs plain blocks back to back and records,
per block: the wall time a step, the host's time to issue the block (before its closing
synchronise), the training thread's and the process's CPU time, and the device's time from the
block's first kernel to its last (two events); once, the kernels' own time a step
(torch.profiler), which says how much of the step the device works at all. With
`--reference`, a child process pinned to one CPU spins on a fixed piece of Python beside it, and
each block also records that process's rate: if the host's speed is what moves, a block's wall
time times the reference rate (normalised to its median) moves less than the wall. Pairs of
adjacent blocks give each figure's spread, as `overhead.py` pairs them. `nvidia-smi`'s clocks,
where it answers, are sampled beside it.

    python benchmarks/noise.py --blocks 40 --steps 120 [--reference] --out noise.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overhead import make, median_ci95  # noqa: E402


def _spin(cpu: int, count) -> None:
    """The reference: a fixed piece of Python, counted, for ever (on one CPU)."""
    os.sched_setaffinity(0, {cpu})
    while True:
        sum(range(1000))
        count.value += 1


class Reference:
    """The spinning child process and its count (a shared 64-bit integer, no lock: one writer)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no CUDA state in the child
        self.count = ctx.Value("q", 0, lock=False)
        cpu = max(os.sched_getaffinity(0))
        self.proc = ctx.Process(target=_spin, args=(cpu, self.count), daemon=True)
        self.proc.start()
        while self.count.value == 0:
            time.sleep(0.01)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.join(5)


def block(step, n: int, ref: Reference | None = None) -> dict[str, float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step()
    torch.cuda.synchronize()
    c0, th0 = time.process_time(), time.thread_time()
    r0 = ref.count.value if ref is not None else 0
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        step()
    end.record()
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {"wall": wall / n, "issued": issued / n, "device": start.elapsed_time(end) * 1e-3 / n,
           "cpu": (time.process_time() - c0) / n, "thread_cpu": (time.thread_time() - th0) / n}
    if ref is not None:
        out["reference_rate"] = (ref.count.value - r0) / wall
    return out


def device_busy(step, n: int = 20) -> float:
    """Seconds of kernels a step (torch.profiler's device time, kernels only): with the wall step,
    how much of the step the device works at all."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.events() if e.device_type.name == "CUDA")
    return total_us * 1e-6 / n


def clocks(proc: subprocess.Popen | None) -> list[str]:
    if proc is None:
        return []
    proc.terminate()
    out, _ = proc.communicate(timeout=5)
    return [line for line in out.splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--model", default="launch_bound")
    p.add_argument("--out", default="noise.json")
    p.add_argument("--reference", action="store_true",
                   help="a child process spinning on one CPU, its rate recorded per block")
    args = p.parse_args()
    ref = Reference() if args.reference else None
    _, step = make(args.model)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    try:
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw",
             "--format=csv,noheader", "-lms", "500"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        smi = None
    blocks = [block(step, args.steps, ref) for _ in range(args.blocks)]
    if ref is not None:
        ref.close()
        typical = statistics.median(b["reference_rate"] for b in blocks)
        for b in blocks:  # the wall at the reference's typical speed
            b["wall_normalised"] = b["wall"] * b["reference_rate"] / typical
    samples = clocks(smi)
    busy = device_busy(step)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                    "affinity": sorted(os.sched_getaffinity(0)), "kernel_s_a_step": busy, "blocks": blocks,
                    "nvidia_smi": samples}
    print(f"{args.model}: {args.blocks} blocks of {args.steps} steps; CPUs {len(result['affinity'])}")
    for key in ("wall", "issued", "device", "cpu", "thread_cpu", "reference_rate",
                "wall_normalised"):
        if key not in blocks[0]:
            continue
        xs = [b[key] for b in blocks]
        pairs = [xs[i + 1] / xs[i] - 1.0 for i in range(0, len(xs) - 1, 2)]
        q = statistics.quantiles(pairs, n=4)
        lo, hi = median_ci95(pairs)
        scale, unit = (1e-3, "k/s") if key == "reference_rate" else (1e3, "ms a step")
        print(f"  {key:15s} median {statistics.median(xs) * scale:7.3f} {unit} "
              f"(min {min(xs) * scale:.3f}, max {max(xs) * scale:.3f}); adjacent pairs "
              f"{statistics.median(pairs) * 100:+.2f} % (95 % CI {lo * 100:+.2f} .. {hi * 100:+.2f}; "
              f"IQR {q[0] * 100:+.2f} .. {q[2] * 100:+.2f})")
    wall = statistics.median(b["wall"] for b in blocks)
    print(f"  kernels {busy * 1e3:.3f} ms a step (torch.profiler): the device works "
          f"{busy / wall:.0%} of the wall step")
    if samples:
        print(f"  nvidia-smi ({len(samples)} samples): first {samples[0]}; last {samples[-1]}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
