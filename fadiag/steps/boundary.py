"""Where one training step ends and the next begins, on the training thread.

An optimizer step (or `fadiag.step()`) ends a step; with no optimizer seen, each forward after a
backward starts a micro-batch, and after `steps.fallback_after` of them each is a step of its own.
A closed step goes to the resolver with what it saw and could not measure. The Recorder
(recorder.py) measures the calls that fill the open step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..capture.calls import Call
from ..capture.device import Devices
from ..capture.sites import Sites

if TYPE_CHECKING:
    from .quiet import Handed

_UNREAD = object()
_RESOLVER_COUNTS = ("no_grad", "unrecorded", "graph_capture_backward")
_UNSEEN_STEPS = 3  # optimizer steps without a C++ backward hook firing before Python's take over
log = logging.getLogger("fadiag")


class ClosedStep:
    """A step's calls, handed to the resolver."""

    __slots__ = ("index", "calls", "wall_time", "closed", "device", "unmeasured", "cpu_wait",
                 "tap", "tap_batch", "order", "learn_order", "verifies")

    def __init__(self, index: int, calls: list[Call], device: int | None,
                 unmeasured: dict[str, int] | None = None, tap: Any = None, tap_batch: Any = None):
        self.index = index
        self.calls = calls
        self.tap = tap
        self.tap_batch = tap_batch
        """The dispatcher tap's records cut at this boundary: the resolver makes them calls
        (`take_tap`), joining linked ones to their calls here."""
        self.unmeasured = unmeasured or {}
        """Attention calls of the step seen and not measured, by reason."""
        self.wall_time = time.time()
        self.closed = time.monotonic()
        self.device = device
        """The training thread's current device, for the step's allocator figures: the resolver
        thread's own current device is device 0 (CUDA's current device is per thread)."""
        self.cpu_wait: float | None = None
        """Host-clock steps: the process's share of runnable time spent waiting for a CPU."""
        self.order: Any = None
        """A bypassed step's: the EagerOrder (capture/order.py) its tapped calls are named by."""
        self.learn_order = False
        """A step the eager wrapper measured whose order the resolver learns (Tap.learn_order)."""
        self.verifies = False
        """A step the wrapper measured, every steps.verify_every-th, to check the order bypassed
        steps follow: resolved in Python, where its order is learned (never counted in C++)."""

    def drop_tap(self) -> None:
        """The step will not be resolved: the marks of its cut of the tap's records given back."""
        tap, batch, self.tap, self.tap_batch = self.tap, self.tap_batch, None, None
        if tap is not None and batch is not None:
            tap.release(batch)

    @property
    def host_clock(self) -> bool:
        """Whether its timings are the host clock's: CPU calls, or only the tap's records on a
        machine whose tap times no CUDA device."""
        if self.calls:
            return bool(self.calls[0].timer.kind == "cpu")
        return self.tap_batch is not None and "cuda" not in self.tap.timers

    def take_tap(self) -> None:
        """On the resolver thread: the tap's records into this step's calls (once)."""
        tap, batch, self.tap, self.tap_batch = self.tap, self.tap_batch, None, None
        if tap is None:
            return
        linked = [c for c in self.calls if c.link]
        if batch is None and not linked:
            return
        # Every call linked and every record a linked one: the step's order can be learned.
        rows = (batch.rows(linked=True) if self.learn_order and batch is not None and linked
                and len(linked) == len(self.calls) and not batch.unlinked() else None)
        compiled, no_grad, unrecorded = tap.calls(batch, Call, linked, self.order)
        if rows is not None and not unrecorded:
            tap.learn_order(rows, self.calls, self.index)
        self.calls.extend(compiled)
        self.count("no_grad", no_grad)
        self.count("unrecorded", unrecorded)

    def lose_linked(self, tap: Any) -> None:
        """`take_tap` failed: the linked calls it did not mark are not timed, and counted as
        unrecorded (in the step and the tap's totals)."""
        lost = [c for c in self.calls if c.link and c.fwd0 is None]
        for c in lost:
            c.aborted = True
        self.count("unrecorded", len(lost))
        tap.unrecorded += len(lost)

    def count(self, reason: str, n: int) -> None:
        """`n` of the step's calls not measured, for `reason` (the resolver's finds)."""
        if n:
            self.unmeasured[reason] = self.unmeasured.get(reason, 0) + n


