"""The `fadiag` command line: one subcommand per module in `fadiag.commands`.

Each command module exposes ``add_parser(subparsers)`` and ``run(args) -> int``; argparse
reports bad arguments with exit code 2 and the argument's name.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from . import __version__

COMMANDS = ("demo", "bench", "estimate", "report", "run", "baseline", "check_config", "doctor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fadiag",
        description="Diagnostics for attention in PyTorch training: time, memory, rules, metrics.",
    )
    parser.add_argument("--version", action="version", version=f"fadiag {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"fadiag.commands.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
