"""The `fadiag` command line: one subcommand per module (or folder) in `fadiag.cli`.

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
from typing import Any

from ..version import __version__

COMMANDS = ("demo", "bench", "calibrate", "estimate", "report", "run", "baseline", "check_config",
            "doctor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fadiag",
        description="Diagnostics for attention in PyTorch training: time, memory, rules, metrics.",
    )
    parser.add_argument("--version", action="version", version=f"fadiag {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"fadiag.cli.{name}").add_parser(sub)
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
    stdout = sys.stdout = _WatchedStdout(sys.stdout)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # what is still buffered fails here, where it can be reported
        return status
    except BrokenPipeError:
        # The reader went away (`fadiag report RUN | head`): stop quietly, as a killed pipe
        # writer would, and keep Python from complaining again when it flushes stdout at exit.
        _drop_stdout()
        return 128 + signal.SIGPIPE
    except OSError as e:
        if not stdout.failed:
            raise
        # stdout itself cannot be written (`> /dev/full`): say so, rather than a traceback or
        # an error blamed on whatever file the command was writing at the time.
        _drop_stdout()
        print(f"fadiag {args.command}: cannot write to standard output: {e.strerror or e}",
              file=sys.stderr)
        return 1
    finally:
        sys.stdout = stdout.stream


class _WatchedStdout:
    """sys.stdout, remembering whether a write to it failed: a full disk behind stdout is then
    told apart from one behind a file the command writes."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.failed = False

    def write(self, text: str) -> int:
        try:
            return int(self.stream.write(text))
        except OSError:
            self.failed = True
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError:
            self.failed = True
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _drop_stdout() -> None:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
