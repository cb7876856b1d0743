"""Where the training thread's time per measured attention call goes, piece by piece.

SDPA calls on tiny inputs, a step every 6 calls: forward only, with one backward a step over its
6 outputs (as a model's step), and with one backward a call (each call after a step's first then
starts a new phase, which Python's path serves); steps closed but never resolved (the resolver's
share is `overhead.py`'s fadiag vs fadiag_no_report). Whole-call figures
(plain; the floor: a Python wrapper with one C++ mark before the op and one C++ `finish` after it;
fadiag, its learned calls timed by the dispatcher tap; fadiag_bypassed, steps bypassed (no fadiag
code per call: steps/bypass.py); fadiag with the wrapper's own marks), the
Python and C calls fadiag makes per measured call, each piece of Python's path
timed alone (best of 5), and `Recorder.begin` whole as the steady state runs it (the C++ fast
path where it is built). Native marks are used on every device kind. Usage:

    python benchmarks/hot_path.py [--device cuda] [--calls 5000]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overhead import release_marks  # noqa: E402
from where_time_goes import per_call_us  # noqa: E402  (the same tiny-call loop)

import fadiag  # noqa: E402
from fadiag.capture import backends, calls, native  # noqa: E402
from fadiag.capture.graph import compiled_autograd_active  # noqa: E402
from fadiag.capture.ops import OPS  # noqa: E402
from fadiag.steps import recorder  # noqa: E402


def attach(native_setting: str, every_n_steps: int = 1, tap: str = "on",
           bypassed: bool | str = False, device: str = "cpu"):
    session = fadiag.attach(port=0, native=native_setting, every_n_steps=every_n_steps, tap=tap,
                            **{"steps.verify_every": 10**9 if bypassed is not False else 0})
    if bypassed is not False:
        # Steps bypassed (steps/bypass.py): three steps resolved, so that the order is learned,
        # before the resolver stops resolving.
        q = torch.randn(1, 1, 16, 16, device=device, requires_grad=True)
        for _ in range(3):
            per_call_us(q, 6, bypassed)
            assert session.flush(10)
    # Closed steps are never resolved; their marks go back to the pool at once (on the
    # training thread, so that cost is in the figures) and no step makes new events.
    session.resolver.submit = release_marks
    return session


def floor_wrapper(marks):
    """overhead.py's floor: four marks a call on four fixed slots, two taken around the call and
    two by C++ hooks on its backward node. (Slots given back at once would disarm those hooks,
    whose marks check the slot's generation: a floor with no backward marks.)"""
    original = F.scaled_dot_product_attention
    marks.ensure(4)

    def wrapped(*args, **kwargs):
        marks.mark(0)
        out = original(*args, **kwargs)
        marks.mark(1)
        marks.hook(out, 2, 3, [])
        return out

    return original, wrapped


MODES: dict[bool | str, str] = {
    False: "forward only",
    "step": "forward + backward, one backward a step (6 calls), as a model's step",
    True: "forward + backward, one backward a call (each call after a step's first starts a new "
          "phase: Python's path)",
}
"""per_call_us's backward modes, and how the figures are labelled."""


def calls_per_call(q: torch.Tensor, n: int = 60) -> tuple[float, float, list[tuple[float, str]]]:
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            counts[f"py {frame.f_code.co_name}"] += 1
        elif event == "c_call":
            counts[f"c  {getattr(arg, '__name__', arg)}"] += 1

    sys.setprofile(profile)
    for _ in range(n):
        F.scaled_dot_product_attention(q, q, q)
    sys.setprofile(None)
    py = sum(v for k, v in counts.items() if k.startswith("py")) / n
    c = sum(v for k, v in counts.items() if k.startswith("c ")) / n
    return py, c, [(v / n, k) for k, v in counts.most_common()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    kind = args.device
    ext = native.load(kind)
    if ext is None:
        sys.exit(f"native marks unavailable: {native.status(kind)}")
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    q = torch.randn(1, 1, 16, 16, device=kind, dtype=dtype, requires_grad=True)

    attach("on")
    per_call_us(q, 300)
    fadiag.detach()
    original, floor = floor_wrapper(ext.Marks(kind == "cuda"))
    # fadiag: learned calls timed by the tap; fadiag_wrapper: the wrapper's C++ marks and hooks
    # (no tap); fadiag_unsampled: every call on a step that sampling skips (the early way out).
    variants = ("plain", "floor", "fadiag", "fadiag_bypassed", "fadiag_wrapper", "fadiag_python",
                "fadiag_unsampled")
    whole: dict[tuple[str, bool | str], list[float]] = collections.defaultdict(list)
    for _ in range(args.repeats):
        for backward in MODES:
            for v in variants:
                if v == "floor":
                    F.scaled_dot_product_attention = floor
                elif v == "fadiag_bypassed" and backward is False:
                    continue  # a forward with no backward is no training step's: not bypassed
                elif v != "plain":
                    attach("off" if v == "fadiag_python" else "on",
                           10**9 if v == "fadiag_unsampled" else 1,
                           "off" if v in ("fadiag_wrapper", "fadiag_python") else "on",
                           backward if v == "fadiag_bypassed" else False, kind)
                per_call_us(q, 60, backward)
                whole[v, backward].append(per_call_us(q, args.calls, backward))
                F.scaled_dot_product_attention = original
                if v.startswith("fadiag"):
                    fadiag.detach()
    session = attach("on")
    per_call_us(q, 60, backward=False)
    py, c, top = calls_per_call(q)
    name = torch.cuda.get_device_name() if kind == "cuda" else "cpu"
    print(f"device {kind} ({name}), torch {torch.__version__}; SDPA on 1x1x16x16, steps closed "
          f"and never resolved, median of {args.repeats} x {args.calls} calls")
    for backward, label in MODES.items():
        plain = statistics.median(whole["plain", backward])
        print(f"{label}:")
        for v in variants:
            if not whole[v, backward]:
                continue
            m = statistics.median(whole[v, backward])
            print(f"  {v:16s} {m:7.2f} us/call  (+{m - plain:.2f} us)")
    print(f"fadiag per measured call: {py:.0f} Python calls, {c:.0f} C calls")
    print("  " + ", ".join(f"{n:g}x {k}" for n, k in top))

    # Each piece of Python's path (Recorder.wrap -> begin -> end), timed alone. Since design
    # change 10 the steady state runs begin's pieces in one C++ call (timed whole below); Python's
    # path serves a signature's first calls, new phases and whatever the C++ path hands back.
    rec = session.recorder
    op = next(o for o in OPS if o.name == "sdpa")
    timer = rec.devices.timer(kind)
    qkv_args: tuple = (q, q, q)
    out = F.scaled_dot_product_attention(q, q, q)
    dev = q.device
    extra = op.quick(qkv_args, {})[3]
    key = (op.name, q.shape, q.shape, q.shape, q.dtype, dev, True, True, True, True,
           backends.backend_flags(), extra)

    def mark_and_release():
        timer.release(timer.mark())

    start = timer.mark()

    def finish_and_release():  # the window's end asks whether the device passed `start`
        timer.release(*timer.finish(out, (), start))

    def make_key():
        return (op.name, q.shape, q.shape, q.shape, q.dtype, q.device, True, q.requires_grad,
                q.requires_grad, q.requires_grad, backends.backend_flags(), extra)

    def site():
        return rec._site(False)

    def caller():  # _site starts three frames up, as from the wrapper
        return (lambda: (lambda: site())())()

    def boundary_over_6():
        rec.boundary("manual")

    pieces = {
        "wrapper checks (is_compiling)": recorder._is_compiling,
        "grad mode + graph task id": lambda: (recorder._grad_enabled(), recorder._graph_task_id()),
        "native backward counter": rec._native_backward_seen,
        "argument reader (quick_sdpa)": lambda: op.quick(qkv_args, {}),
        "backend flags": backends.backend_flags,
        "signature key": make_key,
        "signature lookup": lambda: rec.signatures.get(key),
        "timer lookup": lambda: rec.devices.timer(dev.type),
        "Call object": lambda: calls.Call("x#0", timer, False, key, None, qkv_args),
        "site (file:line#n)": caller,
        "forward start mark": mark_and_release,
        "compiled autograd check": compiled_autograd_active,
        "finish: end mark + C++ hooks": finish_and_release,
    }
    print("pieces (ns per call, best of 5):")
    total = 0.0
    for label, fn in pieces.items():
        n = 20000
        ns = min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e9
        rec.sites.counts.clear()
        total += ns
        print(f"  {label:32s} {ns:8.0f}")
    print(f"  {'sum of pieces':32s} {total:8.0f}")

    # The steady state as it runs since design change 10: begin() in one C++ call, where built.
    def begin_and_release():
        call = rec.begin(op, qkv_args, {})
        rec.calls.pop()
        timer.release(call.fwd0)

    n = 20000
    ns = min(timeit.repeat(begin_and_release, number=n, repeat=5)) / n * 1e9
    rec.sites.counts.clear()
    how = "the C++ fast path" if rec._fast is not None else "Python's path (no fast path here)"
    print(f"Recorder.begin, whole, as the steady state runs it ({how}): {ns:.0f} ns")
    timer.release(start)
    fadiag.detach()


if __name__ == "__main__":
    main()
