"""`fadiag run [--config F] [--port P] [--jsonl DIR] -- CMD ...`: launch CMD with fadiag attached."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .. import _args


def _config_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text




def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a command with fadiag attached to every training process (no code change)",
        description="Run CMD (python, torchrun, accelerate, ...) with fadiag attached in every "
                    "Python process of it that trains: processes with LOCAL_RANK set, and any "
                    "other process that imports torch except launchers (torchrun, accelerate, "
                    "deepspeed), multiprocessing workers and torch's helper processes. Signals "
                    "are forwarded to CMD; the exit status is CMD's.",
        usage="fadiag run [-h] [--config FILE] [--port PORT] [--jsonl DIR] -- CMD [ARG ...]",
    )
    p.add_argument("--config", metavar="FILE", type=_config_file,
                   help="YAML config for every attached process (FADIAG_CONFIG)")
    p.add_argument("--port", type=_args.port, default=None,
                   help="metrics base port: rank r serves on PORT + LOCAL_RANK; 0 picks free ports "
                        "(default: the config's exporter.port, 9464)")
    p.add_argument("--jsonl", metavar="DIR", type=_args.output_dir, default=None,
                   help="write each rank's run log fadiag-rank<R>.jsonl into DIR (created if missing)")
    p.add_argument("cmd", metavar="CMD", nargs=argparse.REMAINDER,
                   help="the command to run, after --")
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    from .launch import LaunchOptions, launch

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        args._parser.error("the following arguments are required: CMD (the command to run, after --)")
    # Checked here, where a mistake can still be reported before anything starts: every attached
    # process loads the same configuration (--config, else $FADIAG_CONFIG).
    problems = _args.config_problems(args.config)
    if problems:
        where = "argument --config" if args.config else "the configuration named by FADIAG_CONFIG"
        args._parser.error(f"{where}: {problems}")
    jsonl = None if args.jsonl is None else str(args.jsonl)
    return launch(cmd, LaunchOptions(config=args.config, port=args.port, jsonl=jsonl))
