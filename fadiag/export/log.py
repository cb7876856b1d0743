"""The log sink: flags written through the `fadiag` logger, one line per rule episode.

Rate-limited per rule and severity (`log.flag_interval_seconds`), across sessions of a process.
"""

from __future__ import annotations

import logging
import time

from ..steps.records import Flag
from .sinks import Sink

log = logging.getLogger("fadiag")

_LOGGED: dict[tuple[str, str], float] = {}
"""When each rule last logged, by severity: kept per process, so attach() after detach() (a
benchmark's cycles, a restarted loop) does not speak again inside the interval."""


class LogSink(Sink):
    """One log line per rule for the flags one step raised (sites summarized), at most one per
    rule and severity per interval; info-severity flags (a healthy kernel) log at INFO.

    Example::

        sinks = FanOut([metrics, LogSink(interval=60.0)], on_error)
    """

    def __init__(self, interval: float):
        self.interval = interval

    def flags(self, flags: list[Flag]) -> None:
        by_rule: dict[str, list[Flag]] = {}
        for f in flags:
            by_rule.setdefault(f.rule, []).append(f)
        for rule, group in by_rule.items():
            cleared = [f for f in group if f.cleared]
            if cleared:
                sites = ", ".join(f.site for f in cleared[:3]) + (" …" if len(cleared) > 3 else "")
                log.info("fadiag: step %d rank %d: cleared: %s at %s", cleared[0].step,
                         cleared[0].rank, rule, sites)
            raised = [f for f in group if not f.cleared]
            if raised:
                self._log(rule, raised)

    def _log(self, rule: str, raised: list[Flag]) -> None:
        warning = any(f.severity != "info" for f in raised)
        key = (rule, "warning" if warning else "info")
        now = time.monotonic()
        if now - _LOGGED.get(key, -1e18) < self.interval:
            return
        _LOGGED[key] = now
        # The worst flag speaks for the others: the highest value (the lowest for savings).
        worst = (min if rule == "memory_savings" else max)(raised, key=lambda f: f.value)
        more = f"{len(raised)} sites at once, the worst: " if len(raised) > 1 else ""
        log.log(logging.WARNING if warning else logging.INFO, "fadiag: step %d rank %d: %s [%s]: %s%s",
                worst.step, worst.rank, rule, worst.severity, more, worst.message)
