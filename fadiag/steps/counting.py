"""Which resolved steps get a report (sampling.reports_per_second): a reported step's StepReport,
a counted step's rows.

A launch-bound job closes a hundred steps a second, and a report per step (records, rules,
sinks) is most of what the resolver costs it. With a rate set, a steady step between reports
is counted instead: its calls' seconds go to the metrics (`Metrics.count`), and the next report
says how many such steps came before it (`StepReport.counted_before`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Protocol

from .records import CallRecord, StepReport, windows_host_bound

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


def step_report(step: Any, timed: list[tuple[Any, float, float, int, int]], rank: int,
                step_peak: int | None, counted_before: int) -> StepReport:
    """A reported step's StepReport: `step` a ClosedStep, `timed` as `rows` takes it, with the
    step's allocator peak and the steps counted before it (ReportRate.reported)."""
    records: list[CallRecord] = []
    fwd = bwd = recompute = 0.0
    kept: int | None = 0
    standard = 0
    peak: int | None = None
    for c, f, b, fi, bi in timed:
        if f != f:  # the call's forward marks failed (counted as internal errors)
            continue
        sig = c.sig
        f, b = finite_seconds(f), finite_seconds(b)
        kept_bytes = None if sig.forward_only else sig.kept_bytes
        # Positional, in CallRecord's field order: a third of the keywords' cost.
        record = CallRecord(
            c.site, sig.impl, sig.shape, sig.dtype, sig.causal, sig.dropout, sig.kv_heads,
            sig.layout, sig.device, f, b, kept_bytes, sig.standard_bytes, sig.peak_bytes,
            c.recompute, sig.interceptor, sig.fallback_reason, c.probe, sig.forward_only,
            None, None, fi * 1e-9, bi * 1e-9)
        if c.extra is not None:  # the op's own per-call fields (flex: sparsity, options)
            for name, value in c.extra.resolve().items():
                setattr(record, name, value)
        records.append(record)
        bwd += b
        if c.recompute:
            recompute += f
            continue
        fwd += f
        standard += sig.standard_bytes
        kept = None if kept is None or kept_bytes is None else kept + kept_bytes
        if sig.peak_bytes is not None:
            peak = sig.peak_bytes if peak is None else max(peak, sig.peak_bytes)
    if not records:
        kept = None
    return StepReport(
        step=step.index, forward_seconds=fwd, backward_seconds=bwd, kept_bytes=kept,
        standard_bytes=standard, peak_bytes=peak, step_peak_bytes=step_peak, calls=records,
        rank=rank, wall_time=step.wall_time, recompute_seconds=recompute,
        unmeasured=step.unmeasured, cpu_wait=step.cpu_wait, counted_before=counted_before)
