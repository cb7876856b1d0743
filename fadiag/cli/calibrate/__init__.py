"""`fadiag calibrate`: per-impl ratio thresholds for this job's shapes, measured on this machine.

    fadiag calibrate --from runs/fadiag-rank0.jsonl -o calibrated.yaml
    fadiag calibrate --shape 16x32x1024x64 --causal --dtype bfloat16 -o calibrated.yaml
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

import torch

from ...errors import RunLogError
from ...export.jsonl import read_run
from .. import _args
from . import measure

_SHAPE = re.compile(r"(\d+)x(\d+)x(\d+)x(\d+)(?:x(\d+))?")


def shape_spec(text: str) -> tuple[int, int, int, int, int]:
    """BxHxSxD (self-attention) or BxHxSqxSkxD."""
    m = _SHAPE.fullmatch(text.strip())
    if m is None or min(int(g) for g in m.groups() if g) < 1:
        raise argparse.ArgumentTypeError(
            f"expected BxHxSxD or BxHxSqxSkxD of positive integers like 16x32x1024x64, got {text!r}")
    g = [int(x) for x in m.groups() if x]
    return (g[0], g[1], g[2], g[2], g[3]) if len(g) == 4 else (g[0], g[1], g[2], g[3], g[4])


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure this job's backward/forward ratios and write per-impl thresholds",
        description=(
            "Runs each of the job's attention shapes on each of its SDPA backends under fadiag "
            "on this machine and writes rules.backward_forward_ratio.per_impl: per impl, the "
            "largest healthy ratio fadiag measured, as its rule judges it (on a GPU the largest "
            "step; on CPU the lowest of host_window_steps windows' fastest backward over "
            "fastest forward of host_window_steps steps) plus a margin. Shapes come from "
            "a run log (--from) or --shape."),
    )
    p.add_argument("--from", dest="run", type=_args.existing_file, default=None,
                   help="a fadiag-rank<R>.jsonl run log of the job: its shapes, dtypes, masks "
                        "and impls")
    p.add_argument("--shape", type=shape_spec, action="append", default=[],
                   help="BxHxSxD or BxHxSqxSkxD (repeatable); with --dtype, --causal, --backends")
    p.add_argument("--dtype", choices=tuple(measure.DTYPES), default=None,
                   help="for --shape (default float16 on a GPU, float32 on CPU)")
    p.add_argument("--causal", action="store_true", help="for --shape: causal masking")
    p.add_argument("--backends", default=None,
                   help="for --shape: comma-separated impls (default: flash,efficient,cudnn on "
                        "cuda, cpu_flash on cpu)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--steps", type=_args.integer(3), default=20,
                   help="measured steps per shape and impl (default 20)")
    p.add_argument("--margin", type=_args.number_in(0.0, 1.0, like="0.1"), default=0.1,
                   help="added to the healthy maximum, as a fraction (default 0.1)")
    p.add_argument("-o", "--output", type=_args.output_file, required=True,
                   help="YAML configuration to write (fadiag.attach(PATH) loads it)")
    p.set_defaults(func=run)


def _error(argument: str, message: str) -> int:
    print(f"fadiag calibrate: error: argument {argument}: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        return _error("--device", f"no CUDA device is available to torch {torch.__version__}")
    if args.run is None and not args.shape:
        return _error("--from/--shape", "give a run log (--from) or at least one --shape")
    work: dict[tuple[str, measure.Shape], None] = {}
    if args.run is not None:
        try:
            work.update(measure.shapes_from_run(read_run(args.run).steps))
        except RunLogError as e:
            print(f"fadiag calibrate: {e}", file=sys.stderr)
            return 1
        if not work:
            print(f"fadiag calibrate: {args.run} holds no measured attention call",
                  file=sys.stderr)
            return 1
    backends = (tuple(b.strip() for b in args.backends.split(",") if b.strip())
                if args.backends else measure.DEVICE_DEFAULT[device])
    unknown = [b for b in backends if b not in measure.SDPA_BACKENDS]
    if unknown:
        return _error("--backends", f"unknown impl {', '.join(unknown)}; choose from "
                                    f"{', '.join(measure.SDPA_BACKENDS)}")
    dtype = args.dtype or ("float32" if device == "cpu" else "float16")
    for b, h, sq, sk, d in args.shape:
        for impl in backends:
            work[(impl, measure.Shape(batch=b, heads=h, seq_q=sq, seq_k=sk, head_dim=d,
                                      kv_heads=h, dtype=dtype, causal=args.causal))] = None
    results = []
    for impl, shape in work:
        m = measure.measure(impl, shape, device, steps=args.steps)
        results.append(m)
        if m.judged is None:
            print(f"{impl:10s} {shape.text()}: not measured ({m.reason})")
        else:
            print(f"{impl:10s} {shape.text()}: median {statistics.median(m.ratios):.2f}, "
                  f"max {max(m.ratios):.2f}")
    limits = measure.thresholds(results, args.margin)
    if not limits:
        print("fadiag calibrate: no shape could be measured; nothing written", file=sys.stderr)
        return 1
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    header = [f"fadiag calibrate, {time.strftime('%Y-%m-%d')}, {name}, torch {torch.__version__}:",
              f"backward/forward as fadiag measures it, {args.steps} steps per shape after 3; per "
              f"impl the largest ({'median' if device == 'cpu' else 'largest step'}) "
              f"plus {args.margin:.0%}.",
              "fadiag.attach(\"THIS FILE\"), or merge rules.backward_forward_ratio.per_impl into "
              "the job's configuration."]
    try:
        args.output.write_text(measure.config_text(limits, results, header), encoding="utf-8")
    except OSError as e:
        print(f"fadiag calibrate: {args.output}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: " + ", ".join(f"{k} {v:g}" for k, v in limits.items()))
    return 0
