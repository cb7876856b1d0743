"""`fadiag estimate`: what attention keeps for backward in a model, standard versus flash.

Arithmetic only (no torch, no device); `fadiag bench` measures the same quantities.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.table import Table

from .. import _args
from .._output import Console
from .arithmetic import ELEMENT_BYTES, Estimate, ModelShape, estimate, human_bytes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="bytes attention keeps for backward: standard (O+S+P) vs flash (O+logsumexp)",
        description=(
            "Per layer and in total, the bytes standard attention keeps from forward for "
            "backward (O, S and P, plus a dropout mask) against a flash-style kernel "
            "(O and an fp32 logsumexp per query row). q, k and v are shown for context; "
            "every implementation needs them."
        ),
    )
    p.add_argument("--seq-len", type=_args.integer(1), required=True, help="sequence length S")
    p.add_argument("--heads", type=_args.integer(1), required=True, help="query heads H")
    p.add_argument(
        "--kv-heads", type=_args.integer(1), default=None, help="key/value heads (GQA); default H"
    )
    p.add_argument("--head-dim", type=_args.integer(1), required=True, help="head dimension D")
    p.add_argument("--layers", type=_args.integer(1), required=True, help="attention layers L")
    p.add_argument("--batch", type=_args.integer(1), default=1, help="micro-batch size B (default 1)")
    p.add_argument(
        "--dtype", choices=tuple(ELEMENT_BYTES), default="float16", help="compute dtype (default float16)"
    )
    p.add_argument(
        "--dropout", type=_args.probability, default=0.0, help="attention dropout in [0, 1)"
    )
    p.add_argument("--json", action="store_true", help="print machine-readable numbers")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.kv_heads is not None and args.heads % args.kv_heads:
        print(
            f"fadiag estimate: error: argument --kv-heads: must divide --heads "
            f"({args.heads}), got {args.kv_heads}",
            file=sys.stderr,
        )
        return 2
    result = estimate(
        ModelShape(
            seq_len=args.seq_len,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            layers=args.layers,
            batch=args.batch,
            dtype=args.dtype,
            dropout=args.dropout,
        )
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        Console().print(render(result))
    return 0


def render(r: Estimate) -> Table:
    """The rich table `fadiag estimate` prints."""
    s = r.shape
    layers = s.layers
    title = (
        f"Kept for backward: B={s.batch} S={s.seq_len} H={s.heads} KV={r.kv_heads} "
        f"D={s.head_dim} {s.dtype} dropout={s.dropout:g}, {layers} layers"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column("shape")
    table.add_column("per layer", justify="right")
    table.add_column(f"x {layers} layers", justify="right")

    def row(name: str, shape: str, per_layer: int, style: str | None = None) -> None:
        table.add_row(name, shape, human_bytes(per_layer), human_bytes(per_layer * layers),
                      style=style)

    b, h, kv, n, d = s.batch, s.heads, r.kv_heads, s.seq_len, s.head_dim
    row("q (input, not counted)", f"[{b},{h},{n},{d}]", r.q_bytes_per_layer, "dim")
    row("k (input, not counted)", f"[{b},{kv},{n},{d}]", r.k_bytes_per_layer, "dim")
    row("v (input, not counted)", f"[{b},{kv},{n},{d}]", r.v_bytes_per_layer, "dim")
    table.add_section()
    row("S = QKᵀ/√d", f"[{b},{h},{n},{n}]", r.s_matrix_bytes_per_layer)
    row("P = softmax(S)", f"[{b},{h},{n},{n}]", r.s_matrix_bytes_per_layer)
    row("S + P", "", r.s_plus_p_bytes_per_layer)
    if r.dropout_mask_bytes_per_layer:
        row("dropout mask (1 B)", f"[{b},{h},{n},{n}]", r.dropout_mask_bytes_per_layer)
    row("O", f"[{b},{h},{n},{d}]", r.output_bytes_per_layer)
    row("logsumexp (fp32)", f"[{b},{h},{n}]", r.logsumexp_bytes_per_layer)
    table.add_section()
    mask = " + mask" if r.dropout_mask_bytes_per_layer else ""
    rng = " + RNG state" if s.dropout > 0 else ""
    row(f"standard: O + S + P{mask}", "", r.standard_bytes_per_layer, "bold")
    row(f"flash: O + logsumexp{rng}", "", r.flash_bytes_per_layer, "bold")
    row("saved by flash", "", r.standard_bytes_per_layer - r.flash_bytes_per_layer)
    table.add_row("memory savings", "", f"{r.memory_savings:.2%}",
                  f"{r.memory_savings:.2%}", style="bold")
    if r.notes:
        table.caption = "\n".join(r.notes)
        table.caption_justify = "left"
    return table
