"""A step's peak memory, for its report: the allocator's peak since the step before, or the RSS.

The resolver reads it for each step it reports. The device allocator's figures are cumulative, so
a step's own peak is read against the previous reading (without resetting torch's peak, which the
user may read too); a CPU step reports the process's resident set, read at most every
_RSS_EVERY_S.
"""

from __future__ import annotations

import time
from typing import Any

import psutil

_RSS_EVERY_S = 0.5
"""CPU runs report the process RSS as the step's peak (~0.1 ms a read): at most twice a second."""


class StepPeaks:
    """Each reported step's peak bytes (`of`), from the readings of the steps before it."""

    def __init__(self) -> None:
        self._before: dict[str, dict[str, int]] = {}
        self._process = psutil.Process()
        self._rss: int | None = None
        self._rss_at = 0.0

    def of(self, timers: dict[str, Any], device: int | None) -> int | None:
        """Allocator peak since the previous reading (non-destructive) of the first accelerator
        of `timers` (device kind -> the timer of the step's calls), on `device`, or the RSS."""
        for kind, timer in timers.items():
            if kind == "cpu":
                continue
            after = timer.memory_stats(device)
            before = self._before.get(kind)
            self._before[kind] = after
            if before is None:
                return int(after["peak"])
            if after["peak"] > before["peak"]:
                return int(after["peak"])
            return int(min(before["peak"], max(before["current"], after["current"])
                           + (after["allocated"] - before["allocated"])))
        now = time.monotonic()
        if self._rss is None or now - self._rss_at >= _RSS_EVERY_S:
            self._rss, self._rss_at = int(self._process.memory_info().rss), now
        return self._rss
