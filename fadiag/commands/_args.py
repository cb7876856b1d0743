"""Argument types shared by the commands: argparse turns their errors into exit code 2 with the
argument's name, e.g. ``argument --steps: expected an integer >= 0, got -1``."""

from __future__ import annotations

import argparse
from collections.abc import Callable


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


def probability(text: str) -> float:
    """A number in [0, 1), as a dropout probability."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 meaning "pick a free one"."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {value}")
    return value
