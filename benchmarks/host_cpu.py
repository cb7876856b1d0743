"""fadiag's host cost on CPU: native against Python marks, with and without the resolver's work.

Two workloads: tiny SDPA calls (forward + backward, a step every 6 calls: all host time) and a
6-layer GPT training step. Variants interleaved, median of repetitions; `native_no_resolver`
closes steps but never resolves them, which leaves the training thread's own cost. Usage:

    python benchmarks/host_cpu.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overhead import release_marks  # noqa: E402
from where_time_goes import per_call_us  # noqa: E402  (the same tiny-call loop)

import fadiag  # noqa: E402
from fadiag.capture import native  # noqa: E402
from fadiag.steps import resolver  # noqa: E402
from tests.models import GPT  # noqa: E402

VARIANTS = ("plain", "native", "native_no_resolver", "python")


def attach(variant: str) -> None:
    if variant == "native_no_resolver":
        # Closed steps give their marks back at once and are never resolved.
        resolver.Resolver.submit = lambda self, step: release_marks(step)
    fadiag.attach(port=0, native="off" if variant == "python" else "on")


def detach(original_submit) -> None:
    fadiag.detach()
    resolver.Resolver.submit = original_submit


def tiny_calls(n: int) -> float:
    return per_call_us(torch.randn(1, 1, 16, 16, requires_grad=True), n)


def gpt_steps(n: int) -> float:
    torch.manual_seed(0)
    model = GPT(layers=6, dim=64, heads=4, vocab=64)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 64, (2, 64))

    def step():
        model(tokens).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    logging.getLogger("fadiag").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    if native.load("cpu") is None:
        sys.exit(f"native marks unavailable: {native.status('cpu')}")
    submit = resolver.Resolver.submit
    results: dict[str, dict[str, list[float]]] = {"tiny": {}, "gpt": {}}
    for _ in range(args.repeats):
        for v in VARIANTS:
            if v != "plain":
                attach(v)
            tiny_calls(200)
            results["tiny"].setdefault(v, []).append(tiny_calls(3000))
            results["gpt"].setdefault(v, []).append(gpt_steps(40))
            if v != "plain":
                detach(submit)
    print(f"torch {torch.__version__}, 1 thread, median of {args.repeats}")
    for workload, unit in (("tiny", "us/call"), ("gpt", "ms/step")):
        plain = statistics.median(results[workload]["plain"])
        for v in VARIANTS:
            m = statistics.median(results[workload][v])
            print(f"{workload:5s} {v:19s} {m:8.2f} {unit}  {100 * (m / plain - 1):+6.1f} %")


if __name__ == "__main__":
    main()
