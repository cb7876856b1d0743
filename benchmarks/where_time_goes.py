"""Where fadiag's host time per attention call goes: knock out one part at a time.

Tiny SDPA calls (forward + backward, a step every 6 calls) keep the GPU idle, so the loop time
is host time. Each variant removes one piece of the measurement; the differences attribute the
cost. Usage:

    python benchmarks/where_time_goes.py [--device cuda] [--calls 3000]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fadiag  # noqa: E402
from fadiag.capture import device  # noqa: E402
from fadiag.steps import recorder, resolver  # noqa: E402


class _Done:
    """A mark that is already complete: stands in for a device event."""

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: object) -> float:
        return 0.0


@contextlib.contextmanager
def knocked_out(part: str):
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    if part == "events":
        patch(device.EventTimer, "mark", lambda self: _Done())
    elif part == "backward_hooks":
        patch(recorder.Recorder, "_hook_backward", lambda self, *a: None)
    elif part == "resolver_work":
        patch(resolver.Resolver, "_report", lambda self, step, timed: None)
    elif part == "site_lookup":
        patch(recorder.Recorder, "_site", lambda self, recompute: "x#0")
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def per_call_us(q: torch.Tensor, calls: int, backward: bool | str = True) -> float:
    """Host µs per SDPA call, a step every 6 calls: with its own backward (True), forward only
    (False), or with one backward a step over the step's 6 outputs ("step", as a model's step
    runs: each call's backward op inside one backward pass)."""
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    sync()
    outs: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for i in range(calls):
        out = F.scaled_dot_product_attention(q, q, q)
        if backward == "step":
            outs.append(out)
        elif backward:
            out.sum().backward()
        if i % 6 == 5:
            if outs:
                torch.stack([o.sum() for o in outs]).sum().backward()
                outs.clear()
            fadiag.step()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    q = torch.randn(1, 1, 16, 16, device=args.device, dtype=dtype, requires_grad=True)
    per_call_us(q, 300)
    variants = ["plain", "fadiag", "events", "backward_hooks", "resolver_work", "site_lookup",
                "native"]
    results: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            if v == "plain":
                results[v].append(per_call_us(q, args.calls))
                continue
            with knocked_out(v):  # the knock-outs attribute the Python marks' cost
                fadiag.attach(port=0, native="on" if v == "native" else "off")
                per_call_us(q, 300)
                results[v].append(per_call_us(q, args.calls))
                fadiag.detach()
    plain = statistics.median(results["plain"])
    full = statistics.median(results["fadiag"])
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}; median of {args.repeats} x {args.calls} calls")
    print(f"plain {plain:.1f} us/call; fadiag {full:.1f} us/call: +{full - plain:.1f} us")
    for v in variants[2:-1]:
        m = statistics.median(results[v])
        print(f"  without {v:15s} {m:7.1f} us/call -> {v} costs {full - m:6.1f} us")
    m = statistics.median(results["native"])
    print(f"with native marks (C++ marks and backward hooks): {m:.1f} us/call: +{m - plain:.1f} us")


if __name__ == "__main__":
    main()
