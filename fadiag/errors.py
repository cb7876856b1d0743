"""The exceptions fadiag raises to its users.

Only `attach()`, the CLI and explicit file loaders raise these; the training hot path never does.
"""

from __future__ import annotations


class FadiagError(Exception):
    """Base class of every error fadiag raises on purpose."""


class ConfigError(FadiagError, ValueError):
    """A configuration value or file is wrong; the message names the dotted key and what was expected."""


class BaselineError(FadiagError, ValueError):
    """A baseline file cannot be read or does not match its schema."""


class RunLogError(FadiagError, ValueError):
    """A file given as a run log is neither JSON lines nor gzip-compressed JSON lines."""
