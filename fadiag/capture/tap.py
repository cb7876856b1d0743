"""The dispatcher tap: fused attention ops measured where torch dispatches them.

Compiled code calls the fused SDPA ops (and flash_attn's) through the dispatcher in both passes,
where no Python wrapper runs. `_native/tap.cpp` registers a kernel for each op at the
BackendSelect key, below autograd and just above every backend, which hands the call on to the
backend's kernel untouched: two marks, a record, no Python per call; aten's ops typed, so the call
is never boxed. At each step boundary the training thread cuts the record log (one
C++ swap); the resolver thread turns the cut into calls like any other.

Eager calls reach the tap through fadiag's Python wrapper, which names their call site. Once a
signature is learned and the tap saw its fused op, its calls are *linked*: the wrapper takes no
marks and gives the call a link number, and the tap times the op's own kernel and its backward
op, below autograd (so neither the wrapper's Python nor autograd's saved-tensor hooks, such as
activation checkpointing's, fall inside the forward window). A signature's first call and calls
no fused op serves (the math path) stay the wrapper's to time; the tap lets them pass.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import torch

from . import order as orders
from . import tap_ops
from .attention_op import AttentionOp, CallInfo
from .calls import Signature
from .device import NativeTimer
from .ops import read_sdpa
from .patcher import Patcher
from .replays import watch_cuda_graphs

log = logging.getLogger("fadiag")

SITE = "compiled"
"""Calls the tap measures have no Python call site: `compiled#n` is the n-th in the pass."""
_LATER_STEPS = 64
"""Resolutions a linked record waits for its call before its marks are given back."""
_MIN_TORCH = (2, 9)
"""The oldest torch the tap was built and tested with (OperatorHandle::getComputedKernelForDispatchKey,
for an op with a kernel of its own at the tap's key, came with 2.9)."""


def supported() -> str | None:
    """Why the tap cannot run with this torch, or None."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version < _MIN_TORCH:
        return f"torch {torch.__version__} < 2.9, the oldest the tap is built and tested with"
    return None


_OP = AttentionOp(name="dispatcher", config_key="sdpa", targets=(), read=read_sdpa)
"""What the recorder's Signature records as the interceptor of a tapped call."""


def signature(impl: str, shape: tuple[int, int, int, int, int], head_dim_v: int, kv_heads: int,
              dtype: torch.dtype, device: str, causal: bool, dropout: float, bshd: bool,
              kept: int | None) -> Signature:
    """The recorder's Signature for a tapped call, figured as for any other call."""
    q = torch.empty(0, dtype=dtype, device="meta")  # what Signature reads of q: dtype and size
    info = CallInfo(q, None, None, shape, head_dim_v, kv_heads, causal, dropout,
                    "BSHD" if bshd else "BHSD")
    sig = Signature(_OP, info, impl, device)
    sig.kept_bytes = kept
    return sig


class Tap:
    """The installed tap of one process: its C++ half, its timers, and what it counts.

    Example::

        tap = Tap(native.load("cpu"), max_records=4096)
        tap.install()
        ...                                    # compiled training
        batch, *_ = tap.cut_step()             # at a step boundary (training thread)
        calls = tap.calls(batch, Call, [])     # the step's calls (resolver thread)
        tap.uninstall()
    """

    def __init__(self, extension: Any, max_records: int, record_no_grad: bool = False,
                 timers: dict[str, NativeTimer] | None = None):
        cuda = bool(getattr(extension, "cuda", False))
        given = timers or {}
        # The recorder's own native timers where it has them: linked calls and the recorder's
        # C++ fast path then share one pool, whose backward count both read.
        self.timers = {"cpu": given.get("cpu") or NativeTimer("cpu", extension)}
        if cuda:
            self.timers["cuda"] = given.get("cuda") or NativeTimer("cuda", extension, torch.cuda)
        self._extension = extension
        self._tap = extension.Tap(self.timers["cpu"].pool(),
                                  self.timers["cuda"].pool() if cuda else None, max_records)
        self.record_no_grad = record_no_grad
        self.enter = extension.Tap.enter
        self.exit = extension.Tap.exit
        self.link: Any = extension.Tap.link
        """Make the wrapper's current call the tap's to time; returns its link number."""
        self.saw: Any = extension.Tap.saw
        """Whether a tapped forward op ran inside the wrapper's current call."""
        self.oldest_open_ns: Any = self._tap.oldest_open_ns
        """Steady-clock ns of the oldest uncut record the device has not passed, or -1."""
        self._signatures: dict[Any, Signature] = {}
        self._patcher = Patcher()
        self.capturing = False
        """A CUDA graph is being captured: the Python wrappers must take no marks."""
        self.cuda_graph_calls = 0
        """Attention calls replayed inside CUDA graphs (captured calls times replays)."""
        self.no_grad = 0
        """Forwards with no backward (evaluation), dropped unless steps.record_no_grad."""
        self._later: dict[int, Any] = {}
        """Linked records whose call is in a step not resolved yet, by link (resolver thread)."""
        self._resolutions = 0
        self._claimed_below = 0
        self.unrecorded = 0
        """Linked calls with no record (the per-step cap, an unreadable argument, an error)."""
        self.order: orders.EagerOrder | None = None
        """The order bypassed eager steps are named by (the resolver's, read at step boundaries)."""
        self.ops: list[str] = []
        self.how: dict[str, str] = {}
        """Per op: "typed" (aten's, unboxed), "boxed", or "wrapped" (its own kernel called)."""

    def install(self) -> None:
        found = tap_ops.specs()
        self.how = dict(zip((s["name"] for s in found), self._tap.install(found), strict=True))
        self.ops = sorted(self.how)
        watch_cuda_graphs(self, self._patcher, self.captured)
        log.info("fadiag: dispatcher tap on %d attention ops (%s)", len(self.ops),
                 ", ".join(f"{op.split('::')[1]} ({self.how[op]})" for op in self.ops))

    def uninstall(self) -> None:
        self._tap.uninstall()
        self._patcher.restore()

    def set_measuring(self, on: bool) -> None:
        self._tap.set_measuring(on)

    def counts(self) -> dict[str, int]:
        """Calls seen and not measured, by reason, since install (cumulative)."""
        c = dict(self._tap.counts())
        del c["captured"]  # counted per replay instead, as cuda_graph
        del c["backwards"]
        c["cuda_graph"] = self.cuda_graph_calls
        c["no_grad"] = self.no_grad
        c["unrecorded"] = self.unrecorded
        return c

    def captured(self) -> int:
        """Calls seen while a CUDA graph captured their stream (cumulative; no marks taken)."""
        return int(self._tap.counts()["captured"])

    def shares(self, timer: Any) -> bool:
        """Whether the tap's marks for `timer`'s device are `timer`'s own (one pool)."""
        return self.timers.get(timer.kind) is timer

    def backward_starts(self) -> int:
        """Backward ops the tap has timed (cumulative): the recorder's sign of a backward."""
        return int(self._tap.counts()["backwards"])

    # ---- records -> calls ----------------------------------------------------------------------

    def cut_step(self) -> tuple[Any, int, bool, int, int]:
        """A step boundary's cut in one C++ call: the batch (None when empty), its records of
        calls not the wrapper's, whether anything in it trained, a number that grows whenever
        a reason `counts()` reads grows, except the resolver's own (no_grad, unrecorded): a
        cheap test, at each step boundary, that nothing moved; and the calls SDPA's eager
        builtins passed to the original while bypassing (cumulative; steps/bypass.py)."""
        batch, unlinked, trained, counted, bypassed = self._tap.cut_step()
        return batch, unlinked, trained, counted + self.cuda_graph_calls, bypassed

    def quiet_steps(self, recorder: Any, fallback: Any) -> Any:
        """The optimizer hook that closes steady bypassed steps in C++ (steps/quiet.py)."""
        return self._tap.quiet_steps(recorder, self, fallback)

    def calls(self, batch: Any, call_class: Any, linked: list[Any],
              by_order: orders.EagerOrder | None = None) -> tuple[list[Any], int, int]:
        """A cut's records as calls, on the resolver thread: (compiled code's calls, forwards
        dropped as evaluation, linked calls left without a record).

        A linked record fills in the marks of its call in `linked` (the wrapper's, with its site);
        one whose call is in a later step is kept for it (steps closed together at one boundary,
        as the micro-batches of a run without optimizer: the first takes the whole cut). A
        linked call with no record is marked aborted and counted. The others become the
        recorder's `Call`s, in forward order, as `_compiled` names them (by `by_order`, the order of
        a bypassed step).
        """
        compiled = []
        later = self._later
        if batch is not None:
            for r in batch.links():  # (link, f0, f1, b0, b1, cuda, graph_backward)
                later[r[0]] = r
            compiled = batch.rows()
        missing = 0
        for call in linked:
            r = later.pop(call.link, None)
            if r is None:
                call.aborted = True
                missing += 1
                continue
            call.timer = self.timers["cuda" if r[5] else "cpu"]
            call.fwd0, call.fwd1, call.bwd0, call.bwd1 = r[1], r[2], r[3], r[4]
            call.graph_backward = r[6]
        self.unrecorded += missing
        self._forget_later()
        before = self.no_grad
        out = self._compiled(compiled, call_class, by_order)
        return out, self.no_grad - before, missing

    def learn_order(self, rows: list[Any], calls: list[Any], step: int) -> None:
        """The order of a step the wrapper measured, learned or verified (capture/order.py)."""
        learned = orders.learn(rows, calls, step, self.order)
        if learned is not None:
            self.order = learned

    def release(self, batch: Any) -> None:
        """Give back every mark of a cut (or of the steps left in a TapRun, steps/quiet.py) that
        will not be resolved (its step dropped)."""
        self._tap.release(batch)

    def tally(self, bounds: list[float], host_share: float) -> Any:
        """A C++ tally of steady steps (fadiag/steps/steady.py) over histogram `bounds`."""
        return self._extension.Tally(bounds, host_share)

    def count(self, batch: Any, tally: Any, keys: list[int], recompute: list[bool],
              give_up: bool) -> int:
        """A steady step's cut counted in C++: 1, 0 (not yet) or -1 (Python's), as Tally.count;
        -1 while linked records of earlier cuts wait for their calls (they are Python's)."""
        return -1 if self._later else int(self._tap.count(batch, tally, keys, recompute, give_up))

    def count_run(self, batches: list[Any], shape: int, tally: Any, keys: list[int],
                  recompute: list[bool], give_up: list[bool]) -> tuple[int, int]:
        """Steady steps' cuts in a row, each shaped `shape` with no linked record, counted in
        one C++ call (Tally.count_run): how many were, and why the next was not (0 not yet, -1
        Python's, 1 none left)."""
        if self._later:
            return 0, -1
        counted, why = self._tap.count_run(batches, shape, tally, keys, recompute, give_up)
        return int(counted), int(why)

    def count_quiet(self, run: Any, n: int, shape: int, tally: Any, keys: list[int],
                    recompute: list[bool], grace_s: float) -> tuple[int, int]:
        """`count_run` for the first `n` steps left in a TapRun (steps closed in C++), which it
        takes off the run."""
        if self._later:
            return 0, -1
        counted, why = self._tap.count_quiet(run, n, shape, tally, keys, recompute, grace_s)
        return int(counted), int(why)

    def discard(self, batch: Any, call_class: Any) -> None:
        """A cut in which nothing trained (evaluation, steps.record_no_grad off), on the training
        thread: its forwards counted as no_grad and their marks given back."""
        self._compiled(batch.rows(), call_class)

    def _forget_later(self) -> None:
        """Linked records no call claimed in _LATER_STEPS resolutions (their call was cut off by
        the step's cap, or raised): marks given back."""
        self._resolutions += 1
        if self._resolutions % _LATER_STEPS:
            return
        stale = [k for k in self._later if k <= self._claimed_below]
        for k in stale:
            r = self._later.pop(k)
            self.timers["cuda" if r[5] else "cpu"].release(r[1], r[2], r[3], r[4])
        self._claimed_below = max(self._later, default=self._claimed_below)

    def _compiled(self, rows: list[Any], call_class: Any,
                  by_order: orders.EagerOrder | None = None) -> list[Any]:
        """Compiled code's records as the recorder's `Call`s, in forward order.

        Sites: `compiled#n`, n counting the forwards of each pass (micro-batch); a recomputation
        (activation checkpointing: a forward run inside the backward pass) takes the site of the
        forward it replays, in reverse order, as the eager path names them. A forward with no
        backward of its own or of its recomputation ran without grad (evaluation): dropped unless
        steps.record_no_grad, and counted. A bypassed eager step's records take the site and
        signature of the call at their place in its order, `by_order` (capture/order.py).
        """
        if not rows:
            return []
        record_no_grad = self.record_no_grad
        forwards = collections.Counter(r[15] for r in rows if not r[14])
        seen: dict[int, int] = collections.Counter()
        replayed: dict[int, int] = collections.Counter()
        named = []
        for r in rows:
            phase, recompute = r[15], r[14]
            if recompute:
                n = max(forwards[phase] - 1 - replayed[phase], 0)
                replayed[phase] += 1
            else:
                n = seen[phase]
                seen[phase] += 1
            named.append((phase, n, r))
        # What a recomputation's backward received is what the op keeps for its backward.
        kept_by_site = {(p, n): r[16] for p, n, r in named if r[14] and r[16] is not None}
        backward_by_site = {(p, n) for p, n, r in named if r[3] is not None or r[19]}
        calls = []
        for phase, n, r in named:
            (op_i, f0, f1, b0, b1, shape, dv, kvh, dtype, device, _index, causal, dropout,
             _scale, recompute, _, kept, cuda, _link, graph_backward) = r
            timer = self.timers["cuda" if cuda else "cpu"]
            if not recompute and (phase, n) not in backward_by_site and not record_no_grad:
                self.no_grad += 1
                timer.release(f0, f1, b0, b1)
                continue
            here = orders.key(r)  # (op_i, shape, dv, kvh, dtype, device, causal, dropout)
            site, sig = f"{SITE}#{n}", None
            if by_order is not None:
                site, sig = orders.name(by_order, n, here)
            if kept is None:
                kept = kept_by_site.get((phase, n))
            key = (*here, kept, b0 is None)
            if sig is None:
                sig = self._signatures.get(key)
            if sig is None:
                op = tap_ops.TAP_OPS[op_i]
                sig = self._signatures[key] = signature(
                    op.impl, tuple(shape), dv, kvh, dtype, "cuda" if cuda else "cpu", causal,
                    dropout, op.bshd, kept)
                sig.forward_only = b0 is None and not recompute
            call = call_class(site, timer, recompute, None, None, None)
            call.sig = sig
            call.fwd0, call.fwd1, call.bwd0, call.bwd1 = f0, f1, b0, b1
            call.graph_backward = graph_backward
            calls.append(call)
        return calls
