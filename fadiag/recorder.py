"""The training-thread side: measures each intercepted attention call and cuts steps.

Per call it takes two device marks around the op and hooks the op's backward nodes for two more;
what only needs learning once per call signature (impl, kept bytes, peak) is learned on the first
call and cached. Closed steps go to the resolver thread; nothing here waits for the device.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from . import backends
from .device import Devices, window_peak
from .graph import (
    SavedBytes,
    compiled_autograd_active,
    compiled_autograd_configured,
    find_fused,
    follow,
    in_reentrant_checkpoint,
)
from .memory import standard_bytes
from .ops import AttentionOp, CallInfo, mask_key, quick_sdpa
from .records import Shape

_INTERNAL_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
_USER_FILES = (os.path.join("fadiag", "commands", "demo", "training.py"),)
"""fadiag's own files that are user code (the demo's model), so their call sites are named."""
_CONFIG_EVERY_S = 1.0
"""How often, at most, a step boundary reads dynamo's compiled_autograd config flag: the read
costs ~18 us inside a training step, and the flag is set before training in practice."""
_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled
_get_edge = torch.autograd.graph.get_gradient_edge
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_KEY_GRAD = 6  # where a call's signature key holds whether grad was enabled
_UNREAD = object()
_UNSEEN_STEPS = 3  # optimizer steps without a C++ backward hook firing before Python's take over
log = logging.getLogger("fadiag")


def _is_compiling() -> bool:
    return False


if hasattr(torch, "compiler") and hasattr(torch.compiler, "is_compiling"):
    _is_compiling = torch.compiler.is_compiling  # noqa: F811


class Signature:
    """What is the same for every call with the same arguments' shapes, dtypes and backend flags."""

    __slots__ = ("op", "impl", "shape", "dtype", "causal", "dropout", "kv_heads", "layout",
                 "device", "standard_bytes", "kept_bytes", "peak_bytes", "fused_path",
                 "fallback_reason", "interceptor", "forward_only")

    def __init__(self, op: AttentionOp, info: CallInfo, impl: str, device: str):
        q = info.q
        self.op = op
        self.impl = impl
        b, h, sq, sk, d = (int(x) for x in info.shape)
        self.shape: Shape = (b, h, sq, sk, d)
        self.dtype = str(q.dtype).replace("torch.", "")
        self.causal = info.causal
        self.dropout = info.dropout
        self.kv_heads = int(info.kv_heads)
        self.layout = info.layout
        self.device = device
        self.standard_bytes = standard_bytes(b, h, sq, sk, d, q.element_size(), info.dropout,
                                             int(info.head_dim_v))
        self.kept_bytes: int | None = None
        self.peak_bytes: int | None = None
        self.fused_path: tuple[int, ...] | None = None
        self.fallback_reason: str | None = None
        self.interceptor = op.name
        self.forward_only = False


class Call:
    """One measured call; its marks are filled in by the training and autograd threads."""

    __slots__ = ("sig", "site", "timer", "fwd0", "fwd1", "bwd0", "bwd1", "remaining", "host_ns",
                 "recompute", "aborted", "mem0", "probe", "saved", "key", "info", "qkv", "extra")

    def __init__(self, site: str, timer: Any, recompute: bool, key: Any, info: CallInfo | None,
                 qkv: tuple[Any, Any, Any]):
        self.sig: Signature | None = None
        self.site = site
        self.timer = timer
        self.fwd0: Any = None
        self.fwd1: Any = None
        self.bwd0: Any = None
        self.bwd1: Any = None
        self.remaining = 0
        self.host_ns = time.monotonic_ns()
        self.recompute = recompute
        self.aborted = False
        self.mem0: dict[str, int] | None = None
        self.probe = False
        self.saved: SavedBytes | None = None
        self.key = key
        self.info = info
        self.qkv: tuple[Any, Any, Any] | None = qkv
        self.extra: Any = None  # AttentionOp.per_call's figures


class ClosedStep:
    """A step's calls, handed to the resolver."""

    __slots__ = ("index", "calls", "wall_time", "closed", "device", "unmeasured", "cpu_wait")

    def __init__(self, index: int, calls: list[Call], device: int | None,
                 unmeasured: dict[str, int] | None = None):
        self.index = index
        self.calls = calls
        self.unmeasured = unmeasured or {}
        """Attention calls of the step seen and not measured, by reason."""
        self.wall_time = time.time()
        self.closed = time.monotonic()
        self.device = device
        """The training thread's current device, for the step's allocator figures: the resolver
        thread's own current device is device 0 (CUDA's current device is per thread)."""
        self.cpu_wait: float | None = None
        """Host-clock steps: the process's share of runnable time spent waiting for a CPU."""


