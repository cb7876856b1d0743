"""Steady bypassed steps closed in C++ at the optimizer's step: no Python on the training thread.

A bypassed eager step (bypass.py) ends at the optimizer's step, where the Python boundary
(boundary.py) cuts the tap's records, counts the builtins' calls, builds the ClosedStep, opens the
next step and hands the closed one over: about 50 µs of Python a step on the CPU machine, on the
training thread of a launch-bound job (benchmarks/BENCHMARKS.md §4). So once a bypassed step is
open, the boundary arms the tap's `QuietSteps` (capture/_native/tap.cpp), the recorder's optimizer
hook, for the steps that may still be bypassed before the wrapper measures one to verify the
order. The hook closes each step that the Python boundary would close as a bypassed step matching
its order with nothing else to do: no call of the eager wrapper's, nothing pending, nothing counted
unmeasured, the same unbroken order, every call of SDPA's builtins one of the tap's records,
something trained. It keeps the step's cut and its times. The first step that is anything else
disarms it and goes to the Python boundary, which first hands over the steps closed in C++, in
order, as one QuietRun (`take`): no Python object a step on the training thread. The resolver
counts a run's steps in one C++ call where it counts steady steps at all (steps/steady.py), and
makes the ClosedStep the Python boundary would have made of each other step, one at a time, when
it comes to it (`QuietRun.split`): one due for a report, the newest, one not shaped as the
learned step. A run lasts at most _CAP_S (host-clock steps: _CAP_HOST_S, as often as the CPU
wait is read, capture/host.py; the first step after arming is always closed), so the resolver
gets its steps about as it would.

Example (the Recorder's)::

    quiet = QuietSteps(tap, recorder, recorder.optimizer_step)
    recorder.step_hook = quiet.native.step  # the optimizer's post hook calls it
    quiet.take(recorder)                    # at each Python boundary, first: a QuietRun
    quiet.arm(recorder)                     # at its end, once the next step is open
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .boundary import ClosedStep

_CAP_S = 0.1
"""The longest run of steps closed in C++ before the Python boundary hands them over."""
_CAP_HOST_S = 0.02
"""The same for host-clock steps (CPU), whose CPU wait is read at most this often."""


class QuietSteps:
    """The tap's QuietSteps hook, armed and emptied by the recorder's Python boundary."""

    def __init__(self, tap: Any, recorder: Any, fallback: Callable[[], None]):
        self.native = tap.quiet_steps(recorder, fallback)
        self._host_clock = "cuda" not in tap.timers
        self._order: Any = None  # the order the armed steps are named by
        self._errors = 0

    @property
    def closed(self) -> int:
        """Steps closed in C++ (cumulative)."""
        return int(self.native.closed())

    def disarm(self) -> None:
        self.native.disarm()

    def arm(self, rec: Any) -> None:
        """After a Python boundary opened a bypassed step: let the hook close it and the steps after
        it that may be bypassed, if the step's state is one the hook can see unchanged."""
        # An order in use is one Bypass.next_order just gave, having checked the recorder's state
        # (measuring, an optimizer seen, nothing pending, the tap's order); with sampling, the
        # next step may be sampled out, which the hook cannot open.
        bypass = rec.bypass
        order = bypass.order
        if order is None or rec.every_n_steps > 1:
            return
        budget = bypass.quiet_budget()
        if budget <= 0:
            return
        self._order = order
        self.native.arm(order, budget, bypass.seen, rec.tap.cuda_graph_calls,
                        sum(rec.unmeasured.values()), _CAP_HOST_S if self._host_clock else _CAP_S)

    def take(self, rec: Any) -> None:
        """At a Python boundary, first: the steps closed in C++ since the last, handed over as one
        QuietRun (each with its own index and times, named by the armed order), and the
        recorder's and the bypass's counts moved on as the Python boundary would have."""
        native, seen = self.native.take()
        errors = int(self.native.errors())
        if errors != self._errors:  # the hook gave the step to Python: training went on
            rec._on_error("recorder.quiet", RuntimeError(
                f"{errors - self._errors} step(s) not closed in C++ (attributes unreadable)"))
            self._errors = errors
        if native is None:
            return
        run = QuietRun(rec.step_index, native, self._order, rec._tap_device(), rec.tap)
        steps = len(native)
        rec.step_index += steps
        rec._on_step(run)
        rec.bypass.closed_quietly(steps, seen)


class QuietRun:
    """Bypassed steps closed in C++ in a row, handed to the resolver as one item: what the Python
    boundary would have made a ClosedStep each of (index, cut, times, order; no wrapper's call,
    nothing unmeasured), in order, their cuts and times kept in C++ (`native`, the tap's TapRun).
    The resolver counts its first steps in C++ (steps/steady.py) or takes them one at a time as
    ClosedSteps (`split`); `calls` is empty, as each step's is."""

    __slots__ = ("first", "native", "order", "device", "tap", "cpu_wait")

    calls: tuple[()] = ()

    def __init__(self, first: int, native: Any, order: Any, device: int | None, tap: Any):
        self.first = first
        """The index of its first step left; the others follow it."""
        self.native = native
        self.order, self.device, self.tap = order, device, tap
        self.cpu_wait: float | None = None
        """Host-clock steps: the process's CPU wait, read once for the run (Session._on_step)."""

    def __len__(self) -> int:
        return len(self.native)

    @property
    def host_clock(self) -> bool:
        """Whether its steps' timings are the host clock's (ClosedStep.host_clock)."""
        return "cuda" not in self.tap.timers

    def closed(self) -> list[float]:
        """When each step left closed (time.monotonic), in order."""
        return self.native.closed()  # type: ignore[no-any-return]

    def counted(self, n: int) -> None:
        """Its first `n` steps were counted in C++, which took them off it."""
        self.first += n

    def split(self) -> ClosedStep:
        """Its first step, taken off it, as the ClosedStep the Python boundary would have made."""
        batch, closed, wall = self.native.split()
        step = ClosedStep(self.first, [], self.device, None, self.tap, batch)
        step.closed, step.wall_time, step.order, step.cpu_wait = closed, wall, self.order, self.cpu_wait
        self.first += 1
        return step

    def drop_tap(self) -> None:
        """None of its steps will be resolved: the marks of every cut left given back."""
        self.tap.release(self.native)


Handed = ClosedStep | QuietRun
"""What a step boundary hands the resolver: one closed step, or a run of them closed in C++."""
