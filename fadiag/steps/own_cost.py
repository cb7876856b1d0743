"""fadiag's own cost, said where it costs the step: a host-bound job and a busy resolver.

The resolver thread's CPU time is fadiag's work beside training (`fadiag_resolver_cpu_seconds_total`).
On a GPU-bound step it runs while the host waits for the device and costs nothing; on a step whose
device waits for the host (most attention windows host-bound), the host is the bottleneck and that
time is added to the step, or more: it shares the GIL with training (benchmarks/BENCHMARKS.md §4).
So once, when both hold over a window of steps, the log says how much, the setting that keeps
every call timed and builds fewer reports (sampling.reports_per_second), and the sampling period
that brings it under a tenth of a percent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SHARE = 0.01
"""The resolver's CPU time over wall time above which a host-bound job hears of it."""
HOST_BOUND = 0.5
"""The share of measured calls with host-bound windows that makes a job host-bound."""
TARGET = 0.001
"""What the suggested sampling brings the resolver's share down to."""
WINDOW_S = 10.0
"""Wall seconds of training a judgement spans."""
MIN_STEPS = 100
"""Steps a judgement spans at least (a job's first steps learn signatures and warm caches)."""
REPORTS = 10
"""The sampling.reports_per_second suggested to a job that reports every step."""


@dataclass(frozen=True)
class Totals:
    """Cumulative figures at one moment (the resolver's tick)."""

    now: float
    """Monotonic seconds."""
    cpu_seconds: float
    """The resolver thread's CPU time so far."""
    steps: int
    """Steps resolved so far."""
    calls: int
    """Attention calls measured so far (forward windows)."""
    host_bound: int
    """Of those, calls whose device windows may hold host time."""


class OwnCost:
    """Judges fadiag's own cost over windows of WINDOW_S, and words the one hint it gives.

    Example::

        own = OwnCost(every_n_steps=1, reports_per_second=0)
        hint = own.update(Totals(time.monotonic(), resolver.cpu_seconds, steps, calls, host_bound))
        if hint:
            log.warning(hint)
    """

    def __init__(self, every_n_steps: int = 1, reports_per_second: float = 0):
        self.every_n_steps = every_n_steps
        self.reports_per_second = reports_per_second
        self._start: Totals | None = None
        self.said = False

    def update(self, now: Totals) -> str | None:
        """The hint, the first time a window shows a host-bound job and a busy resolver."""
        if self.said:
            return None
        start = self._start
        if start is None or now.steps < start.steps or now.calls < start.calls:
            self._start = now  # the first tick, or counters that started again
            return None
        wall = now.now - start.now
        steps = now.steps - start.steps
        if wall < WINDOW_S or steps < MIN_STEPS:
            return None
        self._start = now
        calls = now.calls - start.calls
        cpu = now.cpu_seconds - start.cpu_seconds
        share = cpu / wall
        host_bound = min(1.0, (now.host_bound - start.host_bound) / calls) if calls else 0.0
        if share <= SHARE or host_bound < HOST_BOUND:
            return None
        self.said = True
        per_step = cpu / steps
        every = self.every_n_steps * math.ceil(share / TARGET)
        fewer = ""
        if not self.reports_per_second and steps / wall > REPORTS:
            fewer = (f"A report for {REPORTS} steps a second (sampling.reports_per_second: "
                     f"{REPORTS}) keeps every call timed and counted in the metrics and spares "
                     "most of that work; ")
        return (f"fadiag: this job is host-bound (the device waited for the host in {host_bound:.0%}"
                f" of the attention calls measured over the last {wall:.0f} s), and fadiag's "
                f"resolver thread used {share:.1%} of that time in CPU ({per_step * 1e6:.0f} µs a "
                "step): on a host-bound step that time is added to the step, or more (it shares the "
                f"GIL with training). {fewer}measuring one step in {every} "
                f"(sampling.every_n_steps: {every}) brings it under {TARGET:.1%}; "
                "fadiag_resolver_cpu_seconds_total shows it")
