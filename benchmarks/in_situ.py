"""Where fadiag's time goes inside a real training step, not in a loop of tiny calls.

`hot_path.py` times the per-call path on a warm loop of tiny SDPA calls. In a training step the
same code runs between large ops that evict its code and data from the CPU's caches, so each
piece costs more. This script runs the launch-bound GPT step of `overhead.py` (on CUDA; a small
GPT on CPU) and records, per step, the host time of each phase (forward with loss, backward,
optimizer step with zero_grad), the host time of each SDPA call seen from outside fadiag's
wrapper, and the time of fadiag's own pieces (each timed by a thin wrapper), for
plain steps, the floor (four C++ marks per call) and fadiag. Variants are interleaved in blocks;
fadiag's pieces are timed in blocks of their own, so their wrappers cost nothing in the phase and
SDPA figures. Figures are medians over all blocks; the resolver thread's work per step is the sum
of its timed `_try_resolve` calls over the steps. Usage:

    python benchmarks/in_situ.py [--device cuda] [--blocks 8] [--steps 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import overhead  # noqa: E402
from marks_first import marks_first  # noqa: E402
from overhead import GPT, build, variant  # noqa: E402

import fadiag  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
# fadiag's pieces, timed where they run: (where to find the object, attribute). Not the site
# lookup: a wrapper around it would add a frame to the stack that the lookup walks.
PIECES = (
    ("recorder", "begin"), ("recorder", "end"),
    ("recorder", "_native_backward_seen"), ("recorder", "boundary"), ("devices", "timer"),
    ("resolver", "submit"), ("resolver", "_try_resolve"), ("resolver", "_report"),
)


def phased_step(device: str):
    """overhead.py's launch-bound step (a smaller one on CPU), with host clock reads between phases."""
    torch.manual_seed(0)
    if device == "cuda":
        model, opt, tokens = build("launch_bound")
    else:
        model = GPT(6, 64, 4, vocab=512)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, 512, (1, 32))
    clock = time.perf_counter

    def step(out: list[tuple[float, float, float]]) -> None:
        t0 = clock()
        logits = model(tokens)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), tokens.view(-1))
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((t1 - t0, t2 - t1, clock() - t2))

    return model, step


class Timed:
    """Times calls of obj.name (an instance attribute shadowing the method) into a list."""

    def __init__(self, obj, name: str, into: list[float]):
        self.obj, self.name = obj, name
        inner = getattr(obj, name)
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                into.append(clock() - t0)

        setattr(obj, name, timed)

    def remove(self) -> None:
        delattr(self.obj, self.name)


def outer_sdpa_timer(into: list[float]):
    """Wraps whatever F.scaled_dot_product_attention is now (fadiag's wrapper, the floor's)."""
    inner = F.scaled_dot_product_attention
    clock = time.perf_counter

    def timed(*args, **kwargs):
        t0 = clock()
        out = inner(*args, **kwargs)
        into.append(clock() - t0)
        return out

    F.scaled_dot_product_attention = timed
    return inner


def block(name: str, model, step, steps: int, acc: dict, pieces: bool) -> None:
    """One block of `steps` steps. With `pieces`, fadiag's pieces are timed and nothing else (the
    wrappers that time them cost the step too); without, the phases and the SDPA calls."""
    phases: list[tuple[float, float, float]] = []
    sdpa: list[float] = []
    res = acc.setdefault(name, {})
    with variant(name, model):
        session = fadiag.current_session() if name.startswith("fadiag") else None
        timers = []
        if pieces and session is not None:
            owners = {"recorder": session.recorder, "devices": session.devices,
                      "resolver": session.resolver}
            timers = [Timed(owners[owner], attr, res.setdefault(attr, [])) for owner, attr in PIECES]
        step([])  # untimed: signatures learned on the first measured step
        inner = outer_sdpa_timer(sdpa) if not pieces else None
        try:
            for _ in range(steps):
                step(phases)
            if session is not None:
                session.flush(30)
        finally:
            if inner is not None:
                F.scaled_dot_product_attention = inner
            for t in timers:
                t.remove()
    if not pieces:
        for label, column in zip(PHASES, zip(*phases, strict=True), strict=True):
            res.setdefault(label, []).extend(column)
        res.setdefault("sdpa call", []).extend(sdpa)


def setup_device(device: str) -> None:
    """The benchmark's device set up for fadiag's variants: on CPU one torch thread and native
    CPU marks; on CUDA the native marks built (or loaded) before any variant attaches."""
    if device == "cpu":
        torch.set_num_threads(1)
        overhead.ATTACH_DEFAULTS.update(device="cpu", native="on")
    else:
        marks_first(file=sys.stdout)


def us(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e6:8.2f}" if values else "       -"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--variants", default="plain,floor_native,fadiag_no_fast,fadiag")
    args = p.parse_args()
    setup_device(args.device)
    variants = args.variants.split(",")
    if args.device == "cpu" and "floor_native" in variants:
        variants.remove("floor_native")  # overhead.floor is CUDA events / CUDA native marks
    model, step = phased_step(args.device)
    for _ in range(20):
        step([])
    acc: dict = {}
    for _ in range(args.blocks):
        for v in variants:
            block(v, model, step, args.steps, acc, pieces=False)
            if v.startswith("fadiag"):
                block(v, model, step, args.steps, acc, pieces=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {args.device} ({name}), torch {torch.__version__}; launch-bound GPT step "
          f"({'overhead.py' if args.device == 'cuda' else '6 layers, d=64, T=32, CPU'}), "
          f"{args.blocks} blocks x {args.steps} steps per variant, interleaved; medians in us")
    rows = list(PHASES) + ["sdpa call"]
    print(f"{'':22s}" + "".join(f"{v:>20s}" for v in variants))
    base = acc.get("plain")
    for r in rows:
        cells = []
        for v in variants:
            cell = us(acc[v][r])
            if base is not None and v != "plain":
                delta = (statistics.median(acc[v][r]) - statistics.median(base[r])) * 1e6
                cell += f" ({delta:+7.1f})"
            cells.append(f"{cell:>20s}")
        print(f"{r:22s}" + "".join(cells))
    total = {v: sum(statistics.median(acc[v][r]) for r in PHASES) for v in variants}
    print(f"{'step (sum of phases)':22s}" + "".join(f"{total[v] * 1e6:20.1f}" for v in variants))
    for v in variants:
        if not v.startswith("fadiag"):
            continue
        print(f"pieces of {v}, timed inside the step (median us per call, calls per step)")
        for _, attr in PIECES:
            values = acc[v].get(attr, [])
            if values:
                print(f"  {attr:24s} {us(values)}   x{len(values) / (args.blocks * args.steps):.1f}")
        resolving = acc[v].get("_try_resolve", [])
        print(f"  resolver thread, all _try_resolve per step {sum(resolving) / (args.blocks * args.steps) * 1e6:8.1f}")


if __name__ == "__main__":
    main()
