"""Argument types shared by the commands: argparse turns their errors into exit code 2 with the
argument's name, e.g. ``argument --steps: expected an integer >= 0, got -1``."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path


def integer(minimum: int) -> Callable[[str], int]:
    """An int of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def number_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False,
              like: str | None = None) -> Callable[[str], float]:
    """A float in the interval from `low` to `high`, each end closed unless said open, e.g.
    ``expected a number in (0, 1], got '2'``."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    hint = f" like {like}" if like else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        inside = ((low < value if low_open else low <= value)
                  and (value < high if high_open else value <= high))
        if not inside:
            raise argparse.ArgumentTypeError(f"expected a number in {interval}{hint}, got {text!r}")
        return value

    return parse


probability = number_in(0.0, 1.0, high_open=True)
"""A number in [0, 1), as a dropout probability."""


def port(text: str) -> int:
    """A TCP port, 0 meaning "pick a free one"."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {value}")
    return value


def existing(text: str) -> Path:
    """A file or directory that exists."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text}")
    return path


def existing_file(text: str) -> Path:
    """A file that exists (not a directory)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; expected a file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path


def output_dir(text: str) -> Path:
    """A directory to write into, created now if missing: a path that cannot take the output is
    an argument error before the work, not a traceback after it."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory") from None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot create directory {text}: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"directory {text} is not writable")
    return path


def output_file(text: str) -> Path:
    """A file to write, in a directory that exists and is writable."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; expected a file name")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"directory {parent} is not writable")
    return path


def config_problems(path: str | None) -> str | None:
    """Every problem in the configuration a command's processes will load (`path`, else
    $FADIAG_CONFIG, else the defaults), one per line; None when it loads."""
    from ..config.loader import config_issues

    issues = config_issues(path)
    return "\n".join(issue.describe() for issue in issues) or None
