"""Where the resolver thread's time goes, per step: its Python, function by function.

Runs `overhead.py`'s launch-bound GPT step (a small GPT on CPU) with a session attached, the
resolver thread under cProfile, and prints the functions that took its time (their own time and
with what they call, per step). cProfile's own cost inflates each figure (~2-4x); read them as
shares. The resolver holds the GIL while it runs Python, and on a launch-bound step the training
thread and the autograd engine's thread want it back all the time (benchmarks/BENCHMARKS.md,
runs 67-69), so this is the list to shorten. Usage:

    python benchmarks/resolver_cost.py [--device cuda] [--steps 300]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from in_situ import phased_step, setup_device  # noqa: E402

import fadiag  # noqa: E402
from fadiag.steps import resolver  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    setup_device(args.device)
    profile = cProfile.Profile()
    run = resolver.Resolver._run

    def profiled(self: resolver.Resolver) -> None:
        profile.enable()
        try:
            run(self)
        finally:
            profile.disable()

    resolver.Resolver._run = profiled  # type: ignore[method-assign]
    import overhead

    model, step = phased_step(args.device)
    for _ in range(20):
        step([])
    session = fadiag.attach(port=0, **overhead.ATTACH_DEFAULTS)
    try:
        for _ in range(args.steps):
            step([])
        session.flush(60)
    finally:
        fadiag.detach()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.strip_dirs()
    total = sum(tt for (_, _, tt, _, _) in stats.stats.values())  # type: ignore[attr-defined]
    waits = sum(tt for (f, (_, _, tt, _, _)) in stats.stats.items()  # type: ignore[attr-defined]
                if "acquire" in f[2] or "wait_window" in f[2])
    print(f"device {args.device}, torch {torch.__version__}; {args.steps} launch-bound steps; "
          f"resolver thread: {(total - waits) / args.steps * 1e6:.1f} us of Python a step under "
          f"cProfile (waiting excluded)")
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
