"""What fadiag costs a training step on the GPU, against plain runs, torch.profiler and sync timers.

Interleaves blocks of steps (plain, variant, plain, variant, …) in one process and reports the
median of per-pair ratios, with plain-vs-plain as the noise reference. Usage:

    python benchmarks/overhead.py --out benchmarks/results/overhead.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from marks_first import marks_first  # noqa: E402

import fadiag  # noqa: E402
from fadiag.capture import eager as eager_module  # noqa: E402
from fadiag.steps import quiet as quiet_module  # noqa: E402
from fadiag.steps import resolver as resolver_module  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.sync_timer = False
        self.timings: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        if self.sync_timer:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.sync_timer:
            torch.cuda.synchronize()
            self.timings.append(time.perf_counter() - t0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, h: int, vocab: int = 32000):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


MODELS = {
    "gpu_bound": dict(layers=12, d=1024, h=16, T=2048, B=8),
    "launch_bound": dict(layers=6, d=256, h=4, T=256, B=4),
    # The GPU-bound model under torch.compile: its attention is measured by the dispatcher tap.
    "compiled_gpu_bound": dict(layers=12, d=1024, h=16, T=2048, B=8, compile=True),
    # The launch-bound model compiled: no Python per op left in the step but dynamo's guards, so
    # what fadiag costs is the tap's C++ per op, the step boundary and the resolver.
    "compiled_launch_bound": dict(layers=6, d=256, h=4, T=256, B=4, compile=True),
}


def build(name: str):
    """The model of `name` on the GPU in bf16, its fused AdamW and a batch of tokens."""
    m = MODELS[name]
    model = GPT(m["layers"], m["d"], m["h"]).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 32000, (m["B"], m["T"]), device="cuda")
    return model, opt, tokens


def make(name: str):
    model, opt, tokens = build(name)
    run = torch.compile(model) if MODELS[name].get("compile") else model

    def step():
        logits = run(tokens)
        F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), tokens.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


batch_s = resolver_module._BATCH_S
eager_unavailable = eager_module.unavailable
quiet_arm = quiet_module.QuietSteps.arm
ATTACH_DEFAULTS: dict = {}
"""Configuration every fadiag variant attaches with (other scripts set e.g. a CPU device)."""


def _nothing() -> None:
    pass


def _yielding(inner):
    def piece(*args, **kwargs):
        time.sleep(0)
        return inner(*args, **kwargs)

    return piece


@contextlib.contextmanager
def variant(name: str, model: nn.Module):
    """Runs `name` around the block; yields what a timed block calls after its closing
    synchronise: fadiag's flush, so the resolver's work for the block's steps is inside the block's
    time, not left to the untimed detach (a 30-step block is ~0.25 s, and the resolver looks every
    0.1 s and may defer a step 0.5 s for a backward window)."""
    if name == "plain":
        yield _nothing
    elif name.startswith("fadiag"):
        overrides: dict = {"port": 0, **ATTACH_DEFAULTS}
        if name == "fadiag_per_site":
            overrides["per_site"] = True
        if name.startswith("fadiag_sampled"):
            overrides["every_n_steps"] = sampled_every(name)
        reports = re.search(r"_reports_(\d+)$", name)
        if reports:
            # Every call timed and counted; a step report (rules, log, JSONL) for N steps a
            # second of training (sampling.reports_per_second). A suffix of any variant.
            overrides["sampling.reports_per_second"] = float(reports.group(1))
        if name == "fadiag_python":
            overrides["native"] = "off"
        if name.startswith("fadiag_no_bypass"):
            # Every eager call through SDPA's wrapper (steps.verify_every 0): no step bypassed
            # (steps/bypass.py), as before bypassed steps.
            overrides["steps.verify_every"] = 0
        if name == "fadiag_wrapper_marks":
            # No dispatcher tap: every eager call timed by the wrapper's own marks and backward
            # hooks (what eager calls ran before the tap timed them; compiled ones go unmeasured).
            overrides["tap"] = "off"
        if name == "fadiag_burst":
            resolver_module._BATCH_S = 1.0
        if name.startswith("fadiag_wake_"):
            # The resolver wakes every N s, not every _BATCH_S (0.5 s): fewer or more steps
            # resolved a wake, back to back in its backward windows.
            resolver_module._BATCH_S = float(name.rpartition("_")[2])
        if name.startswith("fadiag_no_quiet"):
            # Every step closed by the Python boundary: the hook that closes steady bypassed steps
            # in C++ (steps/quiet.py) never armed, as before it.
            quiet_module.QuietSteps.arm = lambda self, rec: None
        if name == "fadiag_python_wrapper":
            # SDPA's Python wrapper kept (not the builtin, capture/eager.py): every steady eager
            # call in two Python frames, as before the builtin.
            eager_module.unavailable = lambda ext: "off for this variant"
        try:
            session = fadiag.attach(**overrides)
        finally:
            eager_module.unavailable = eager_unavailable
        if name == "fadiag_no_report":
            # The resolver waits for the marks and gives them back, and builds no report (no
            # rules, no sinks): what is left is the training thread's own cost and the marks'.
            session.resolver._report = lambda step, timed: None
        if name == "fadiag_no_fast":
            # Every call started by Recorder.begin in Python: the C++ fast path never learns a
            # signature (what ran before design change 10).
            session.recorder._remember = lambda *learned: None
        if name.startswith("fadiag_split_runs"):
            # Steps closed in C++ handed over one ClosedStep each, on the training thread, as
            # before they went to the resolver as one run (steps/quiet.py's QuietRun).
            on_step = session.recorder._on_step

            def split_runs(step) -> None:
                if isinstance(step, quiet_module.QuietRun):
                    for _ in range(len(step)):
                        on_step(step.split())
                else:
                    on_step(step)

            session.recorder._on_step = split_runs
        tap_only = name.startswith("fadiag_tap_only")
        if tap_only:
            # The Python wrapper taken off SDPA: eager calls reach the dispatcher tap as compiled
            # code's do (sites `compiled#n`), so what is left is the tap's C++, the step boundary
            # and the resolver: the wrapper's own share is fadiag minus this.
            wrapped = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention
        if name == "fadiag_no_window":
            # The resolver does not wait for a backward window: it resolves what is pending
            # whenever it wakes (every 0.1 s), in one burst.
            session.resolver._await_window = lambda: None
        if name == "fadiag_yielding":
            # The resolver lets go of the GIL (time.sleep(0)) before each piece of a step's
            # resolution, so a thread that wants it back (the autograd engine's, freeing tensors
            # in backward) waits for one piece, not the whole step (BENCHMARKS.md, runs 72-76).
            for owner, attr in ((session.resolver, "_report"), (session.rules, "evaluate"),
                                (session.sinks, "emit"), (session.resolver, "_step_peak")):
                setattr(owner, attr, _yielding(getattr(owner, attr)))
        settle = lambda: session.flush(60)  # noqa: E731
        if name == "fadiag_inline":
            # Each closed step resolved on the training thread, at a later boundary once the
            # device has passed its marks: the resolver's Python at its own cost, with no GIL
            # handed between threads (against fadiag: what the hand-overs cost).
            settle = inline_resolution(session)
        if name == "fadiag_held":
            # As fadiag_no_resolver, but each closed step's marks and tap records are given back
            # HELD_STEPS steps later (about when the resolver, waking every _BATCH_S, reaches
            # them; a run of steps closed in C++ counts as its steps): what holding them costs,
            # apart from resolving them.
            held: collections.deque = collections.deque()
            steps_held = 0

            def hold(step) -> None:
                nonlocal steps_held
                held.append(step)
                steps_held += steps_in(step)
                while steps_held - steps_in(held[0]) >= HELD_STEPS:  # the newest always held
                    steps_held -= steps_in(held[0])
                    release_marks(held.popleft())

            def settle() -> None:
                nonlocal steps_held
                while held:
                    release_marks(held.popleft())
                steps_held = 0

            session.resolver.submit = hold
        if name == "fadiag_burst":
            # The resolver wakes every second and resolves all that is pending at once, with no
            # backward window: a 30-step block's steps are resolved in its settle, back to back.
            session.resolver._await_window = lambda: None
        if name == "fadiag_no_resolver":
            # Closed steps give their marks back at once, on the training thread, and the
            # resolver thread never runs: the training thread's own cost alone.
            session.resolver.submit = release_marks
        try:
            yield settle
        finally:
            resolver_module._BATCH_S = batch_s
            quiet_module.QuietSteps.arm = quiet_arm
            MARKS_SEEN.setdefault(name, set()).update(session.devices.marks().values())
            tap = session.recorder.tap
            if tap is not None and tap.backward_starts():
                MARKS_SEEN[name].add("tap")  # the tap timed calls of this block
            if session.recorder.bypass.steps:
                MARKS_SEEN[name].add("bypassed")  # steps of this block ran bypassed
            if session.recorder.quiet is not None and session.recorder.quiet.closed:
                MARKS_SEEN[name].add("quiet")  # steps of this block closed in C++
            if tap_only:
                F.scaled_dot_product_attention = wrapped
            fadiag.detach()
    elif name in ("floor_python", "floor_native", "floor_query"):
        with floor(name):
            yield _nothing
    elif name == "profiler":
        from torch.profiler import ProfilerActivity, profile

        # Its trace is processed at the profile's exit, after the block's time.
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            yield _nothing
    elif name == "sync_timers":
        for b in model.blocks:
            b.sync_timer = True
        try:
            yield _nothing
        finally:
            for b in model.blocks:
                b.sync_timer = False
                b.timings.clear()
    else:
        raise ValueError(name)


HELD_STEPS = 60
"""fadiag_held: how many steps' marks are held before they are given back (a launch-bound step is
6-10 ms, and the resolver wakes every 0.5 s)."""

# Which marks each fadiag variant really ran with, across all its blocks: recorded with its figure,
# so a variant that silently fell back to Python marks shows in the result.
MARKS_SEEN: dict[str, set[str]] = {}


def inline_resolution(session):
    """Redirects `session`'s closed steps to the training thread (see the fadiag_inline variant);
    returns the block's settle: what is still pending resolved once the device is done."""
    resolver = session.resolver
    pending: collections.deque = collections.deque()

    def resolve(give_up: bool) -> None:
        while pending and resolver._try_resolve(pending[0]):
            pending.popleft()
        if give_up and pending:
            raise RuntimeError(f"{len(pending)} closed steps not resolved after a synchronise")

    def submit(step) -> None:
        if isinstance(step, quiet_module.QuietRun):  # steps closed in C++: one at a time
            pending.extend(step.split() for _ in range(len(step)))
        else:
            pending.append(step)
        resolve(False)

    def settle() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        resolve(True)
        session.flush(60)

    resolver.submit = submit
    return settle


