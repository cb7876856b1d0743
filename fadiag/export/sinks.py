"""Where step reports and flags go: one tiny interface, and a container that fans out.

Sinks run on fadiag's worker thread, never on the training thread; they know nothing of torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from ..steps.records import Flag, StepReport

log = logging.getLogger("fadiag")


class Sink:
    """Does nothing; subclasses override what they need."""

    def emit(self, report: StepReport) -> None:
        """A step was resolved."""

    def flag(self, flag: Flag) -> None:
        """A rule raised (or cleared) a flag."""

    def flags(self, flags: list[Flag]) -> None:
        """The flags one evaluation raised or cleared, together (a step's, or a hang check's)."""
        for f in flags:
            self.flag(f)

    def close(self) -> None:
        """Flush and release resources; called once by detach()."""


class FanOut(Sink):
    """Sends every report and flag to each sink; one sink failing never stops the others."""

    def __init__(self, sinks: Iterable[Sink], on_error: Callable[[str, BaseException], None]):
        self.sinks = list(sinks)
        self._on_error = on_error

    def emit(self, report: StepReport) -> None:
        for s in self.sinks:
            try:
                s.emit(report)
            except Exception as e:  # a sink must never break the others
                self._on_error(f"sink {type(s).__name__}.emit", e)

    def flag(self, flag: Flag) -> None:
        self.flags([flag])

    def flags(self, flags: list[Flag]) -> None:
        if not flags:
            return
        for s in self.sinks:
            if type(s).flags is Sink.flags:  # flag by flag, so one failure costs one delivery
                for f in flags:
                    try:
                        s.flag(f)
                    except Exception as e:
                        self._on_error(f"sink {type(s).__name__}.flag", e)
                continue
            try:
                s.flags(flags)
            except Exception as e:
                self._on_error(f"sink {type(s).__name__}.flags", e)

    def close(self) -> None:
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:
                self._on_error(f"sink {type(s).__name__}.close", e)


class CallbackSink(Sink):
    """Calls the user's ``on_flag(flag)`` for every raised flag."""

    def __init__(self, on_flag: Callable[[Flag], object]):
        self._on_flag = on_flag

    def flag(self, flag: Flag) -> None:
        if not flag.cleared:
            self._on_flag(flag)
