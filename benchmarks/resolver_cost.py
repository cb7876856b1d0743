"""Where the resolver thread's time goes, per step: its pieces, timed where they run.

Runs `overhead.py`'s launch-bound GPT step (a small GPT on CPU) with a session attached and times,
on the resolver thread, each piece of a step's resolution with the host clock (a thin wrapper per
piece; nested pieces are inside their caller's figure): joining the tap's records, building the
report, the rules, the sinks; and, on the training thread, the step boundary that hands each closed
step over (`Recorder.boundary`, at the optimizer's step), with its pieces: the tap's cut, a bypassed
step's calls counted, the next step opened and, on CPU, the process's CPU wait read. Each piece: the
median of its calls in µs, its calls a step, and its µs a step (all its calls' over all steps:
steady steps are counted in runs, several steps a call). The resolver holds the GIL while it runs
Python, and on a launch-bound step the training thread and the autograd engine's thread want it back
all the time (benchmarks/BENCHMARKS.md, runs 67-69), so this is the list to shorten. (cProfile is
not used for these figures: from Python 3.12 it profiles every thread at once; `--profile N` runs it
on the replay, where one thread works.) With `--replay` the closed steps are held instead, and
resolved afterwards on the main thread with nothing beside it: each piece's own cost, with no wait
for the GIL in it, the figure to compare between commits. With `--inline` each step is resolved on
the main thread at a later step boundary, between training steps, as the resolver's work would run
in situ without a second thread: against `--replay`, what cold caches cost it. Usage:

    python benchmarks/resolver_cost.py [--device cuda] [--steps 300] [--replay [--profile N] | --inline]
        [--reports-per-second R] [--no-cpu-wait] [--cap-s S]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import overhead  # noqa: E402
from in_situ import phased_step, setup_device  # noqa: E402

import fadiag  # noqa: E402
from fadiag import session as session_module  # noqa: E402
from fadiag.capture import host, tap  # noqa: E402
from fadiag.steps import boundary, quiet, recorder, resolver  # noqa: E402

# (owner, attribute, label): class attributes are timed for every instance; an instance's are
# set once the session exists (the "rules" and "sinks" owners).
PIECES = (
    (resolver.Resolver, "_count_run", "steady steps counted in a run"),
    (resolver.Resolver, "_quiet_head", "steps closed in C++, a run's head"),
    (resolver.Resolver, "_try_resolve", "a step resolved alone"),
    (boundary.ClosedStep, "take_tap", "  the tap's records joined"),
    (resolver.Resolver, "_report", "  the report"),
    (resolver.Resolver, "_step_peak", "    allocator peak"),
    ("rules", "evaluate", "    rules"),
    ("sinks", "emit", "    sinks"),
    ("metrics", "count", "  a counted step's rows, counted"),
    (session_module.Session, "_on_optimizer_step", "optimizer's hook, training thread"),
    (boundary.StepBoundaries, "boundary", "  step boundary in Python"),
    (quiet.QuietSteps, "take", "    steps closed in C++ handed over"),
    (tap.Tap, "cut_step", "    the tap's records cut"),
    (recorder.Recorder, "_closing", "    a bypassed step's calls counted"),
    (recorder.Recorder, "_next_step", "    the next step opened"),
    (host.CpuWait, "read", "    the CPU wait read (CPU steps)"),
)


def timed(times: list[float], inner: Any) -> Any:
    clock = time.perf_counter

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            times.append(clock() - t0)

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=300)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--replay", action="store_true",
                     help="hold the closed steps, then resolve them on this thread, alone")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="with --replay: also profile the replay (cProfile, one thread runs) and "
                        "print its N costliest functions by own time")
    how.add_argument("--inline", action="store_true",
                     help="resolve each closed step on this thread at a later step boundary, "
                          "between training steps (overhead.py's fadiag_inline)")
    p.add_argument("--reports-per-second", type=float, default=0.0,
                   help="sampling.reports_per_second (0: every step reported)")
    p.add_argument("--no-cpu-wait", action="store_true",
                   help="on CPU, the training thread as a card's host runs it: no CPU wait read "
                        "(host.CpuWait.read answers None) and runs of steps closed in C++ capped "
                        "as device-clock ones (steps/quiet.py)")
    p.add_argument("--cap-s", type=float, default=None,
                   help="the longest run of steps closed in C++ before the Python boundary hands "
                        "them over (steps/quiet.py's _CAP_S; with --no-cpu-wait on CPU too)")
    args = p.parse_args()
    if args.cap_s is not None:
        quiet._CAP_S = args.cap_s
    if args.no_cpu_wait:
        host.CpuWait.read = lambda self: None  # type: ignore[method-assign]
        quiet._CAP_HOST_S = quiet._CAP_S
    setup_device(args.device)
    overhead.ATTACH_DEFAULTS["sampling.reports_per_second"] = args.reports_per_second
    model, step = phased_step(args.device)
    for _ in range(20):
        step([])
    times: dict[str, list[float]] = {label: [] for _, _, label in PIECES}
    for owner, attr, label in PIECES:
        if not isinstance(owner, str):
            setattr(owner, attr, timed(times[label], getattr(owner, attr)))
    session = fadiag.attach(port=0, **overhead.ATTACH_DEFAULTS)
    owners = {"rules": session.rules, "sinks": session.sinks, "metrics": session.metrics}
    for owner, attr, label in PIECES:
        if isinstance(owner, str):
            setattr(owners[owner], attr, timed(times[label], getattr(owners[owner], attr)))
    held: list = []
    if args.replay:
        # Steps closed in C++ (a QuietRun) are held as the ClosedSteps the resolver makes of
        # them one at a time (QuietRun.split): the replay resolves one step at a time.
        session.resolver.submit = lambda closed: held.extend(
            [closed.split() for _ in range(len(closed))]
            if isinstance(closed, quiet.QuietRun) else [closed])
        # Replayed one by one, every step would be the newest handed over, which is always
        # reported: with a rate set, the others are counted as they would be in situ.
        session.resolver._newest = lambda step: False
    settle = overhead.inline_resolution(session) if args.inline else None
    try:
        step([])  # signatures learned
        for _ in range(args.steps):
            step([])
        if args.replay:
            if args.device == "cuda":
                torch.cuda.synchronize()  # every mark passed: no resolution waits
            # Not the first step: it learned the signatures. With --profile the second half of
            # the steps is replayed under cProfile, and only the first half gives the figures.
            half = 1 + (len(held) - 1) // 2 if args.profile else len(held)
            for closed in held[1:half]:
                assert session.resolver._try_resolve(closed)
            figures = {label: len(v) for label, v in times.items()}
            if args.profile:
                profile = cProfile.Profile()
                profile.enable()
                for closed in held[half:]:
                    assert session.resolver._try_resolve(closed)
                profile.disable()
                for label, n in figures.items():
                    del times[label][n:]
        if settle is not None:
            settle()
        session.flush(60)
        calls = statistics.median(len(r.calls) for r in session.history())
    finally:
        fadiag.detach()
    where = ("replayed on the main thread, alone" if args.replay else
             "on the training thread, between steps" if args.inline else "resolver thread")
    print(f"device {args.device}, torch {torch.__version__}; {args.steps} launch-bound steps, "
          f"{calls:g} calls a step; {where}, median µs a call (calls a step; mean µs a step); "
          f"reports_per_second {args.reports_per_second:g}")
    steps = len(times["optimizer's hook, training thread"]) or 1
    for _, _, label in PIECES:
        v = times[label]
        if v:
            print(f"  {label:35s} {statistics.median(v) * 1e6:8.1f}   x{len(v) / steps:.2f}"
                  f"   (mean a step {sum(v) / steps * 1e6:.1f})")
    if args.replay and args.profile:
        print(f"\nthe replay's second half under cProfile ({len(held) - half} steps; its own cost "
              "inflates small functions most):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