def steps_in(handed) -> int:
    """The steps a closed step or a run of steps closed in C++ (steps/quiet.py) holds."""
    return len(handed) if isinstance(handed, quiet_module.QuietRun) else 1


def release_marks(step) -> None:
    step.drop_tap()  # the tap's records: their marks back, no calls made (the resolver's work)
    for c in step.calls:
        c.timer.release(c.fwd0, c.fwd1, c.bwd0, c.bwd1)


@contextlib.contextmanager
def floor(name: str):
    """The measurement alone: four marks per SDPA call (two around it, two on its backward node)
    and nothing else — no bookkeeping, no resolution. What any design with these marks costs."""
    original = F.scaled_dot_product_attention
    if name == "floor_python":
        pool: list = []

        def mark():
            ev = pool.pop() if pool else torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def wrapped(*args, **kwargs):
            a = mark()
            out = original(*args, **kwargs)
            b = mark()
            node = out.grad_fn
            if node is not None:
                node.register_prehook(lambda g: pool.append(mark()))
                node.register_hook(lambda gi, go: pool.append(mark()))
            pool.extend((a, b))
            return out
    else:
        from fadiag.capture import native

        marks = native.load("cuda").Marks(True)
        marks.ensure(4)

        def wrapped(*args, **kwargs):
            marks.mark(0)
            out = original(*args, **kwargs)
            marks.mark(1)
            marks.hook(out, 2, 3, [])
            return out

        if name == "floor_query":
            # The floor plus one event query a call: the start mark's, asked before the end mark
            # is taken, as fadiag's end marks ask it (whether the window may hold host time).
            def wrapped(*args, **kwargs):  # noqa: F811
                marks.mark(0)
                out = original(*args, **kwargs)
                marks.done(0)
                marks.mark(1)
                marks.hook(out, 2, 3, [])
                return out

    F.scaled_dot_product_attention = wrapped
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def sampled_every(name: str) -> int:
    if not name.startswith("fadiag_sampled"):
        return 1
    return 10 if name == "fadiag_sampled" else int(name.rpartition("_")[2])


