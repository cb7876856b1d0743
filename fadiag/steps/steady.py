"""Steady steps counted in C++, with no Python per call (sampling.reports_per_second).

With a report rate set, most steps of a launch-bound job are counted, not reported
(steps/counting.py). Resolving such a step in Python (its records joined to calls, the marks
read, rows summed into the metrics) costs the training step about its own CPU time wherever it
runs, since the training thread and the autograd engine's want the GIL back all the time
(benchmarks/BENCHMARKS.md, runs 67-79). So the resolver learns the shape of each step it resolves
in Python, and a later step of the same shape, whose calls are the same (impl, site,
recomputation), is counted by the dispatcher tap's C++ (`Tally` in capture/_native/tap.cpp): the
marks read without the GIL, the seconds summed per key as `Metrics.count` sums rows, the marks
given back. Steps with no call of the eager wrapper's (bypassed eager steps, compiled ones) that
wait together are counted as a run: one C++ call, and one release of the GIL, for all of them. The
sums reach the metrics at the end of each pass, before each report and before a flush() is
answered (`take`).

Example::

    steady = SteadySteps(tap, bounds=BUCKETS)
    seen = steady.before(step)            # before the step's records are joined to calls
    ...                                   # resolved in Python
    steady.learn(seen, step.calls)        # a steady step: later ones like it are counted in C++
    steady.count(step, give_up=False)     # 1 counted, 0 not yet, -1 Python's to resolve
    steady.count_head(pending, newest, rate.due, 5.0)  # the steady steps at the head, as a run
    metrics.merge(*steady.take())
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..capture.calls import Call
from .boundary import ClosedStep
from .counting import KeySums
from .records import HOST_BOUND_SHARE

Summed = tuple[int, list[int], float, list[KeySums]]
"""What `take` hands over: steps, the step histogram's counts and sum, and each key's sums."""


class SteadySteps:
    """The shape of the last steady step resolved in Python, and the C++ tally of steps like it."""

    def __init__(self, tap: Any, bounds: Sequence[float]):
        self.tap = tap
        self._tally = tap.tally(list(bounds), HOST_BOUND_SHARE)
        self._keys: dict[tuple[str, str], int] = {}
        self._names: list[tuple[str, str]] = []
        self._shape: int | None = None
        self._record_keys: list[int] = []
        self._recompute: list[bool] = []
        self._order: Any = None
        """The EagerOrder that named the learned step's bypassed calls (None: not bypassed)."""
        self._linked: list[tuple[str, str, bool]] = []
        """The step's linked calls (the eager wrapper's), in order: impl, site, recomputation."""
        self.counted = 0
        """Steps counted here (cumulative)."""

    def before(self, step: ClosedStep) -> tuple[int, list[int], list[int], Any] | None:
        """What learning `step`'s shape needs from its cut, read before its records are joined to
        calls (ClosedStep.take_tap consumes the cut), and the order that names its bypassed calls."""
        batch = step.tap_batch
        if batch is None or step.tap is not self.tap:
            return None
        return batch.shape(), batch.firsts(), batch.link_numbers(), step.order

    def learn(self, seen: tuple[int, list[int], list[int], Any] | None, calls: list[Call]) -> None:
        """`calls`, a steady step's calls joined to its records (`seen`: `before`'s): every record
        one call, its key learned. Anything else forgets the shape."""
        self._shape = None
        if seen is None:
            return
        shape, firsts, links, order = seen
        by_first = {c.fwd0: c for c in calls}
        linked = [c for c in calls if c.link]
        if (len(firsts) != len(calls) or len(by_first) != len(calls)
                or [c.link for c in linked] != links):
            return
        ordered = [by_first.get(f) for f in firsts]
        if any(c is None or c.sig is None for c in ordered):
            return
        self._record_keys = [self._key(c.sig.impl, c.site) for c in ordered]  # type: ignore[union-attr]
        self._recompute = [bool(c.recompute) for c in ordered]  # type: ignore[union-attr]
        self._linked = [(c.sig.impl, c.site, bool(c.recompute)) for c in linked]  # type: ignore[union-attr]
        self._shape = shape
        self._order = order

    def count(self, step: ClosedStep, give_up: bool) -> int:
        """Count `step` in C++ if it is shaped as the learned one and its calls are the same:
        1 counted (its cut consumed), 0 a mark the device has not passed, -1 Python's to resolve
        (nothing changed)."""
        batch = step.tap_batch
        if not self._learned_for(step):
            return -1
        calls = step.calls
        if len(calls) != len(self._linked):
            return -1
        for c, (impl, site, recompute) in zip(calls, self._linked, strict=True):
            sig = c.sig
            if (sig is None or not c.link or c.aborted or c.probe or sig.impl != impl
                    or c.site != site or bool(c.recompute) != recompute):
                return -1
        if batch.shape() != self._shape or batch.link_numbers() != [c.link for c in calls]:
            return -1
        done = self.tap.count(batch, self._tally, self._record_keys, self._recompute, give_up)
        if done == 1:
            step.tap = step.tap_batch = None
            self.counted += 1
        return done

    def in_run(self, step: ClosedStep) -> bool:
        """Whether `step` may be counted with others in one C++ call (`count_run`): a learned step
        with no call of the eager wrapper's, and `step` one with none either, nothing unmeasured,
        named by the same order (its cut's shape is checked in C++)."""
        return not self._linked and not step.calls and self._learned_for(step)

    def _learned_for(self, step: ClosedStep) -> bool:
        """Whether the learned step may stand for `step` at all: a shape learned, a cut of this
        tap's, nothing unmeasured, and its calls named by the same order, unbroken."""
        return (self._shape is not None and step.tap_batch is not None and step.tap is self.tap
                and not step.unmeasured and step.order is self._order
                and (step.order is None or not step.order.broken))

    def count_head(self, pending: Any, newest: ClosedStep | None, due: Callable[[float], bool],
                   grace_s: float) -> tuple[int, int]:
        """The steps at the head of `pending` (the resolver's deque of closed steps and flush
        markers) that are `in_run`, counted in one C++ call (`count_run`) and taken off it. A run
        ends before a marker, `newest`, or a step closed when `due` says a report is due; a step
        closed `grace_s` ago or more no longer waits for a backward that started."""
        run: list[ClosedStep] = []
        for s in pending:
            if not isinstance(s, ClosedStep) or s is newest or due(s.closed) or not self.in_run(s):
                break
            run.append(s)
        if not run:
            return 0, -1
        now = time.monotonic()
        counted, why = self.count_run(run, [now - s.closed >= grace_s for s in run])
        for _ in range(counted):
            pending.popleft()
        return counted, why

    def count_run(self, steps: list[ClosedStep], give_up: list[bool]) -> tuple[int, int]:
        """Steps that are all `in_run`, counted in order in one C++ call, as `count` counts each:
        how many were (their cuts consumed), and why the next was not (0 a mark the device has
        not passed, -1 Python's to resolve, 1 none left)."""
        assert self._shape is not None
        counted, why = self.tap.count_run([s.tap_batch for s in steps], self._shape,
                                          self._tally, self._record_keys, self._recompute,
                                          give_up)
        for step in steps[:counted]:
            step.tap = step.tap_batch = None
        self.counted += counted
        return counted, why

    def take(self) -> Summed | None:
        """What was counted since the last take, keys named, or None."""
        summed = self._tally.take()
        if summed is None:
            return None
        steps, step_counts, step_sum, keys = summed
        return steps, step_counts, step_sum, [(*self._names[k], *rest) for k, *rest in keys]

    def _key(self, impl: str, site: str) -> int:
        key = self._keys.get((impl, site))
        if key is None:
            key = self._keys[(impl, site)] = len(self._names)
            self._names.append((impl, site))
        return key
