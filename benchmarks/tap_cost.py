"""What one intercepted fused-attention op call costs the host, by mechanism.

Calls the fused SDPA op directly (as compiled code does) on tiny inputs, forward and backward,
with: nothing (plain); four C++ marks a call from Python (the floor); the tap installed and not
measuring (its wrapping kernel's dispatch and boxing alone); the tap measuring with each cut's
marks given back (its whole C++, no Python); the dispatcher tap alone (a C++ boxed kernel around
the registered one, two marks and a record per op, records cut and made calls every 8 calls); a
Python kernel registered over the op with torch.library that calls the kernel it replaces and
takes two host-clock marks (Python per call); and the whole session (the tap, a step every 8
calls resolved, judged and exported: what a step costs, spread over its calls). Each row is the
median of `--repeats` runs of `--calls` calls. CPU or CUDA (`--device`). Usage:

    python benchmarks/tap_cost.py --device cpu --out benchmarks/results/tap-cost-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fadiag  # noqa: E402

OPS = {"cpu": "_scaled_dot_product_flash_attention_for_cpu", "cuda": "_scaled_dot_product_flash_attention"}


def run(device: str, calls: int, boundary=lambda: fadiag.step(), call=None) -> float:
    op = getattr(torch.ops.aten, OPS[device]).default
    q = torch.randn(1, 1, 16, 64, device=device, dtype=torch.float16 if device == "cuda" else torch.float32,
                    requires_grad=True)
    if call is None:
        def call(q):
            op(q, q, q)[0].sum().backward()
    for _ in range(100):
        call(q)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        call(q)
        if i % 8 == 7:
            boundary()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def raw_tap():
    """The tap alone, without a session: its records drained and their marks given back."""
    from fadiag.capture import native
    from fadiag.capture.calls import Call
    from fadiag.capture.tap import Tap

    tap = Tap(native.load("cuda" if torch.cuda.is_available() else "cpu"), 4096, True)
    tap.install()

    def boundary() -> None:  # the cut (training thread) and the calls (resolver's) both here
        calls, _, _ = tap.calls(tap.cut_step()[0], Call, [])
        for c in calls:
            c.timer.release(c.fwd0, c.fwd1, c.bwd0, c.bwd1)

    return tap, boundary


def released_tap(measuring: bool):
    """The tap with each cut's marks given back on the spot. Measuring: its C++ per op (marks,
    record, pairing) without the Python that turns records into calls; not measuring (a
    sampled-out step): the wrapping kernel's dispatch, boxing and checks alone."""
    tap, _ = raw_tap()
    tap.set_measuring(measuring)

    def boundary() -> None:
        batch = tap.cut_step()[0]
        if batch is not None:
            tap.release(batch)

    return tap, boundary


def floor_marks(device: str):
    """Four C++ marks a call from Python (two around the op, two around its backward): what any
    design with these marks costs, as overhead.py's floor."""
    from fadiag.capture import native

    marks = native.load(device).Marks(device == "cuda")
    marks.ensure(4)
    op = getattr(torch.ops.aten, OPS[device]).default

    def call(q):
        marks.mark(0)
        out = op(q, q, q)[0]
        marks.mark(1)
        s = out.sum()
        marks.mark(2)
        s.backward()
        marks.mark(3)

    return call


def python_override(device: str):
    """A torch.library Python kernel over the op and its backward, calling the replaced ones."""
    lib = torch.library.Library("aten", "IMPL")
    key = "CUDA" if device == "cuda" else "CPU"
    marks: list[float] = []
    for name in (OPS[device], OPS[device] + "_backward"):
        original = torch.library.get_kernel(f"aten::{name}", key)

        def kernel(keys, *args, _original=original, **kwargs):
            marks.append(time.perf_counter())
            out = _original.call_boxed(keys, *args, **kwargs)
            marks.append(time.perf_counter())
            if len(marks) > 4096:
                marks.clear()
            return out

        lib.impl(name, kernel, key, with_keyset=True)
    return lib


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="", help="also write the whole result (every run) here")
    args = p.parse_args()
    rows: dict[str, list[float]] = {"plain": [], "floor": [], "tap_idle": [], "tap_released": [],
                                    "tap": [], "python_library": [], "session": []}
    floor = floor_marks(args.device)
    for _ in range(args.repeats):  # interleaved, so drift in the host's speed hits every row
        rows["plain"].append(run(args.device, args.calls))
        rows["floor"].append(run(args.device, args.calls, lambda: None, floor))
        for name, measuring in (("tap_idle", False), ("tap_released", True)):
            tap, boundary = released_tap(measuring)
            rows[name].append(run(args.device, args.calls, boundary))
            tap.uninstall()
        tap, boundary = raw_tap()
        rows["tap"].append(run(args.device, args.calls, boundary))
        tap.uninstall()
        # The whole of fadiag: the tap, steps cut every 8 calls, resolved, judged and exported.
        fadiag.attach(tap="on", **{"exporter.enabled": False})
        rows["session"].append(run(args.device, args.calls))
        fadiag.detach()
        lib = python_override(args.device)
        rows["python_library"].append(run(args.device, args.calls))
        lib._destroy()
    med = {k: statistics.median(v) for k, v in rows.items()}
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(sys.argv), "us_per_call_fwd_bwd": med,
           "minus_plain_us": {k: v - med["plain"] for k, v in med.items() if k != "plain"},
           "runs": rows}
    print(json.dumps({k: out[k] for k in ("us_per_call_fwd_bwd", "minus_plain_us")}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