def _steal_s() -> float:
    """Seconds the hypervisor ran something else while this machine's CPUs wanted to run (all
    CPUs, from /proc/stat; 10 ms ticks), or NaN where the kernel does not say."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class FullCollections:
    """Python's collections of the oldest generation (a full heap walk, tens of ms with torch's
    heap), and their seconds, since `start()`: a stall on the host that a GPU-bound block feels
    only where it drains the device's queue, so a block that holds one reads slow."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0 = 0, 0.0, 0.0
        gc.callbacks.append(self)

    def start(self) -> None:
        self.count, self.seconds = 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t0


FULL = FullCollections()


def block_time(step, n: int, warm: int = 1, settle=_nothing,
               extra: dict[str, list[float]] | None = None) -> float:
    """Wall seconds a step over `n` steps; `extra` gathers the block's process CPU seconds a step
    ("cpu"), the training thread's own ("thread_cpu": this thread's CPU, no other thread's and no
    wait in it), the machine's stolen seconds a wall second ("steal") and Python's full
    collections inside the block ("full_gc", their seconds "full_gc_s")."""
    # Untimed: what a variant does once per attach (server start, learning each call signature on
    # the first measured step) stays out; a production session attaches once. Each warm step is
    # settled: what the resolver learns of a step (an order, a steady shape) serves from the
    # boundary after it is learned, as it does a few steps in when attached once.
    for _ in range(warm):
        step()
        settle()
    # A full collection now, untimed, in every block alike: the one that a variant's attach, made
    # for each of its blocks, brings on sooner would otherwise fall inside the block. Those the
    # steps bring on stay inside it, counted (FULL).
    gc.collect()
    torch.cuda.synchronize()
    c0, s0, t0_cpu = time.process_time(), _steal_s(), time.thread_time()
    FULL.start()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    # The resolver's work on steps it has not reached yet, after the device is done with them
    # (a flush before the synchronise waits for the device in 20 ms polls).
    torch.cuda.synchronize()
    settle()
    wall = time.perf_counter() - t0
    if extra is not None:
        extra.setdefault("cpu", []).append((time.process_time() - c0) / n)
        extra.setdefault("thread_cpu", []).append((time.thread_time() - t0_cpu) / n)
        extra.setdefault("steal", []).append((_steal_s() - s0) / wall)
        extra.setdefault("full_gc", []).append(FULL.count)
        extra.setdefault("full_gc_s", []).append(FULL.seconds)
    return wall / n


