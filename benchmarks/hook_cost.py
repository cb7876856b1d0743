"""What the optimizer's hook costs the training thread, where steady steps are closed in C++.

Runs `overhead.py`'s launch-bound GPT step (a small GPT on CPU) with a session attached, as a
card's host runs it (no CPU wait read, runs of steps closed in C++ capped as device-clock ones),
and times, on the training thread, right after each optimizer step: the whole hook
(`Session._on_optimizer_step`), the C++ `QuietSteps.step` it calls, and then a pybind call that
does nothing (what any native call costs with the caches the optimizer left). With the extension
built from a tree patched with `benchmarks/results/hook-laps.patch` (steady-clock laps between
the pieces of `QuietSteps::close`, exposed as `quiet_pieces()`), it also prints each piece's mean.
Usage:

    python benchmarks/hook_cost.py [--steps 800]

    git worktree add /tmp/laps HEAD && cd /tmp/laps && git apply benchmarks/results/hook-laps.patch
    python benchmarks/hook_cost.py   # from /tmp/laps: its own build of the extension
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from torch.optim import optimizer as optim_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import overhead  # noqa: E402
from in_situ import phased_step, setup_device  # noqa: E402

import fadiag  # noqa: E402
from fadiag.capture import host, native  # noqa: E402
from fadiag.steps import quiet  # noqa: E402

PIECES = ("the recorder's calls since the boundary, its calls, pending",
          "the tap's order, its broken, the tap's CUDA graph calls",
          "the recorder's unmeasured counts summed",
          "the builtins' count and the tap's cut (cut_if_quiet)",
          "the pools' backward state reset",
          "the run's clocks and appends")
"""QuietSteps::close's pieces, in the order hook-laps.patch laps them."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=800)
    args = p.parse_args()
    host.CpuWait.read = lambda self: None  # type: ignore[method-assign]
    quiet._CAP_HOST_S = quiet._CAP_S
    setup_device("cpu")
    overhead.ATTACH_DEFAULTS["sampling.reports_per_second"] = 10.0
    model, step = phased_step("cpu")
    for _ in range(20):
        step([])
    session = fadiag.attach(port=0, **overhead.ATTACH_DEFAULTS)
    rec = session.recorder
    whole: list[int] = []
    in_cpp: list[int] = []
    after: list[int] = []
    on_step = session._on_optimizer_step

    def timed_hook(optimizer, hook_args, hook_kwargs) -> None:
        t0 = time.perf_counter_ns()
        on_step(optimizer, hook_args, hook_kwargs)
        whole.append(time.perf_counter_ns() - t0)

    # The session registered its bound method at attach: the global hook is swapped in place.
    hooks = optim_module._global_optimizer_post_hooks
    key = next(k for k, fn in hooks.items() if getattr(fn, "__self__", None) is session)
    hooks[key] = timed_hook
    native_step = rec.step_hook

    def timed_step() -> None:
        t0 = time.perf_counter_ns()
        native_step()
        in_cpp.append(time.perf_counter_ns() - t0)

    rec.step_hook = timed_step
    try:
        for _ in range(args.steps):
            step([])
            t0 = time.perf_counter_ns()
            rec.quiet.native.armed()
            after.append(time.perf_counter_ns() - t0)
        session.flush(60)
        closed = rec.quiet.closed
    finally:
        fadiag.detach()
    print(f"{args.steps} launch-bound CPU steps, {closed} closed in C++; median µs a step:")
    print(f"  the whole hook (Session._on_optimizer_step)   {statistics.median(whole) / 1e3:7.1f}")
    print(f"  QuietSteps.step, from Python                  {statistics.median(in_cpp) / 1e3:7.1f}")
    print(f"  a pybind call that does nothing, right after  {statistics.median(after) / 1e3:7.1f}")
    laps = getattr(native.load("cpu"), "quiet_pieces", None)
    if laps is not None:
        sums = laps()
        print(f"QuietSteps::close, {sums[7]} calls; mean µs a call:")
        for name, ns in zip(PIECES, sums[:6], strict=True):
            print(f"  {name:58s} {ns / max(sums[7], 1) / 1e3:5.2f}")


if __name__ == "__main__":
    main()
