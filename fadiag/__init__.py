"""fadiag: always-on diagnostics for attention in PyTorch training.

    import fadiag
    session = fadiag.attach()          # every attention call measured, rules checked, /metrics served
    ...train...
    session.flush()                    # steps resolve off the training thread: wait for the last
    print(session.last_step())
"""

from __future__ import annotations

from .config import Config
from .config.loader import load_config
from .errors import ConfigError, FadiagError
from .session import Session, attach, current_session, detach, instrument, step
from .steps.records import CallRecord, Flag, StepReport
from .version import __version__

__all__ = [
    "CallRecord",
    "Config",
    "ConfigError",
    "FadiagError",
    "Flag",
    "Session",
    "StepReport",
    "__version__",
    "attach",
    "current_session",
    "detach",
    "instrument",
    "load_config",
    "step",
]

# `fadiag run` found this package half imported when torch finished importing (the program
# imports fadiag before torch): it left its attach here, to run now that the package is whole.
_attach_when_imported = globals().pop("_attach_when_imported", None)
if _attach_when_imported is not None:
    _attach_when_imported()
del _attach_when_imported
