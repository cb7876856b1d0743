"""Which resolved steps get a report (sampling.reports_per_second), and a counted step's rows.

A launch-bound job closes a hundred steps a second, and a report per step (records, rules,
sinks) is most of what the resolver costs it. With a rate set, a steady step between reports
is counted instead: its calls' seconds go to the metrics (`Metrics.count`), and the next report
says how many such steps came before it (`StepReport.counted_before`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Protocol

from .records import windows_host_bound

Row = tuple[str, str, float, float, bool, bool]
"""A counted call: impl, site, forward seconds, backward seconds, recompute, host-bound."""
KeySums = tuple[str, str, list[int], float, int, list[int], float, int]
"""Counted calls of one key, summed (steps/steady.py's C++ tally): impl, site, forward histogram
counts, forward sum, calls, backward histogram counts, backward sum, host-bound calls."""


class Counter(Protocol):
    """Where counted steps go (export/prometheus.py's Metrics)."""

    @property
    def bounds(self) -> Sequence[float]:
        """The histograms' bucket bounds (what steps/steady.py's C++ tally sums into)."""

    def count(self, calls: list[Row]) -> None:
        """One counted step's calls."""

    def merge(self, steps: int, step_counts: list[int], step_sum: float,
              keys: list[KeySums]) -> None:
        """Steps counted in C++ (steps/steady.py's `take`)."""


class ReportRate:
    """The reports a second a resolver builds, on the training thread's clock.

    Example::

        rate = ReportRate(10.0)
        if rate.counted_only(step.closed, steady=True):
            metrics.count(rows(timed))
        else:
            report.counted_before = rate.reported()
    """

    def __init__(self, per_second: float):
        self.per_second = per_second
        self.counted = 0
        """Steps counted since the last report."""
        self._next_at = 0.0

    def due(self, closed: float) -> bool:
        """Whether a step closed at `closed` is reported whatever it holds (1/rate has passed
        since the last report, or no rate is set)."""
        return self.per_second <= 0 or closed >= self._next_at

    def due_from(self, closed: Sequence[float]) -> int:
        """How many of the steps closed at `closed` (in order) come before the first that `due`
        says is reported."""
        return 0 if self.per_second <= 0 else bisect.bisect_left(closed, self._next_at)

    def counted_only(self, closed: float, steady: bool) -> bool:
        """Whether a step closed at `closed` (monotonic s) is counted, not reported: a steady one
        (every call timed, none learning its signature, nothing unmeasured, a newer step pending)
        closed sooner than 1/rate after the last reported step. 0 reports every step."""
        if self.per_second <= 0:
            return False
        if steady and closed < self._next_at:
            self.counted += 1
            return True
        self._next_at = closed + 1.0 / self.per_second
        return False

    def reported(self) -> int:
        """A report is built: the steps counted before it (its `counted_before`)."""
        n, self.counted = self.counted, 0
        return n


def finite_seconds(x: float) -> float:
    """Timings that are not a finite non-negative number are recorded as 0."""
    if x != x or x < 0.0 or x == float("inf"):
        return 0.0
    return x


def rows(timed: list[tuple[Any, float, float, int, int]]) -> list[Row]:
    """A counted step's calls, as the resolver's records would read: (call, forward s,
    backward s, forward host ns, backward host ns) in, calls whose forward marks failed left out."""
    out = []
    for c, f, b, fi, bi in timed:
        if f != f:  # the call's forward marks failed (counted as internal errors)
            continue
        f, b = finite_seconds(f), finite_seconds(b)
        out.append((c.sig.impl, c.site, f, b, c.recompute,
                    windows_host_bound(f, b, fi * 1e-9, bi * 1e-9)))
    return out
