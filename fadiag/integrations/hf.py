"""`FadiagCallback` for the HF transformers Trainer; transformers is imported on first use only.

    from fadiag.integrations.hf import FadiagCallback
    trainer = Trainer(..., callbacks=[FadiagCallback(port=0)])

Training begins: attach (unless fadiag is attached already). Each log: fadiag's figures for the
newest resolved step and the flags raised since the previous log go into ``logs`` (callbacks
after this one, and ``state.log_history``, see them); they trail the Trainer by the steps still
being resolved on fadiag's thread. Training ends: the last steps' figures are appended to
``state.log_history``, then detach, only if this callback attached. Steps are delimited by
fadiag's optimizer hook, so nothing happens per step.
"""

from __future__ import annotations

import logging
from typing import Any

from . import TrainingRun, built_on_first_use

log = logging.getLogger("fadiag")


def _build() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        raise ImportError(
            "fadiag.integrations.hf.FadiagCallback needs transformers: pip install transformers"
        ) from e

    class FadiagCallback(TrainerCallback):  # type: ignore[misc, valid-type]
        """Attach fadiag for the Trainer's run and put its figures into the Trainer's logs."""

        def __init__(self, config: Any = None, **overrides: Any):
            self.run = TrainingRun(config, overrides)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.run.start()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if logs is None:
                return
            figures = self.run.metrics()
            logs.update(figures)
            history = getattr(state, "log_history", None)
            if figures and history and history[-1].get("step") == getattr(state, "global_step", None):
                history[-1].update(figures)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # Figures trail the Trainer by the steps still resolving; the last ones go into the
            # log history here, as a final entry of their own.
            try:
                figures = self.run.finish()
                history = getattr(state, "log_history", None)
                if figures and history is not None:
                    history.append({"step": getattr(state, "global_step", None), **figures})
            except Exception as e:  # the end of a training run must not fail because of fadiag
                log.warning("fadiag: could not log the last steps' figures (%r)", e)
            self.run.stop()

    return FadiagCallback


__getattr__ = built_on_first_use("FadiagCallback", _build, globals())


__all__ = ["FadiagCallback"]  # noqa: F822 - built on first access, by __getattr__
