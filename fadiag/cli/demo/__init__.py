"""`fadiag demo`: train a small GPT-style model with fadiag attached and watch every step."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .. import _args


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a small GPT-style model with fadiag attached and show every step",
        description="Train a small GPT-style transformer (causal SDPA, random tokens, AdamW) with "
                    "fadiag attached: a live table per step, /metrics served while it runs, a "
                    "summary at the end. Ctrl-C stops after the current step (exit status 130).",
    )
    p.add_argument("--steps", type=_args.integer(0), default=200,
                   help="optimizer steps to train; 0 trains until Ctrl-C (default 200)")
    p.add_argument("--port", type=_args.port, default=None,
                   help="metrics port; 0 picks a free one (default: fadiag's exporter.port, 9464)")
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu",
                   help="device to train on (default cpu)")
    fault = p.add_mutually_exclusive_group()
    fault.add_argument("--force-math", action="store_true",
                       help="run SDPA on its math backend: the memory_savings flag fires")
    fault.add_argument("--slow-backward", action="store_true",
                       help="use a hand-written attention whose backward does needless work: "
                            "the backward_forward_ratio flag fires")
    fault.add_argument("--compile", action="store_true",
                       help="train the healthy model under torch.compile (its first step compiles: "
                            "seconds to a minute): attention measured by the dispatcher tap, sites "
                            "compiled#0.., as in compiled training")
    p.add_argument("--seq-len", type=_args.integer(1), default=256, help="sequence length (default 256)")
    p.add_argument("--jsonl", metavar="DIR", type=_args.output_dir, default=None,
                   help="write the run log fadiag-rank0.jsonl into DIR, created if missing "
                        "(for fadiag report)")
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    from ...capture.device import available
    from ...errors import FadiagError
    from .training import DemoConfig, run_demo

    if not available(args.device):
        args._parser.error(f"argument --device: {args.device} is not available on this machine")
    problems = _args.config_problems(None)  # the demo attaches with $FADIAG_CONFIG, if set
    if problems:
        args._parser.error(f"the configuration named by FADIAG_CONFIG:\n{problems}")
    cfg = DemoConfig(steps=args.steps, port=args.port, device=args.device,
                     force_math=args.force_math, slow_backward=args.slow_backward,
                     compile=args.compile, seq_len=args.seq_len, jsonl=None if args.jsonl is None else str(args.jsonl))
    try:
        return run_demo(cfg)
    except FadiagError as e:  # e.g. the metrics port is taken and exporter.on_port_in_use: fail
        print(f"fadiag demo: {str(e).removeprefix('fadiag: ')}", file=sys.stderr)
        return 1
