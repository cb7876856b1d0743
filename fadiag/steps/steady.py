"""Steady steps counted in C++, with no Python per call (sampling.reports_per_second).

With a report rate set, most steps of a launch-bound job are counted, not reported
(steps/counting.py). Resolving such a step in Python (its records joined to calls, the marks
read, rows summed into the metrics) costs the training step about its own CPU time wherever it
runs, since the training thread and the autograd engine's want the GIL back all the time
(benchmarks/BENCHMARKS.md, runs 67-79). So the resolver learns the shape of each step it resolves
in Python, one of each kind (with calls of the eager wrapper's; with none: bypassed or compiled
steps, so that a step the wrapper measures to verify an order leaves the bypassed steps' shape
learned), and a later step of the same shape, whose calls are the same (impl, site,
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
    steady.count_quiet(run, n, 5.0)       # a QuietRun's first n steps (steps/quiet.py), as a run
    metrics.merge(*steady.take())
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..capture.calls import Call
from .boundary import ClosedStep
from .counting import KeySums
from .quiet import QuietRun
from .records import HOST_BOUND_SHARE

Summed = tuple[int, list[int], float, list[KeySums]]
"""What `take` hands over: steps, the step histogram's counts and sum, and each key's sums."""


class _Learned:
    """What `SteadySteps.learn` keeps of one steady step: its cut's shape, each record's key and
    whether it is a recomputation, the order that named its bypassed calls (None: not bypassed),
    and its linked calls (the eager wrapper's), in order: impl, site, recomputation."""

    __slots__ = ("shape", "record_keys", "recompute", "order", "linked")

    def __init__(self, shape: int, record_keys: list[int], recompute: list[bool], order: Any,
                 linked: list[tuple[str, str, bool]]):
        self.shape, self.record_keys, self.recompute = shape, record_keys, recompute
        self.order, self.linked = order, linked


class SteadySteps:
    """The last steady step resolved in Python, of each kind (with calls of the eager wrapper's or
    none), and the C++ tally of steps like it."""

    def __init__(self, tap: Any, bounds: Sequence[float]):
        self.tap = tap
        self._tally = tap.tally(list(bounds), HOST_BOUND_SHARE)
        self._keys: dict[tuple[str, str], int] = {}
        self._names: list[tuple[str, str]] = []
        self._learned: dict[bool, _Learned] = {}
        """By whether the step had calls of the eager wrapper's: a step the wrapper measures
        every steps.verify_every-th leaves the bypassed steps' shape learned, and the next
        bypassed step is counted in C++ too."""
        self.counted = 0
        """Steps counted here (cumulative)."""

    def learned(self, wrapper: bool) -> _Learned | None:
        """The step learned with (`wrapper`) or without calls of the eager wrapper's, or None."""
        return self._learned.get(wrapper)

    def before(self, step: ClosedStep) -> tuple[int, list[int], list[int], Any] | None:
        """What learning `step`'s shape needs from its cut, read before its records are joined to
        calls (ClosedStep.take_tap consumes the cut), and the order that names its bypassed calls."""
        batch = step.tap_batch
        if batch is None or step.tap is not self.tap:
            return None
        return batch.shape(), batch.firsts(), batch.link_numbers(), step.order

    def learn(self, seen: tuple[int, list[int], list[int], Any] | None, calls: list[Call]) -> None:
        """`calls`, a steady step's calls joined to its records (`seen`: `before`'s): every record
        one call, its key learned for steps of its kind. Anything else forgets what was learned."""
        learned = self._learn(seen, calls)
        if learned is None:
            self._learned.clear()
        else:
            self._learned[bool(learned.linked)] = learned

    def _learn(self, seen: tuple[int, list[int], list[int], Any] | None,
               calls: list[Call]) -> _Learned | None:
        if seen is None:
            return None
        shape, firsts, links, order = seen
        by_first = {c.fwd0: c for c in calls}
        linked = [c for c in calls if c.link]
        if (len(firsts) != len(calls) or len(by_first) != len(calls)
                or [c.link for c in linked] != links):
            return None
        ordered = [by_first.get(f) for f in firsts]
        if any(c is None or c.sig is None for c in ordered):
            return None
        return _Learned(
            shape,
            [self._key(c.sig.impl, c.site) for c in ordered],  # type: ignore[union-attr]
            [bool(c.recompute) for c in ordered],  # type: ignore[union-attr]
            order,
            [(c.sig.impl, c.site, bool(c.recompute)) for c in linked])  # type: ignore[union-attr]

    def count(self, step: ClosedStep, give_up: bool) -> int:
        """Count `step` in C++ if it is shaped as the learned one of its kind and its calls are
        the same: 1 counted (its cut consumed), 0 a mark the device has not passed, -1 Python's to
        resolve (nothing changed)."""
        calls = step.calls
        learned = self._learned_for(step, bool(calls))
        if learned is None or len(calls) != len(learned.linked):
            return -1
        for c, (impl, site, recompute) in zip(calls, learned.linked, strict=True):
            sig = c.sig
            if (sig is None or not c.link or c.aborted or c.probe or sig.impl != impl
                    or c.site != site or bool(c.recompute) != recompute):
                return -1
        batch = step.tap_batch
        if batch.shape() != learned.shape or batch.link_numbers() != [c.link for c in calls]:
            return -1
        done = self.tap.count(batch, self._tally, learned.record_keys, learned.recompute,
                              give_up)
        if done == 1:
            step.tap = step.tap_batch = None
            self.counted += 1
        return done

    def in_run(self, step: ClosedStep) -> bool:
        """Whether `step` may be counted with others in one C++ call (`count_run`): a step with no
        call of the eager wrapper's, one like it learned, nothing unmeasured, named by the same
        order (its cut's shape is checked in C++)."""
        return not step.calls and self._learned_for(step, False) is not None

    def _learned_for(self, step: ClosedStep, wrapper: bool) -> _Learned | None:
        """The step learned of `step`'s kind (`wrapper`: with calls of the eager wrapper's), where
        it may stand for `step` at all: a cut of this tap's, nothing unmeasured, not a step that
        verifies an order (Python learns it), and its calls named by the same order, unbroken."""
        if step.tap_batch is None or step.unmeasured or step.verifies:
            return None
        return self._named_alike(step.tap, step.order, wrapper)

    def _named_alike(self, tap: Any, order: Any, wrapper: bool) -> _Learned | None:
        """The step learned of its kind (`wrapper`), where steps of `tap` named by `order` are
        like it: the same tap, the same order, unbroken."""
        learned = self._learned.get(wrapper)
        if (learned is None or tap is not self.tap or order is not learned.order
                or (order is not None and order.broken)):
            return None
        return learned

    def count_head(self, pending: Any, newest: ClosedStep | QuietRun | None,
                   due: Callable[[float], bool],
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
        learned = self._learned[False]
        counted, why = self.tap.count_run([s.tap_batch for s in steps], learned.shape,
                                          self._tally, learned.record_keys, learned.recompute,
                                          give_up)
        for step in steps[:counted]:
            step.tap = step.tap_batch = None
        self.counted += counted
        return counted, why

    def count_quiet(self, run: QuietRun, n: int, grace_s: float) -> tuple[int, int]:
        """The first `n` steps of `run` (bypassed steps closed in C++, each `in_run` but for its
        order), counted in order in one C++ call as `count_run` counts steps, where the bypassed
        step learned was named by the same order, unbroken: how many were (taken off the run),
        and why the next was not; (0, -1) where none may be."""
        learned = self._named_alike(run.tap, run.order, False)
        if learned is None:
            return 0, -1
        counted, why = self.tap.count_quiet(run.native, n, learned.shape, self._tally,
                                            learned.record_keys, learned.recompute, grace_s)
        run.counted(counted)
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
