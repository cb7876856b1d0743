"""The training-thread side: measures each intercepted attention call and cuts steps.

Per call it takes two device marks around the op and hooks the op's backward nodes for two more;
what only needs learning once per call signature (impl, kept bytes, peak) is learned on the first
call and cached. Where a step ends is boundary.py's; closed steps go to the resolver thread, and
nothing here waits for the device.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

from ..capture import backends
from ..capture.attention_op import AttentionOp, CallInfo
from ..capture.calls import Call, Signature, learn
from ..capture.device import Devices
from ..capture.eager import never_compiled
from ..capture.graph import (
    SavedBytes,
    compiled_autograd_active,
    compiled_autograd_configured,
    hook_backward,
    in_reentrant_checkpoint,
)
from ..capture.ops import mask_key, quick_sdpa
from .boundary import StepBoundaries
from .bypass import Bypass
from .quiet import Handed, QuietSteps

_CONFIG_EVERY_S = 1.0
"""How often, at most, a step boundary reads dynamo's compiled_autograd config flag: the read
costs ~18 us inside a training step, and the flag is set before training in practice."""
_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]
_KEY_GRAD = 6  # where a call's signature key holds whether grad was enabled


def _is_compiling() -> bool:
    return False


class _NotCompiling:
    _is_compiling_flag = False


_compiler: Any = _NotCompiling
if hasattr(torch, "compiler") and hasattr(torch.compiler, "is_compiling"):
    _is_compiling = torch.compiler.is_compiling  # noqa: F811
if (hasattr(torch, "compiler") and hasattr(torch.compiler, "is_dynamo_compiling")
        and hasattr(torch.compiler, "_is_compiling_flag")):
    # The wrapper's first test, `_is_compiling() or _compiler._is_compiling_flag`: dynamo folds
    # is_dynamo_compiling() to True while it traces (and never reads the flag after it), and
    # torch.export sets the flag. In eager that is one Python frame where is_compiling() is two
    # (it asks torch.jit.is_scripting() first): inside a model's step every frame of the
    # wrapper's is several times its cost in a tight loop (BENCHMARKS.md, runs 97-99).
    _is_compiling = torch.compiler.is_dynamo_compiling  # noqa: F811
    _compiler = torch.compiler


def _never_compiled(wrapper: CodeType) -> None:
    """The wrapper's frame is never compiled on its own, nor the bookkeeping it calls (eager.py,
    never_compiled): a call left to run eagerly by a graph break is measured like any eager one."""
    never_compiled(wrapper, callees=False)
    for method in (Recorder.begin, Recorder.probe_forward, Recorder.end, Recorder.open_phase):
        never_compiled(method.__code__, callees=True)


class Recorder(StepBoundaries):
    """Decides per call whether to measure, measures, and cuts steps."""

    def __init__(self, devices: Devices, *, every_n_steps: int = 1, record_no_grad: bool = False,
                 max_calls_per_step: int = 4096, fallback_after: int = 32, verify_every: int = 0,
                 on_error: Callable[[str, BaseException], None],
                 on_step: Callable[[Handed], None]):
        super().__init__(devices, every_n_steps=every_n_steps, record_no_grad=record_no_grad,
                         fallback_after=fallback_after, on_error=on_error, on_step=on_step)
        self.max_calls = max_calls_per_step
        self.depth = 0
        self.signatures: dict[Any, Signature] = {}
        self.compiled_autograd_configured = False
        """dynamo's compiled_autograd config flag: a slow read, so read at start and then at a step
        boundary at most every _CONFIG_EVERY_S, never per call (and on the training thread:
        dynamo's config is per thread)."""
        self._config_read_at = 0.0
        self._fast: Any = None
        """C++ start of steady-state SDPA calls on the one native timer (NativeTimer.fast_begin)."""
        self._fast_call: Any = None
        """Its whole call (`FastBegin.call`) where the tap shares that timer: set once a linked
        signature is learned, None otherwise."""
        self._fast_timer: Any = None
        self._fast_op: AttentionOp | None = None
        self._lock = threading.Lock()
        self.bypass = Bypass(verify_every, on_error)
        """Steps whose SDPA calls run no fadiag Python, named by a learned order."""

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.enabled = True
        self.measuring = self._sampled(self.step_index)
        if self.tap is not None:
            self.tap.set_measuring(self.measuring)
        self._read_config()

    def stop(self) -> None:
        self.enabled = False
        self.measuring = False
        if self.quiet is not None:
            self.quiet.disarm()
        self.bypass.set(None)
        if self.tap is not None:  # a forked child keeps the registrations: they pass through
            self.tap.set_measuring(False)

    def _read_config(self) -> None:
        self.compiled_autograd_configured = compiled_autograd_configured()
        self._config_read_at = time.monotonic()

    def _next_step(self) -> None:
        if (self._fast is not None and len(self.devices.native_timers) > 1
                and not self._sole_native(self._fast_timer)):
            self._fast = self._fast_timer = self._fast_call = None  # it watches one timer's counter
        if time.monotonic() - self._config_read_at >= _CONFIG_EVERY_S:
            self._read_config()
        self.bypass.set(self.bypass.next_order(self))
        if self.quiet is not None:
            self.quiet.arm(self)

    # ---- bypassed steps (steps/bypass.py) -------------------------------------------------

    def use_builtins(self, ext: Any, builtins: list[Any]) -> None:
        """SDPA's eager builtins, which bypassed steps run through (Bypass.use)."""
        self.bypass.use(ext, builtins)

    def _closing(self, batch: Any, unlinked: int, bypassed: int) -> tuple[Any, bool, bool]:
        if self.bypass.order is None:
            return None, *self.bypass.learns(self)
        return self.bypass.closing(self, batch, unlinked, bypassed), False, False

    # ---- the wrapper -----------------------------------------------------------------------

    def wrap(self, original: Callable[..., Any], op: AttentionOp) -> Callable[..., Any]:
        """The function that replaces `original`; it never changes what `original` returns."""
        rec = self

        @functools.wraps(original)
        def fadiag_attention(*args: Any, **kwargs: Any) -> Any:
            # First, and touching no state: dynamo traces this function, and whatever it reads
            # here it guards on (a counter read would recompile the graph at every call).
            if _is_compiling() or _compiler._is_compiling_flag:
                return original(*args, **kwargs)
            if rec.depth or not rec.enabled:
                return original(*args, **kwargs)
            tap = rec.tap
            if tap is not None:
                if tap.capturing:  # a CUDA graph capture: no marks; the tap counts its replays
                    return original(*args, **kwargs)
                whole = rec._fast_call
                if whole is not None and op is rec._fast_op and rec.measuring:
                    # The steady state of a call the tap times: one C++ call does it all.
                    out = whole(original, args, kwargs, rec)
                    if out is not NotImplemented:
                        return out
                tap.enter()  # this call is Python's to measure: the fused op passes the tap
            try:
                rec.calls_since_boundary += 1
                if not rec.measuring:
                    rec.sampled_out += 1
                    return original(*args, **kwargs)
                call = rec.begin(op, args, kwargs)
                if call is None:
                    return original(*args, **kwargs)
                rec.depth += 1
                try:
                    if call.probe:
                        out = rec.probe_forward(call, original, args, kwargs)
                    else:
                        out = original(*args, **kwargs)
                except BaseException:
                    call.aborted = True
                    call.info = call.qkv = None
                    raise
                finally:
                    rec.depth -= 1
                if not call.link:  # a linked call's marks are the tap's
                    rec.end(call, op, out)
                return out
            finally:
                if tap is not None:
                    tap.exit()

        fadiag_attention.__wrapped_by_fadiag__ = True  # type: ignore[attr-defined]
        _never_compiled(fadiag_attention.__code__)  # type: ignore[attr-defined]
        return fadiag_attention

    # ---- per call --------------------------------------------------------------------------

    def begin(self, op: AttentionOp, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call | None:
        try:
            fast = self._fast
            if fast is not None and op is self._fast_op:
                call = fast.begin(args, kwargs, self.calls, self.backward_seen)
                if call is not None:
                    return call
            grad = _grad_enabled()
            if not grad and not self.record_no_grad and not in_reentrant_checkpoint():
                return None
            if len(self.calls) >= self.max_calls:
                self.over_cap += 1
                return None
            recompute = grad and _graph_task_id() != -1
            if recompute and (self.in_backward > 0 or self._native_in_backward()):
                return None  # inside a measured op's own backward: already timed there
            if not recompute:
                self.open_phase()
            info: CallInfo | None = None
            if op.quick is not None:
                q, k, v, extra = op.quick(args, kwargs)
            else:
                info = op.read(args, kwargs)
                q, k, v = info.q, info.k, info.v
                extra = (info.causal, info.dropout > 0.0, mask_key(info.mask))
            dev = q.device
            timer = self.devices.timer(dev.type)
            if dev.index is not None and timer.kind == dev.type and dev.index != self._current(timer):
                self.other_device += 1
                return None
            key = (op.name, q.shape, k.shape, v.shape, q.dtype, dev, grad, q.requires_grad,
                   k.requires_grad, v.requires_grad,
                   backends.backend_flags() if op.sdpa_like else None, extra)
            sig = self.signatures.get(key)
            if sig is None and info is None:
                info = op.read(args, kwargs)
            elif sig is not None and op.quick is quick_sdpa and grad and not recompute:
                self._remember(op, args, kwargs, sig, timer)
            call = Call(self._site(recompute), timer, recompute, key, info, (q, k, v))
            call.sig = sig
            if sig is not None and sig.tapped and self._linkable(timer):
                call.qkv = call.info = None
                self.calls.append(call)
                call.link = self.tap.link()  # the tap times it: no marks here
                return call
            if timer.kind != "cpu" and timer.capturing():
                # A CUDA (NPU) graph captures this stream: a mark would invalidate the capture. The
                # tap, where it times the call, counts its replays; here the capture is counted.
                self.unmeasured["graph_capture"] = self.unmeasured.get("graph_capture", 0) + 1
                return None
            call.probe = sig is None and grad and _hooks_enabled()
            if op.per_call is not None:
                call.extra = op.per_call(args, kwargs)
            self.calls.append(call)
            call.fwd0 = call.timer.mark()
            return call
        except Exception as e:
            self._on_error("recorder.begin", e)
            calls = self.calls
            if calls and calls[-1].fwd0 is None:  # appended, and its start mark failed
                calls.pop()
            return None

    def open_phase(self) -> None:
        """A forward after a backward opens its micro-batch: called by `begin` for a call that is
        not a recomputation, and by the C++ fast path (FastBegin.call, capture/_native/marks.cpp),
        which then makes the call itself."""
        native = self._native_backward_seen()  # always read: it keeps count
        if self.backward_seen or native:
            self._new_phase()

    def _linkable(self, timer: Any) -> bool:
        """Whether the tap can time a call measured on `timer`: it has `timer`'s pool, or
        `timer` is Python's (the call then takes the tap's timer; nothing else shares its marks)."""
        tap = self.tap
        return tap is not None and (tap.shares(timer) or not getattr(timer, "native", False))

    def set_tap(self, tap: Any) -> None:
        """The tap installed (or None: removed). Each signature is learned again, so that the tap
        times what it can, and a backward op it times on a timer of its own counts as a
        backward seen."""
        if self.quiet is not None:  # steps closed on the old tap, handed over while it is the tap
            self.quiet.take(self)
            self.quiet = None
        self.tap = tap
        self._unmeasured_moved = -1  # the next boundary reads the totals whole
        self._tap_timers = [] if tap is None else [
            t for t in tap.timers.values() if t not in self.devices.native_timers]
        self.signatures.clear()
        self._fast = self._fast_timer = self._fast_op = self._fast_call = None
        self.bypass.set(None)
        self.quiet = None if tap is None else QuietSteps(tap, self, self.optimizer_step)
        self.step_hook = self.optimizer_step if self.quiet is None else self.quiet.native.step

    def _remember(self, op: AttentionOp, args: tuple[Any, ...], kwargs: dict[str, Any],
                  sig: Signature, timer: Any) -> None:
        """Let the C++ fast path start calls like this one (a signature Python has learned).

        It reads SDPA's arguments as `quick_sdpa` does, for the one op that taught it first."""
        if not getattr(timer, "native", False):
            return  # Python's marks: its own path
        if not self._sole_native(timer):
            self._fast = self._fast_timer = self._fast_call = None
            return
        if self._fast_op is None:
            self._fast_op = op
        if op is not self._fast_op:
            return
        if self._fast_timer is not timer:
            self._fast_timer, self._fast_call = timer, None
            # skip=2: from begin's frame past the wrapper's to its caller's, as _site does.
            sites = self.sites
            self._fast = timer.fast_begin(
                sites.internal, sites.locations, sites.counts, Call, 2, self.max_calls)
        if self._fast is not None:
            tap = self.tap
            linked = bool(sig.tapped and tap is not None and tap.shares(timer))
            self._fast.remember(args, kwargs, sig, linked)
            if linked:
                self._fast_call = self._fast.call

    def _sole_native(self, timer: Any) -> bool:
        """Whether native `timer` is the only native timer that marks anything: the fast path
        reads one timer's backward counter to see a new micro-batch. A native timer that never
        took a mark counted no backward (the CPU one that `native: on` adopts beside CUDA's)."""
        return all(t is timer or t.pool_size() == 0 for t in self.devices.native_timers)

    def probe_forward(self, call: Call, original: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        """First call of a signature: also count saved bytes and the allocator window."""
        info = call.info
        assert info is not None
        try:
            saved = SavedBytes((info.q, info.k, info.v, *info.others))
            call.mem0 = call.timer.memory_stats()
        except Exception as e:
            self._on_error("recorder.probe", e)
            return original(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = original(*args, **kwargs)
        call.saved = saved
        return out

    def end(self, call: Call, op: AttentionOp, out: Any) -> None:
        try:
            timer, sig = call.timer, call.sig
            info, qkv = call.info, call.qkv
            call.info = call.qkv = None  # a pending call must not keep the inputs alive
            if (sig is not None and qkv is not None and timer.native and sig.fused_path is not None
                    and not self.compiled_autograd_configured and not self.python_hooks
                    and not compiled_autograd_active()):
                # The steady state with native marks: one C++ call takes the end mark and hooks
                # the backward.
                call.fwd1, call.bwd0, call.bwd1 = timer.finish(op.output(out), sig.fused_path,
                                                               call.fwd0)
                if call.bwd0 is not None:
                    if not self._native_hooked:
                        self._native_starts = self.native_backward_starts()
                    self._native_hooked += 1
                    return
            else:
                call.fwd1 = timer.mark(call.fwd0)
            t = op.output(out)
            node = getattr(t, "grad_fn", None)
            if sig is None:
                assert info is not None
                sig = self._learn(call, op, info, node)
                tap = self.tap
                sig.tapped = bool(tap is not None and op.tap_times and call.key[_KEY_GRAD]
                                  and tap.saw())
            call.sig = sig
            if node is not None and qkv is not None:
                self._hook_backward(call, sig, node, qkv)
        except Exception as e:
            call.aborted = True
            self._on_error("recorder.end", e)

    def _learn(self, call: Call, op: AttentionOp, info: CallInfo, node: Any) -> Signature:
        sig = learn(call, op, info, node)
        # Only a fully measured signature is cached, so an unmeasurable first call is retried; a
        # call without grad (a reentrant checkpoint's forward) keeps nothing to measure.
        if sig.kept_bytes is not None or not _hooks_enabled() or not call.key[_KEY_GRAD]:
            self.signatures[call.key] = sig
        return sig

    def _hook_backward(self, call: Call, sig: Signature, node: Any,
                       qkv: tuple[Any, Any, Any]) -> None:
        hook_backward(call, sig, node, qkv, self, self._on_error)

    def _site(self, recompute: bool) -> str:
        """``file:line#n`` of the wrapper's caller (see capture/sites.py)."""
        return self.sites.name(recompute, 3)  # past begin's frame and the wrapper's
