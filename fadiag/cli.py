"""The `fadiag` command line: one subcommand per module in `fadiag.commands`.

Each command module exposes ``add_parser(subparsers)`` and ``run(args) -> int``; argparse
reports bad arguments with exit code 2 and the argument's name.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
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
    # `fadiag report RUN -v` as well as `fadiag -v report RUN`; not after `run`, where everything
    # belongs to CMD.
    todo = [c for c in sub.choices.values() if c.prog != "fadiag run"]
    while todo:
        command = todo.pop()
        # SUPPRESS: a subcommand's default must not overwrite a -v given before it.
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log at DEBUG level")
        for action in command._actions:  # nested verbs: `fadiag baseline show FILE -v`
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # The reader went away (`fadiag report RUN | head`): stop quietly, as a killed pipe
        # writer would, and keep Python from complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
