"""`fadiag doctor`: torch build, devices, usable SDPA backends for a shape, optional packages."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .. import _args


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="what this machine can run: torch build, devices, SDPA backends, packages",
        description="Report the torch build, the devices, which SDPA backends torch would accept "
                    "for a given attention shape (and torch's own reasons when not), and which "
                    "optional packages import.",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto",
                   help="device to check SDPA backends on (default: the one training would use)")
    p.add_argument("--batch", type=_args.integer(1), default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=_args.integer(1), default=16, help="query heads (default 16)")
    p.add_argument("--seq-len", type=_args.integer(1), default=2048, help="sequence length (default 2048)")
    p.add_argument("--head-dim", type=_args.integer(1), default=128, help="head dimension (default 128)")
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                   help="compute dtype (default: float32 on cpu, bfloat16 on accelerators)")
    p.add_argument("--dropout", type=_args.probability, default=0.0, help="attention dropout (default 0)")
    p.add_argument("--no-causal", dest="causal", action="store_false",
                   help="check a non-causal call (default: causal)")
    p.add_argument("--build-native", action="store_true",
                   help="build (or load) the native timing marks for this machine's devices and "
                        "report the result; later runs then load them at once")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ...capture.device import default_device_type
    from .checks import Query, diagnose, format_text

    device = default_device_type() if args.device == "auto" else args.device
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    query = Query(device=device, batch=args.batch, heads=args.heads, seq_len=args.seq_len,
                  head_dim=args.head_dim, dtype=dtype, causal=args.causal, dropout=args.dropout)
    report = diagnose(query, build_native=args.build_native)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    # The report is the product; a requested device that is missing is the one failing finding.
    return 1 if "error" in report["sdpa"] else 0
