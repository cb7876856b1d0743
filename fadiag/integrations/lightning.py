"""`FadiagCallback` for PyTorch Lightning (`lightning.pytorch` or `pytorch_lightning`), built on
first use so importing fadiag never imports Lightning.

    from fadiag.integrations.lightning import FadiagCallback
    trainer = L.Trainer(callbacks=[FadiagCallback(port=0)])

Training starts: attach (unless fadiag is attached already). After each batch whose step has
resolved: ``fadiag/*`` figures go to the LightningModule's loggers. They trail the Trainer by the
steps still being resolved on fadiag's thread, so at the end of training the last steps are
waited for and their figures go straight to the Trainer's loggers (``self.log`` is not allowed
there), at the Trainer's last step. Training ends (or fails): detach, only if this callback
attached.
"""

from __future__ import annotations

import logging
from typing import Any

from . import TrainingRun, built_on_first_use

log = logging.getLogger("fadiag")


def _callback_base() -> type:
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback  # type: ignore[assignment]  # the older name
        except ImportError as e:
            raise ImportError(
                "fadiag.integrations.lightning.FadiagCallback needs Lightning: "
                "pip install lightning (or pytorch_lightning)"
            ) from e
    return Callback  # type: ignore[no-any-return]


def _build() -> type:
    base = _callback_base()

    class FadiagCallback(base):  # type: ignore[misc, valid-type]
        """Attach fadiag for the Trainer's fit and log its figures through the module's loggers."""

        def __init__(self, config: Any = None, **overrides: Any):
            super().__init__()
            self.run = TrainingRun(config, overrides)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.run.start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            figures = self.run.metrics()
            if figures:
                pl_module.log_dict(figures, on_step=True, on_epoch=False, prog_bar=False,
                                   logger=True)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            try:
                figures = self.run.finish()
                if figures:
                    for logger in trainer.loggers:
                        logger.log_metrics(figures, step=trainer.global_step)
            except Exception as e:  # the end of a training run must not fail because of fadiag
                log.warning("fadiag: could not log the last steps' figures (%r)", e)
            self.run.stop()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self.run.stop()

    return FadiagCallback


__getattr__ = built_on_first_use("FadiagCallback", _build, globals())


__all__ = ["FadiagCallback"]  # noqa: F822 - built on first access, by __getattr__