def measure(model_name: str, variants: list[str], pairs: int, steps: int,
            seconds: float | None = None, out: dict | None = None,
            save: Callable[[], None] = lambda: None) -> dict:
    """Each variant against plain over `pairs` pairs of `steps`-step blocks; with `seconds`, a
    variant takes fewer pairs (5 at least) once its share of that time is spent, so a run that
    has to end by a limit measures every variant instead of losing the last ones.

    Rows go into `out` as each variant ends, and `save` is called after each, so a run cut off
    by a time limit keeps what it measured."""
    MARKS_SEEN.clear()  # the host-cost microbenchmark above used the same variants
    model, step = make(model_name)
    for _ in range(10):
        step()
    out = {} if out is None else out
    runs = [v for v in ["plain"] + variants
            # floor and sync timers patch the model's Python code, which compiled code does not run
            if not (MODELS[model_name].get("compile") and v.startswith(("floor", "sync")))]
    share = None if seconds is None else seconds / len(runs)
    for v in runs:
        began = time.monotonic()
        ratios, plain_t, var_t = [], [], []
        # The same pairs read as process CPU time (every thread's; GIL waits are not in it) and
        # the time the hypervisor stole from the machine during each block.
        plain_x: dict[str, list[float]] = {}
        var_x: dict[str, list[float]] = {}
        with variant(v, model):  # warm the variant (signatures learned, profiler started)
            block_time(step, 3)
        # A sampled variant's blocks span whole sampling periods: its first measured step (which
        # learns the signatures) falls in the untimed warm-up, and each timed block holds exactly
        # steps/N measured steps.
        warm = sampled_every(v)
        n = -(-steps // warm) * warm
        # A launch-bound step is the host's time, so the resolver's work on a block's steps is
        # part of it: settled inside the block. A GPU-bound step hides that work behind the
        # device's (the resolver runs while the host waits), and a flush would add it in series.
        host_bound = not model_name.endswith("gpu_bound")
        for i in range(pairs):
            if share is not None and i >= 5 and time.monotonic() - began > share:
                break
            # Every other pair runs the variant first: a drift of the host or the card over a
            # pair (its clocks as it warms) then reads as much for the variant as against it.
            if i % 2:
                with variant(v, model) as settle:
                    b = block_time(step, n, warm, settle if host_bound else _nothing, var_x)
                a = block_time(step, n, warm, extra=plain_x)
            else:
                a = block_time(step, n, warm, extra=plain_x)
                with variant(v, model) as settle:
                    b = block_time(step, n, warm, settle if host_bound else _nothing, var_x)
            plain_t.append(a)
            var_t.append(b)
            ratios.append(b / a - 1.0)
        q = statistics.quantiles(ratios, n=4)
        cpu = [b / a - 1.0 for a, b in zip(plain_x["cpu"], var_x["cpu"], strict=True)]
        steal = plain_x["steal"] + var_x["steal"]
        row = out[v if v != "plain" else "plain_vs_plain"] = {
            "overhead_median": statistics.median(ratios), "overhead_q1": q[0], "overhead_q3": q[2],
            "median_ci95": list(median_ci95(ratios)), "pairs": len(ratios),
            "plain_ms": statistics.median(plain_t) * 1e3, "variant_ms": statistics.median(var_t) * 1e3,
            "cpu_overhead_median": statistics.median(cpu), "cpu_median_ci95": list(median_ci95(cpu)),
            "plain_cpu_ms": statistics.median(plain_x["cpu"]) * 1e3,
            "steal_share_median": statistics.median(steal), "steal_share_max": max(steal),
            # Blocks that held a full collection of Python's heap, and its seconds in all.
            "full_gc_blocks": [sum(1 for c in x["full_gc"] if c) for x in (plain_x, var_x)],
            "full_gc_seconds": [sum(x["full_gc_s"]) for x in (plain_x, var_x)],
        }
        if v in MARKS_SEEN:
            row["marks"] = sorted(MARKS_SEEN.pop(v))
        (lo, hi), (cpu_lo, cpu_hi) = row["median_ci95"], row["cpu_median_ci95"]
        print(f"{model_name:13s} {v:16s} {row['overhead_median'] * 100:+7.2f} % "
              f"({row['pairs']} pairs; 95 % CI {lo * 100:+.2f} .. {hi * 100:+.2f}; "
              f"IQR {q[0] * 100:+.2f} .. {q[2] * 100:+.2f}); plain {row['plain_ms']:.2f} ms; "
              f"process CPU {row['cpu_overhead_median'] * 100:+.2f} % ({cpu_lo * 100:+.2f} .. "
              f"{cpu_hi * 100:+.2f}); steal {row['steal_share_median']:.1%} "
              f"(max {row['steal_share_max']:.1%}); blocks with a full collection: plain "
              f"{row['full_gc_blocks'][0]}, variant {row['full_gc_blocks'][1]} "
              f"({row['full_gc_seconds'][1] * 1e3:.0f} ms)"
              + (f"; marks {','.join(row['marks'])}" if "marks" in row else ""), flush=True)
        save()
    return out


def measure_rotated(model_name: str, variants: list[str], rounds: int, steps: int,
                    seconds: float | None = None,
                    pairs: list[tuple[str, str]] | tuple = ()) -> dict:
    """Every variant and plain once a round, in an order that turns each round, so that each
    variant is compared with blocks run seconds apart, not minutes.

    The launch-bound step is the host's, and its speed drifts from block to block (runs 92-96:
    a plain block's wall from 7.9 to 13.0 ms a step, neighbours correlated). Measured one variant
    after another, fadiag and the floor are minutes apart and their difference carries that
    drift; here both are read against the same round's plain block, and their gap is read
    directly, round by round: `gap_to_floor`, (variant - floor) / plain, in points of the plain
    step, with the distribution-free 95 % interval of its median. A second plain block a round
    is the noise reference (plain vs plain). Each block's wall is kept (`blocks`), so runs can be
    pooled, and its CPU, the process's and the training thread's; `pairs` (A, B) are also read
    against each other, round by round (`paired`)."""
    MARKS_SEEN.clear()
    model, step = make(model_name)
    for _ in range(10):
        step()
    runs = ["plain", "plain_again"] + [
        v for v in variants
        if not (MODELS[model_name].get("compile") and v.startswith(("floor", "sync")))]
    host_bound = not model_name.endswith("gpu_bound")
    for v in runs[1:]:  # warm each variant once (signatures learned, the tap built)
        with variant(v if v != "plain_again" else "plain", model):
            block_time(step, 3)
    n = steps
    walls: dict[str, list[float]] = {v: [] for v in runs}
    extras: dict[str, dict[str, list[float]]] = {v: {} for v in runs}
    began = time.monotonic()
    for i in range(rounds):
        if seconds is not None and i >= 5 and time.monotonic() - began > seconds:
            break
        k = i % len(runs)
        order = runs[k:] + runs[:k]
        if (i // len(runs)) % 2:
            order.reverse()
        for v in order:
            # Four untimed steps, each settled: the first learns each signature, the second the
            # order of a step whose calls the tap timed, the third is the wrapper's still (the
            # boundary that opened it came before the order was learned), the fourth is bypassed
            # and its shape learned for counting in C++: every timed step is bypassed
            # (steps/bypass.py) and counted as in a session attached once.
            with variant(v if v != "plain_again" else "plain", model) as settle:
                walls[v].append(block_time(step, n, 4, settle if host_bound else _nothing,
                                           extras[v]))
    plain = walls["plain"]
    out: dict = {"design": "rotated", "rounds": len(plain), "steps_per_block": n,
                 "blocks_ms": {v: [w * 1e3 for w in ws] for v, ws in walls.items()},
                 # CPU a step of each block: the process's (every thread's) and the training
                 # thread's own, which no wait is in (µs).
                 "blocks_cpu_us": {v: [c * 1e6 for c in x["cpu"]] for v, x in extras.items()},
                 "blocks_thread_cpu_us": {v: [c * 1e6 for c in x["thread_cpu"]]
                                          for v, x in extras.items()}}
    floor_name = next((v for v in runs if v.startswith("floor")), None)
    for v in runs[1:]:
        ratios = [b / a - 1.0 for a, b in zip(plain, walls[v], strict=True)]
        q = statistics.quantiles(ratios, n=4)
        row = out[v if v != "plain_again" else "plain_vs_plain"] = {
            "overhead_median": statistics.median(ratios), "overhead_q1": q[0], "overhead_q3": q[2],
            "median_ci95": list(median_ci95(ratios)), "pairs": len(ratios),
            "plain_ms": statistics.median(plain) * 1e3,
            "variant_ms": statistics.median(walls[v]) * 1e3}
        line = (f"{model_name:13s} {v:20s} {row['overhead_median'] * 100:+7.2f} % "
                f"(95 % CI {row['median_ci95'][0] * 100:+.2f} .. {row['median_ci95'][1] * 100:+.2f};"
                f" IQR {q[0] * 100:+.2f} .. {q[2] * 100:+.2f})")
        if floor_name is not None and v not in (floor_name, "plain_again"):
            gaps = [(b - f) / a for a, b, f in zip(plain, walls[v], walls[floor_name], strict=True)]
            mid, (lo, hi) = statistics.median(gaps), median_ci95(gaps)
            # The same gap in µs a step: a fixed host cost reads as more points on a faster host.
            gaps_us = [(b - f) * 1e6 for b, f in zip(walls[v], walls[floor_name], strict=True)]
            mid_us, (lo_us, hi_us) = statistics.median(gaps_us), median_ci95(gaps_us)
            row["gap_to_floor"] = {"median": mid, "median_ci95": [lo, hi],
                                   "median_us": mid_us, "median_us_ci95": [lo_us, hi_us]}
            line += (f"; over the floor {mid * 100:+.2f} points ({lo * 100:+.2f} .. {hi * 100:+.2f}), "
                     f"{mid_us:+.0f} µs a step ({lo_us:+.0f} .. {hi_us:+.0f})")
        if v in MARKS_SEEN:
            row["marks"] = sorted(MARKS_SEEN.pop(v))
            line += f"; marks {','.join(row['marks'])}"
        print(line, flush=True)
    print(f"{model_name:13s} {len(plain)} rounds of {len(runs)} blocks of {n} steps; plain "
          f"{statistics.median(plain) * 1e3:.2f} ms a step", flush=True)
    for a, b in pairs:
        out[f"{b}-{a}"] = paired(out, a, b, model_name)
    return out


def paired(out: dict, a: str, b: str, model_name: str = "") -> dict:
    """Variant `b` against `a` in the same rounds of a rotated run: the median of b - a, round by
    round, in wall, process CPU and training-thread CPU µs a step, with the 95 % interval of
    each median (what an A/B of one change reads, each row in the blocks of its own round)."""
    row = {}
    parts = []
    for name, key, scale in (("wall", "blocks_ms", 1e3), ("process CPU", "blocks_cpu_us", 1.0),
                             ("training thread CPU", "blocks_thread_cpu_us", 1.0)):
        d = [(y - x) * scale for x, y in zip(out[key][a], out[key][b], strict=True)]
        mid, (lo, hi) = statistics.median(d), median_ci95(d)
        row[key] = {"median_us": mid, "median_us_ci95": [lo, hi]}
        parts.append(f"{name} {mid:+.0f} µs a step ({lo:+.0f} .. {hi:+.0f})")
    print(f"{model_name:13s} {b} against {a}, round by round: " + "; ".join(parts), flush=True)
    return row


def median_ci95(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95 % confidence interval of the median (order statistics): two
    variants whose intervals overlap are not told apart by this run."""
    xs = sorted(values)
    n = len(xs)
    k = max(0, int((n - 1.96 * n ** 0.5) / 2))
    return xs[k], xs[n - 1 - k]


def memory_over_steps(steps: int) -> dict:
    """fadiag's host (RSS) and device memory over `steps` launch-bound steps, every call timed."""
    import psutil

    model, step = make("launch_bound")
    session = fadiag.attach(port=0)
    try:
        for _ in range(200):  # warm-up: signatures learned, pools filled
            step()
        assert session.flush(30)
        proc = psutil.Process()
        rss0, dev0 = proc.memory_info().rss, torch.cuda.memory_allocated()
        marks0 = session.devices.timer("cuda").pool_size()
        for _ in range(steps):
            step()
        assert session.flush(60)
        rss1, dev1 = proc.memory_info().rss, torch.cuda.memory_allocated()
        marks1 = session.devices.timer("cuda").pool_size()
    finally:
        fadiag.detach()
    out = {"steps": steps, "rss_before": rss0, "rss_after": rss1, "device_before": dev0,
           "device_after": dev1, "marks_before": marks0, "marks_after": marks1}
    print(f"over {steps} steps: RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, device "
          f"{dev0} -> {dev1} bytes, marks {marks0} -> {marks1}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="overhead.json")
    p.add_argument("--variants", default="fadiag,fadiag_per_site,fadiag_sampled,profiler,sync_timers")
    p.add_argument("--models", default="gpu_bound,launch_bound")
    p.add_argument("--pairs", type=int, default=None,
                   help="pairs of blocks per variant (default: 20 GPU-bound, 30 launch-bound)")
    p.add_argument("--seconds", type=float, default=None,
                   help="time for each model's variants, shared equally: a variant stops taking "
                        "pairs (5 at least) once its share is spent")
    p.add_argument("--launch-steps", type=int, default=30, help="steps per launch-bound block")
    # The noise of the GPU-bound ratio is mostly per block, not per step (each block starts with
    # the device idle and ends in a synchronise): plain vs plain had an IQR of 1.3 points with
    # 5-step blocks and 0.3 with 20-step blocks on the H200 (BENCHMARKS.md, runs 14 and 16).
    p.add_argument("--gpu-steps", type=int, default=20,
                   help="steps per GPU-bound block (each block ends in a device synchronise)")
    p.add_argument("--rotate", action="store_true",
                   help="every variant and plain once a round, the order turning each round "
                        "(measure_rotated); --pairs is then the most rounds")
    p.add_argument("--ab", default="",
                   help="with --rotate: A,B[;C,D...] variants read against each other round by "
                        "round (wall, process CPU and training-thread CPU a step)")
    p.add_argument("--memory-steps", type=int, default=0,
                   help="also measure host RSS and device memory over this many steps (e.g. 10000)")
    args = p.parse_args()
    variants = args.variants.split(",")
    # Build (or load) the native marks up front, so "fadiag" uses them from its first step.
    marks_first(file=sys.stdout)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=1))

    # Per-call host costs, interleaved and repeated, are tap_cost.py's and hot_path.py's.
    for m in filter(None, args.models.split(",")):  # --models "" measures memory only
        gpu_bound = m.endswith("gpu_bound")
        steps = args.gpu_steps if gpu_bound else args.launch_steps
        pairs = args.pairs or (20 if gpu_bound else 30)
        if args.rotate:
            ab = [tuple(x.split(",")) for x in filter(None, args.ab.split(";"))]
            result[m] = measure_rotated(m, variants, args.pairs or 1000, steps, args.seconds, ab)
        else:
            measure(m, variants, pairs, steps, args.seconds, out=result.setdefault(m, {}), save=save)
        save()
    if args.memory_steps:
        result["memory"] = memory_over_steps(args.memory_steps)
    save()


if __name__ == "__main__":
    main()
