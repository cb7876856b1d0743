"""Trainer callbacks: HF transformers (`integrations.hf`) and PyTorch Lightning (`integrations.lightning`).

Importing fadiag or this package never imports a framework; each callback class is built on
first use. What both callbacks do lives here in `TrainingRun`, free of any framework.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import fadiag

from ..steps.records import StepReport


class TrainingRun:
    """Attach when training starts unless fadiag already is; detach at the end only if we attached.

    Example::

        run = TrainingRun(port=0)
        run.start()
        ...                      # training steps
        logs.update(run.metrics())
        run.stop()
    """

    def __init__(self, config: Any = None, overrides: Mapping[str, Any] | None = None):
        self._config = config
        self._overrides = dict(overrides or {})
        self.session: Any = None
        self.owned = False
        self._last_step = -1

    def start(self) -> Any:
        """The session: the one already attached, or a new one this run owns."""
        if self.session is not None:
            return self.session
        owned = fadiag.current_session() is None
        # Already attached (`fadiag run`, or the script): attach() returns that session, and
        # warns when this run's own settings are then ignored.
        self.session = fadiag.attach(self._config, **self._overrides)
        self.owned = owned
        return self.session

    def finish(self) -> dict[str, float]:
        """The figures of the steps resolved since the last log, once the last step has been
        resolved (a bounded wait, at the end of training)."""
        if self.session is None:
            return {}
        self.session.flush(5)
        return self.metrics()

    def stop(self) -> None:
        if self.owned:
            fadiag.detach()
        self.session = None
        self.owned = False

    def new_steps(self) -> list[StepReport]:
        """Steps resolved since the last call, oldest first."""
        if self.session is None:
            return []
        steps = [s for s in self.session.history() if s.step > self._last_step]
        if steps:
            self._last_step = steps[-1].step
        return steps

    def metrics(self) -> dict[str, float]:
        """Numbers for a trainer's log: the newest resolved step, and flags raised since last asked.

        Empty when no step resolved since the last call, so nothing stale is logged twice.
        """
        steps = self.new_steps()
        if not steps:
            return {}
        last = steps[-1]
        out: dict[str, float] = {
            "fadiag/step": float(last.step),
            "fadiag/forward_ms": last.forward_seconds * 1e3,
            "fadiag/backward_ms": last.backward_seconds * 1e3,
            "fadiag/standard_bytes": float(last.standard_bytes),
        }
        if last.ratio is not None:
            out["fadiag/backward_forward_ratio"] = last.ratio
        if last.memory_savings is not None:
            out["fadiag/memory_savings"] = last.memory_savings
        if last.kept_bytes is not None:
            out["fadiag/kept_bytes"] = float(last.kept_bytes)
        raised = Counter(f.rule for s in steps for f in s.flags if not f.cleared)
        out["fadiag/flags"] = float(sum(raised.values()))
        for rule, n in raised.items():
            out[f"fadiag/flags/{rule}"] = float(n)
        return out


__all__ = ["TrainingRun"]


def built_on_first_use(name: str, build: Callable[[], type], namespace: dict[str, Any]
                       ) -> Callable[[str], Any]:
    """A module ``__getattr__`` that builds `name` (a class on a framework's base) when first
    asked for and keeps it in `namespace`, so importing the module imports no framework."""

    def __getattr__(attr: str) -> Any:
        if attr == name:
            namespace[name] = cls = build()
            return cls
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {attr!r}")

    return __getattr__