class Recorder:
    """Decides per call whether to measure, measures, and cuts steps."""

    def __init__(self, devices: Devices, *, every_n_steps: int = 1, record_no_grad: bool = False,
                 max_calls_per_step: int = 4096, fallback_after: int = 32,
                 on_error: Callable[[str, BaseException], None],
                 on_step: Callable[[ClosedStep], None]):
        self.devices = devices
        self.every_n_steps = every_n_steps
        self.record_no_grad = record_no_grad
        self.max_calls = max_calls_per_step
        self.fallback_after = fallback_after
        self._on_error = on_error
        self._on_step = on_step
        self.enabled = False
        self.measuring = False
        self.depth = 0
        self.step_index = 1
        self.calls: list[Call] = []
        self.calls_since_boundary = 0
        self.sampled_out = 0
        """Calls on steps that sampling skips (cumulative)."""
        self.over_cap = 0
        """Calls past steps.max_calls_per_step (cumulative)."""
        self.other_device = 0
        """Calls on an accelerator that is not the thread's current device (several devices in
        one process): marks go on the current device's stream, so these are not measured."""
        self.unmeasured: dict[str, int] = {}
        """Calls not measured, by reason, counted by an op's own code (flex: ``compiling``)."""
        self._current_devices: dict[str, Any] = {}  # device kind -> current index, this step
        self.signatures: dict[Any, Signature] = {}
        self.backward_seen = False
        self.in_backward = 0
        self.compiled_autograd_configured = False
        """dynamo's compiled_autograd config flag: a slow read, so read at start and then at a step
        boundary at most every _CONFIG_EVERY_S, never per call (and on the training thread:
        dynamo's config is per thread)."""
        self._config_read_at = 0.0
        self.python_hooks = False
        """Set once the C++ backward hooks were seen not to fire (see boundary): Python's from then on."""
        self._native_hooked = 0  # calls of the open step whose backward the C++ hooks time
        self._native_starts = 0  # the native timers' backward starts when the step opened
        self._unseen_steps = 0
        self.optimizer_seen = False
        self.fallback_mode = False
        self._phases: list[list[Call]] = []
        self._site_counts: dict[str, int] = {}
        self._recompute_counts: dict[str, int] = {}
        self._internal: dict[Any, bool] = {}
        self._locations: dict[tuple[Any, int], str] = {}
        self._fast: Any = None
        """C++ start of steady-state SDPA calls on the one native timer (NativeTimer.fast_begin)."""
        self._fast_timer: Any = None
        self._fast_op: AttentionOp | None = None
        self.tap: Any = None
        """The dispatcher tap (fadiag/tap.py) once installed: its calls join each step's."""
        self.pending: Callable[[], None] | None = None
        """Work for the training thread at the next boundary (installing the tap: registering
        kernels while another thread dispatches ops is not safe)."""
        self._unmeasured_seen: dict[str, int] = {}
        self._lock = threading.Lock()

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
        if self.tap is not None:  # a forked child keeps the registrations: they pass through
            self.tap.set_measuring(False)

    def _read_config(self) -> None:
        self.compiled_autograd_configured = compiled_autograd_configured()
        self._config_read_at = time.monotonic()

    def _sampled(self, index: int) -> bool:
        return self.every_n_steps <= 1 or index % self.every_n_steps == 0

    # ---- the wrapper -----------------------------------------------------------------------

    def wrap(self, original: Callable[..., Any], op: AttentionOp) -> Callable[..., Any]:
        """The function that replaces `original`; it never changes what `original` returns."""
        rec = self

        @functools.wraps(original)
        def fadiag_attention(*args: Any, **kwargs: Any) -> Any:
            # First, and touching no state: dynamo traces this function, and whatever it reads
            # here it guards on (a counter read would recompile the graph at every call).
            if _is_compiling():
                return original(*args, **kwargs)
            if rec.depth or not rec.enabled:
                return original(*args, **kwargs)
            tap = rec.tap
            if tap is not None:
                if tap.capturing:  # a CUDA graph capture: no marks; the tap counts its replays
                    return original(*args, **kwargs)
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
                rec.end(call, op, out)
                return out
            finally:
                if tap is not None:
                    tap.exit()

        fadiag_attention.__wrapped_by_fadiag__ = True  # type: ignore[attr-defined]
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
            if not recompute and (self.backward_seen or self._native_backward_seen()):
                self._new_phase()
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
                self._remember(op, args, kwargs, sig)
            call = Call(self._site(recompute), timer, recompute, key, info, (q, k, v))
            call.sig = sig
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

    def _current(self, timer: Any) -> int | None:
        """The thread's current device for `timer`'s kind, read once a step (a Python call)."""
        current = self._current_devices.get(timer.kind, _UNREAD)
        if current is _UNREAD:
            current = self._current_devices[timer.kind] = timer.current_device()
        return current  # type: ignore[no-any-return]

    def _step_device(self) -> int | None:
        """The current device of the step's accelerator, as this step's calls saw it."""
        timer = next((c.timer for c in self.calls if c.timer.kind != "cpu"), None)
        try:
            return None if timer is None else self._current(timer)
        except Exception:  # the resolver then reads the current device's, as it would anyway
            return None

    def _remember(self, op: AttentionOp, args: tuple[Any, ...], kwargs: dict[str, Any],
                  sig: Signature) -> None:
        """Let the C++ fast path start calls like this one (a signature Python has learned).

        It reads SDPA's arguments as `quick_sdpa` does, for the one op that taught it first."""
        timers = self.devices.native_timers
        if len(timers) != 1:  # it watches one native timer's backward counter
            self._fast = self._fast_timer = None
            return
        if self._fast_op is None:
            self._fast_op = op
        if op is not self._fast_op:
            return
        if self._fast_timer is not timers[0]:
            self._fast_timer = timers[0]
            # skip=2: from begin's frame past the wrapper's to its caller's, as _site does.
            self._fast = timers[0].fast_begin(
                self._internal, self._locations, self._site_counts, Call, 2, self.max_calls,
                _graph_task_id)
        if self._fast is not None:
            self._fast.remember(args, kwargs, sig)

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
                call.fwd1, call.bwd0, call.bwd1 = timer.finish(op.output(out), sig.fused_path)
                if call.bwd0 is not None:
                    self._native_hooked += 1
                    return
            else:
                call.fwd1 = timer.mark()
            t = op.output(out)
            node = getattr(t, "grad_fn", None)
            if sig is None:
                assert info is not None
                sig = self._learn(call, op, info, node)
            call.sig = sig
            if node is not None and qkv is not None:
                self._hook_backward(call, sig, node, qkv)
        except Exception as e:
            call.aborted = True
            self._on_error("recorder.end", e)

    def _learn(self, call: Call, op: AttentionOp, info: CallInfo, node: Any) -> Signature:
        impl = op.impl
        fused_path = None
        if impl is None:
            found = find_fused(node) if node is not None else None
            if found is not None:
                impl, fused_path = found
            elif node is not None:
                impl = "math"
            else:
                impl = backends.sdpa_choice(info.q, info.k, info.v, info.mask, info.dropout,
                                            info.causal, info.kv_heads != info.shape[1]) or "unknown"
        elif node is not None:
            found = find_fused(node)
            fused_path = found[1] if found is not None else None
        sig = Signature(op, info, impl, call.timer.kind)
        sig.fused_path = fused_path
        sig.forward_only = node is None
        if op.sdpa_like and impl == "math":
            sig.fallback_reason = backends.fallback_reason(
                info.q, info.k, info.v, info.mask, info.dropout, info.causal,
                info.kv_heads != info.shape[1])
        saved = call.saved
        if saved is not None:
            sig.kept_bytes = saved.total()
            if call.mem0 is not None:
                sig.peak_bytes = window_peak(call.mem0, call.timer.memory_stats())
        # Only a fully measured signature is cached, so an unmeasurable first call is retried; a
        # call without grad (a reentrant checkpoint's forward) keeps nothing to measure.
        if sig.kept_bytes is not None or not _hooks_enabled() or not call.key[_KEY_GRAD]:
            self.signatures[call.key] = sig
        return sig

    def _hook_backward(self, call: Call, sig: Signature, node: Any,
                       qkv: tuple[Any, Any, Any]) -> None:
        timer = call.timer
        rec = self
        probe = call.saved is not None and call.mem0 is not None

        # Run by the autograd engine inside the user's backward(): nothing may escape them.
        def on_backward_start(grad_outputs: Any) -> None:
            try:
                if call.bwd0 is None and call.remaining > 0:  # 0: done, or closed at a pass end
                    rec.backward_seen = True
                    rec.in_backward += 1
                    if probe:
                        call.mem0 = timer.memory_stats()
                    call.bwd0 = timer.mark()
                    if call.remaining > 1:
                        _queue_callback(close_pass)
            except Exception as e:
                rec._on_error("recorder.backward", e)

        def close_pass() -> None:
            # The end of the backward pass: a partial one (`autograd.grad(out, q)`) ran only
            # some of the ends. The call's backward is then not timed, and nothing stays open.
            try:
                if call.remaining > 0:
                    call.remaining = 0
                    rec.in_backward = max(0, rec.in_backward - 1)
                    if call.bwd0 is not None and call.bwd1 is None:
                        timer.release(call.bwd0)
                        call.bwd0 = None
            except Exception as e:
                rec._on_error("recorder.backward", e)

        def on_backward_end(*_: Any) -> None:
            try:
                if call.remaining <= 0:
                    return
                call.remaining -= 1
                if call.remaining == 0:
                    rec.in_backward = max(0, rec.in_backward - 1)
                    call.bwd1 = timer.mark()
                    if probe and call.mem0 is not None and sig.peak_bytes is not None:
                        bwd_peak = window_peak(call.mem0, timer.memory_stats())
                        sig.peak_bytes = max(sig.peak_bytes, bwd_peak)
            except Exception as e:
                rec._on_error("recorder.backward", e)

        node.register_prehook(on_backward_start)
        fused = follow(node, sig.fused_path) if sig.fused_path is not None else None
        if fused is not None:
            call.remaining = 1
            fused.register_hook(on_backward_end)
            return
        ends: list[Any] = []
        for t in qkv:
            if t.requires_grad:
                n = _get_edge(t).node
                if all(n is not e for e in ends):
                    ends.append(n)
        nexts = [n for n, _ in node.next_functions]
        if not ends or all(any(e is n for n in nexts) for e in ends):
            # One node computes every input's gradient (a compiled function's backward): its end
            # is the call's. The ends' pre-hooks fire one after another as the engine runs them,
            # so the last of them would also time what the others ran (the gradient
            # accumulation into leaf q and k: 2 of 3 adds, +10 % of flex's backward at S=2048).
            call.remaining = 1
            node.register_hook(on_backward_end)
            return
        call.remaining = len(ends)
        for n in ends:
            n.register_prehook(on_backward_end)

    # ---- sites -----------------------------------------------------------------------------

    def _site(self, recompute: bool) -> str:
        """``file:line#n``: the first frame outside torch and fadiag, and its n-th call this pass."""
        frame = sys._getframe(3)
        internal = self._internal
        while frame.f_back is not None:
            code = frame.f_code
            flag = internal.get(code)
            if flag is None:
                flag = internal[code] = (code.co_filename.startswith(_INTERNAL_DIRS)
                                         and not code.co_filename.endswith(_USER_FILES))
            if not flag:
                break
            frame = frame.f_back
        # Keyed by the bytecode offset: f_lineno decodes the line table on every read.
        lk = (frame.f_code, frame.f_lasti)
        loc = self._locations.get(lk)
        if loc is None:
            parts = frame.f_code.co_filename.replace(os.sep, "/").rsplit("/", 2)
            loc = self._locations[lk] = f"{'/'.join(parts[-2:])}:{frame.f_lineno}"
        if recompute:
            # Recomputation (checkpointing) replays a pass in reverse order of its forward.
            r = self._recompute_counts.get(loc, 0)
            self._recompute_counts[loc] = r + 1
            n = self._site_counts.get(loc, 0) - 1 - r
            return f"{loc}#{max(n, 0)}"
        n = self._site_counts.get(loc, 0)
        self._site_counts[loc] = n + 1
        return f"{loc}#{n}"

    def _native_backward_seen(self) -> bool:
        """Whether a native backward hook fired since the last look (they cannot set flags)."""
        seen = False
        for t in self.devices.native_timers:
            n = t.backward_starts()
            if n != t.backward_starts_seen:
                t.backward_starts_seen = n
                seen = True
        return seen

    def _native_in_backward(self) -> bool:
        return any(t.in_backward() > 0 for t in self.devices.native_timers)

    def _new_phase(self) -> None:
        """A forward after a backward: a new micro-batch (or, without optimizer, a new step)."""
        self.backward_seen = False
        self._site_counts.clear()  # in place: the C++ fast path holds this dict
        self._recompute_counts = {}
        if self.optimizer_seen or not self.calls:
            return
        if self.fallback_mode:
            self.boundary("fallback")
            return
        self._phases.append(self.calls)
        self.calls = []
        if len(self._phases) >= self.fallback_after:
            # No optimizer step in all this time: every forward-after-backward is a step.
            self.fallback_mode = True
            phases, self._phases = self._phases, []
            for calls in phases:
                self.calls = calls
                self.boundary("fallback")

    # ---- steps -----------------------------------------------------------------------------

    def boundary(self, source: str) -> None:
        """End the current step. One with no attention is reported only at an optimizer step
        (it still counts as a step); other boundaries without attention are ignored."""
        try:
            if source in ("optimizer", "manual") and not self.optimizer_seen:
                self.optimizer_seen = True
                self.fallback_mode = False
            if self._phases:
                merged = [c for phase in self._phases for c in phase]
                self.calls = merged + self.calls
                self._phases = []
            tap = self.tap
            if tap is not None:
                self.calls.extend(tap.drain(Call, self.record_no_grad))
            # An optimizer step is a step (fadiag_steps_total) even with no attention measured;
            # so is a manual one whose attention all ran unmeasured (flex in a compiled graph).
            empty_step = self.measuring and (
                source == "optimizer" or (source == "manual" and self._op_counted_since()))
            if not self.calls_since_boundary and not self.calls and not empty_step:
                self._run_pending()
                return
            closed = None
            if self.calls or empty_step:
                closed = ClosedStep(self.step_index, self.calls, self._step_device(),
                                    self._unmeasured_since())
            self.calls = []
            self.calls_since_boundary = 0
            self._site_counts.clear()
            self._recompute_counts = {}
            self._current_devices.clear()
            self.backward_seen = False
            self._check_native_hooks(source)
            self._native_backward_seen()
            if self._fast is not None and len(self.devices.native_timers) != 1:
                self._fast = self._fast_timer = None  # it watches a single timer's counter
            self.in_backward = 0
            for t in self.devices.native_timers:
                t.reset_in_backward()
            self.step_index += 1
            self.measuring = self.enabled and self._sampled(self.step_index)
            if tap is not None:
                tap.set_measuring(self.measuring)
            self._run_pending()
            if time.monotonic() - self._config_read_at >= _CONFIG_EVERY_S:
                self._read_config()
            if closed is not None:  # an unsampled step has nothing to resolve
                self._on_step(closed)
        except Exception as e:
            self._on_error("recorder.boundary", e)

    def unmeasured_totals(self) -> dict[str, int]:
        """Attention calls seen and not measured since start, by reason (cumulative)."""
        totals = {"sampling": self.sampled_out, "per_step_cap": self.over_cap,
                  "other_device": self.other_device, **self.unmeasured}
        if self.tap is not None:
            for reason, n in self.tap.counts().items():
                if reason != "errors":
                    totals[reason] = totals.get(reason, 0) + n
        return totals

    def _unmeasured_since(self) -> dict[str, int]:
        """What unmeasured_totals() gained since the last boundary (reasons that moved)."""
        totals = self.unmeasured_totals()
        before, self._unmeasured_seen = self._unmeasured_seen, totals
        return {k: v - before.get(k, 0) for k, v in totals.items() if v != before.get(k, 0)}

    def _op_counted_since(self) -> bool:
        """Whether an op's own code counted calls not measured since the last closed step."""
        seen = self._unmeasured_seen
        return any(v != seen.get(k, 0) for k, v in self.unmeasured.items())

    def _run_pending(self) -> None:
        work, self.pending = self.pending, None
        if work is not None:
            work()

    def _check_native_hooks(self, source: str) -> None:
        """Steps that end at an optimizer step after C++-hooked calls whose hooks never fired:
        the backward ran where C++ hooks are not called (compiled autograd switched on around
        `backward()` alone, which the forward cannot see), or it never reached attention. After
        a few such steps in a row, later calls get Python hooks, which compiled autograd runs."""
        timers = self.devices.native_timers
        starts = sum(t.backward_starts() for t in timers)
        if source == "optimizer" and self._native_hooked:
            self._unseen_steps = self._unseen_steps + 1 if starts == self._native_starts else 0
            if self._unseen_steps == _UNSEEN_STEPS and not self.python_hooks:
                self.python_hooks = True
                log.warning("fadiag: the C++ backward hooks did not fire in %d optimizer steps "
                            "(compiled autograd around backward(), or attention outputs unused "
                            "by the loss); attention backward is timed with Python hooks from now "
                            "on", _UNSEEN_STEPS)
        self._native_starts = starts
        self._native_hooked = 0

    def open_calls(self) -> list[Call]:
        """The current step's calls so far (a copy; for the hang check)."""
        return list(self.calls) + [c for phase in list(self._phases) for c in phase]