class StepBoundaries:
    """The open step and what ends it: the step half of the Recorder, whose per-call half
    (recorder.py) appends the calls and calls `_new_phase()` at a forward after a backward."""

    def __init__(self, devices: Devices, *, every_n_steps: int, record_no_grad: bool,
                 fallback_after: int, on_error: Callable[[str, BaseException], None],
                 on_step: Callable[[Handed], None]):
        self.devices = devices
        self.every_n_steps = every_n_steps
        self.record_no_grad = record_no_grad
        self.fallback_after = fallback_after
        self._on_error = on_error
        self._on_step = on_step
        self.enabled = False
        self.measuring = False
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
        self.resolved_unmeasured: dict[str, int] = {}
        """Calls the resolver thread found unmeasured (``graph_capture_backward``), cumulative;
        it counts them in their step's report itself."""
        self._current_devices: dict[str, Any] = {}  # device kind -> current index, this step
        self.sites = Sites()
        self.backward_seen = False
        self.in_backward = 0
        self.python_hooks = False
        """Set once the C++ backward hooks were seen not to fire (see boundary): Python's from then on."""
        self._native_hooked = 0  # calls of the open step whose backward the C++ hooks time
        self._native_starts = 0  # the native timers' backward starts at its first such call
        self._unseen_steps = 0
        self.optimizer_seen = False
        self.fallback_mode = False
        self._phases: list[list[Call]] = []
        self.tap: Any = None
        """The dispatcher tap (fadiag/capture/tap.py) once installed: its calls join each step's."""
        self._tap_timers: list[Any] = []
        """The tap's timers that are not the devices' native ones (their backward counts too)."""
        self.pending: Callable[[], None] | None = None
        """Work for the training thread at the next boundary (installing the tap: registering
        kernels while another thread dispatches ops is not safe)."""
        self._unmeasured_seen: dict[str, int] = {}
        self._unmeasured_moved = 0
        self.quiet: Any = None
        """Steady bypassed steps closed in C++ at the optimizer's step (steps/quiet.py), with the
        tap."""
        self.step_hook: Callable[[], None] = self.optimizer_step
        """What the optimizer's post hook calls: `optimizer_step`, or the C++ hook that closes
        steady bypassed steps itself and calls it for the others (steps/quiet.py)."""

    def _closing(self, batch: Any, unlinked: int, bypassed: int) -> tuple[Any, bool, bool]:
        """The open step is closing with the tap's cut `batch` (`unlinked`: its records of calls
        not the wrapper's; `bypassed`: the calls SDPA's builtins passed on while bypassing, from
        the same C++ call): the EagerOrder its bypassed calls are named by (None: not bypassed),
        whether the resolver learns its order, and whether that verifies the order bypassed steps
        follow. The Recorder's; here none."""
        return None, False, False

    def _sampled(self, index: int) -> bool:
        return self.every_n_steps <= 1 or index % self.every_n_steps == 0

    def _next_step(self) -> None:
        """What the per-call half renews when a step ends (the Recorder overrides it)."""

    # ---- micro-batches and steps -------------------------------------------------------------

    def _new_phase(self) -> None:
        """A forward after a backward: a new micro-batch (or, without optimizer, a new step)."""
        self.backward_seen = False
        self.sites.new_pass()
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

    def optimizer_step(self) -> None:
        """An optimizer's step ended (its post hook)."""
        self.boundary("optimizer")

    def boundary(self, source: str) -> None:
        """End the current step. One with no attention is reported only at an optimizer step
        (it still counts as a step); other boundaries without attention are ignored."""
        try:
            if self.quiet is not None:  # the steps closed in C++ since the last, first
                self.quiet.take(self)
            if source in ("optimizer", "manual") and not self.optimizer_seen:
                self.optimizer_seen = True
                self.fallback_mode = False
            if self._phases:
                merged = [c for phase in self._phases for c in phase]
                self.calls = merged + self.calls
                self._phases = []
            tap = self.tap
            batch, unlinked, trained, counted, bypassed = (
                tap.cut_step() if tap is not None else (None, 0, False, 0, 0))
            order, learn, verifies = self._closing(batch, unlinked, bypassed)
            if batch is not None and not self.record_no_grad and not trained:
                tap.discard(batch, Call)  # evaluation only: counted as no_grad, marks back
                batch = None
            # An optimizer step is a step (fadiag_steps_total) even with no attention measured;
            # so is a manual one whose attention all ran unmeasured (flex in a compiled graph).
            empty_step = self.measuring and (
                source == "optimizer" or (source == "manual" and self._op_counted_since()))
            if (not self.calls_since_boundary and not self.calls and batch is None
                    and not empty_step):
                self._run_pending()
                return
            closed = None
            if self.calls or batch is not None or empty_step:
                closed = ClosedStep(self.step_index, self.calls, self._step_device(),
                                    self._unmeasured_since(counted), tap, batch)
                closed.order, closed.learn_order, closed.verifies = order, learn, verifies
            self.calls = []
            self.calls_since_boundary = 0
            self.sites.new_pass()
            self._current_devices.clear()
            self.backward_seen = False
            self._check_native_hooks(source)
            self._native_backward_seen()
            self.in_backward = 0
            for t in self.devices.native_timers:
                t.reset_in_backward()
            self.step_index += 1
            was = self.measuring
            self.measuring = self.enabled and self._sampled(self.step_index)
            if tap is not None and self.measuring != was:
                tap.set_measuring(self.measuring)
            if self.pending is not None:
                self._run_pending()
            self._next_step()
            if closed is not None:  # an unsampled step has nothing to resolve
                self._on_step(closed)
        except Exception as e:
            self._on_error("recorder.boundary", e)

    def unmeasured_totals(self) -> dict[str, int]:
        """Attention calls seen and not measured since start, by reason (cumulative)."""
        totals = {"sampling": self.sampled_out, "per_step_cap": self.over_cap,
                  "other_device": self.other_device, **self.unmeasured}
        # Copied at once (under the GIL): the resolver thread adds to it while this may run.
        for reason, n in list(self.resolved_unmeasured.items()):
            totals[reason] = totals.get(reason, 0) + n
        if self.tap is not None:
            for reason, n in self.tap.counts().items():
                if reason != "errors":
                    totals[reason] = totals.get(reason, 0) + n
        return totals

    def _unmeasured_since(self, tap_counted: int) -> dict[str, int]:
        """What unmeasured_totals() gained since the last boundary (reasons that moved;
        `tap_counted`: what the tap counted at its cut, Tap.cut_step). The tap's records become
        calls on the resolver thread, which adds to the step what it drops
        (ClosedStep.take_tap): those reasons are not read here."""
        # Every count only grows, so an unchanged sum means none moved: the common step reads
        # one sum instead of building the totals.
        moved = (self.sampled_out + self.over_cap + self.other_device
                 + sum(self.unmeasured.values()) + tap_counted)
        if moved == self._unmeasured_moved:
            return {}
        self._unmeasured_moved = moved
        totals = {k: v for k, v in self.unmeasured_totals().items() if k not in _RESOLVER_COUNTS}
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

    def open_calls(self) -> list[Call]:
        """The current step's calls so far (a copy; for the hang check)."""
        return list(self.calls) + [c for phase in list(self._phases) for c in phase]

    # ---- devices -----------------------------------------------------------------------------

    def _current(self, timer: Any) -> int | None:
        """The thread's current device for `timer`'s kind, read once a step (a Python call)."""
        current = self._current_devices.get(timer.kind, _UNREAD)
        if current is _UNREAD:
            current = self._current_devices[timer.kind] = timer.current_device()
        return current  # type: ignore[no-any-return]

    def _step_device(self) -> int | None:
        """The current device of the step's accelerator, as this step's calls saw it."""
        for c in self.calls:
            if c.timer.kind != "cpu":
                return self._device_of(c.timer)
        return self._tap_device()  # compiled code's calls only, or bypassed ones

    def _tap_device(self) -> int | None:
        """The current device of the tap's CUDA timer (None without one)."""
        return self._device_of(self.tap.timers.get("cuda") if self.tap is not None else None)

    def _device_of(self, timer: Any) -> int | None:
        try:
            return None if timer is None else self._current(timer)
        except Exception:  # the resolver then reads the current device's, as it would anyway
            return None

    # ---- the native timers' backward hooks -----------------------------------------------------

    def _native_backward_seen(self) -> bool:
        """Whether a native backward hook fired since the last look (they cannot set flags)."""
        seen = False
        for t in itertools.chain(self.devices.native_timers, self._tap_timers):
            n = t.backward_starts()
            if n != t.backward_starts_seen:
                t.backward_starts_seen = n
                seen = True
        return seen

    def _native_in_backward(self) -> bool:
        return any(t.in_backward() > 0 for t in self.devices.native_timers)

    def _check_native_hooks(self, source: str) -> None:
        """Steps that end at an optimizer step after C++-hooked calls whose hooks never fired:
        the backward ran where C++ hooks are not called (compiled autograd switched on around
        `backward()` alone, which the forward cannot see), or it never reached attention. After
        a few such steps in a row, later calls get Python hooks, which compiled autograd runs."""
        if not self._native_hooked:  # no call of this step was hooked in C++
            return
        if source == "optimizer":
            unseen = self.native_backward_starts() == self._native_starts
            self._unseen_steps = self._unseen_steps + 1 if unseen else 0
            if self._unseen_steps == _UNSEEN_STEPS and not self.python_hooks:
                self.python_hooks = True
                log.warning("fadiag: the C++ backward hooks did not fire in %d optimizer steps "
                            "(compiled autograd around backward(), or attention outputs unused "
                            "by the loss); attention backward is timed with Python hooks from now "
                            "on", _UNSEEN_STEPS)
        self._native_hooked = 0

    def native_backward_starts(self) -> int:
        """Backward starts the native timers' C++ hooks counted (cumulative). The per-call half
        reads it at a step's first hooked call, so a boundary can tell whether any fired."""
        return sum(t.backward_starts() for t in self.devices.native_timers)
