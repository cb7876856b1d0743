"""`fadiag bench`: training attention (forward + backward) per backend and sequence length.

Prints rich tables; with --out writes bench.csv, bench.json, bench.png (and mha.csv with --mha).
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .. import _args
from .._output import Console
from ..estimate.arithmetic import human_bytes
from . import accelerator, results
from . import measure as bench

GPU_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
CPU_SEQ_LENS = (128, 256, 512, 1024)
RATIO_RULE = 3.0
SAVINGS_RULE = 0.80


def seq_lens(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers like 512,1024, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers like 512,1024, got {text!r}")
    return values


def backend_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [n for n in names if n not in results.BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown backend {', '.join(unknown) or repr(text)}; "
            f"choose from {', '.join(results.BACKENDS)}")
    return names




def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time forward and backward of each attention backend; kept and peak bytes",
        description=(
            "Training attention (forward + backward) per backend and sequence length: median "
            "device time of each, bwd/fwd ratio, TFLOP/s against a measured matmul peak, bytes "
            "kept for backward beyond q/k/v, allocator peak, savings against the standard "
            "(O+S+P) formula, and that formula checked against the math backend."
        ),
    )
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default=None,
                   help="default: npu if torch_npu sees one, else cuda if available, else cpu")
    p.add_argument("--seq-lens", type=seq_lens, default=None,
                   help="comma-separated sequence lengths (default: 512..16384 on GPU/NPU, "
                        "128..1024 on CPU)")
    p.add_argument("--backends", type=backend_list, default=(),
                   help="comma-separated, from: cuda flash,efficient,cudnn,math; cpu "
                        "cpu_flash,math; npu npu_fusion,math (default: all of the device's)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                   help="default float16 on GPU/NPU, float32 on CPU")
    p.add_argument("--batch", type=_args.integer(1), default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=_args.integer(1), default=32, help="heads (default 32)")
    p.add_argument("--head-dim", type=_args.integer(1), default=128, help="head dimension (default 128)")
    p.add_argument("--causal", action="store_true", help="causal masking (FLOPs halved)")
    p.add_argument("--iters", type=_args.integer(1), default=20,
                   help="timed iterations, of which the median is shown (default 20)")
    p.add_argument("--warmup", type=_args.integer(0), default=5,
                   help="untimed iterations first (default 5)")
    p.add_argument("--mha", action="store_true",
                   help="also time nn.MultiheadAttention need_weights=False vs True (fwd+bwd)")
    p.add_argument("--memory-fraction", type=_args.number_in(0.0, 1.0, low_open=True), default=0.9,
                   help="skip the math path where its estimated peak exceeds this fraction "
                        "of free memory (default 0.9)")
    p.add_argument("--out", metavar="DIR", type=_args.output_dir, default=None,
                   help="write bench.csv, bench.json and bench.png into DIR (created if missing)")
    p.set_defaults(func=run)


def _usage_error(argument: str, message: str) -> int:
    print(f"fadiag bench: error: argument {argument}: {message}", file=sys.stderr)
    return 2


def command_line(args: argparse.Namespace, device: str, cfg: results.BenchConfig) -> str:
    """The canonical command that repeats this run, defaults spelled out."""
    argv = ["fadiag", "bench", "--device", device,
            "--seq-lens", ",".join(map(str, cfg.seq_lens)),
            "--backends", ",".join(cfg.backend_list), "--dtype", cfg.dtype,
            "--batch", str(cfg.batch), "--heads", str(cfg.heads), "--head-dim", str(cfg.head_dim),
            "--iters", str(cfg.iters), "--warmup", str(cfg.warmup),
            "--memory-fraction", f"{cfg.memory_fraction:g}"]
    argv += ["--causal"] if cfg.causal else []
    argv += ["--mha"] if cfg.mha else []
    argv += ["--out", str(args.out)] if args.out else []
    return shlex.join(argv)


def run(args: argparse.Namespace) -> int:
    device = args.device or bench.default_device()
    gpu = device != "cpu"
    wrong = [b for b in args.backends if b not in results.DEVICE_BACKENDS[device]]
    if wrong:
        return _usage_error("--backends", f"{', '.join(wrong)} cannot run on {device}; choose "
                                          f"from {', '.join(results.DEVICE_BACKENDS[device])}")
    try:
        cfg = results.BenchConfig(
            device=device,
            seq_lens=args.seq_lens or (GPU_SEQ_LENS if gpu else CPU_SEQ_LENS),
            backends=args.backends,
            dtype=args.dtype or ("float16" if gpu else "float32"),
            batch=args.batch, heads=args.heads, head_dim=args.head_dim, causal=args.causal,
            iters=args.iters, warmup=args.warmup, mha=args.mha,
            memory_fraction=args.memory_fraction,
        )
    except ValueError as e:  # the parser's types already enforce the rest
        return _usage_error("--device", str(e))
    try:
        accelerator.Accelerator.open(device)
    except accelerator.DeviceUnavailableError as e:
        return _usage_error("--device", str(e))

    err = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err) as progress:
        task = progress.add_task("bench", total=bench.total_steps(cfg))
        started = [False]

        def tick(description: str) -> None:
            if started[0]:
                progress.advance(task)
            started[0] = True
            progress.update(task, description=description)

        report = bench.run_bench(cfg, progress=tick)
        progress.update(task, completed=bench.total_steps(cfg), description="done")
    report.environment["command"] = command_line(args, device, cfg)

    # The files first, then the tables: a reader that stops early (`| head`) must not cost
    # the measurements their files.
    written: list[Path] = []
    if args.out:
        try:
            written = write_outputs(report, args.out)
        except OSError as e:  # checked writable at parse time; the disk may still fill up
            err.print(f"fadiag bench: {e.filename or args.out}: {e.strerror or e}", highlight=False)
            return 1
    out = Console()
    if not out.is_terminal:  # logs and CI: full-width tables instead of wrapped columns
        out = Console(width=160)
    out.print(results_table(report))
    if any(r.status != "ok" for r in report.rows):
        out.print(not_measured_table(report))
    if report.formula_checks:
        out.print(formula_table(report))
    if report.mha_rows:
        out.print(mha_table(report))
    for line in report.skipped():
        err.print(f"[yellow]skipped[/] {line}", highlight=False)
    if "math" in cfg.backend_list and not report.formula_checks:
        err.print("[yellow]no formula check[/]: the math backend ran at no sequence length")
    if written:
        err.print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _ms(x: float | None) -> str:
    return "—" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def results_table(report: results.BenchReport) -> Table:
    env, cfg = report.environment, report.config
    table = Table(
        title=(f"{env['device_name']} · torch {env['torch']} · B={cfg.batch} H={cfg.heads} "
               f"D={cfg.head_dim} {cfg.dtype}{' causal' if cfg.causal else ''} · median of "
               f"{cfg.iters} · matmul peak {report.matmul_tflops:.3g} TFLOP/s "
               f"({report.matmul_dtype})"),
        title_justify="left",
    )
    for name in ("S", "backend", "fwd ms", "bwd ms", "bwd/fwd", "TFLOP/s fwd/bwd",
                 "% of peak", "kept", "standard", "savings", "peak"):
        table.add_column(name, justify="left" if name == "backend" else "right")
    for r in report.rows:
        if r.status != "ok":
            table.add_row(str(r.seq_len), r.backend, f"[dim]{r.status}[/]", *[""] * 5,
                          human_bytes(r.standard_bytes), "", "")
            continue
        assert r.ratio is not None and r.memory_savings is not None and r.kept_bytes is not None
        ratio = f"{r.ratio:.2f}"
        savings = f"{r.memory_savings:.3f}"
        table.add_row(
            str(r.seq_len), r.backend, _ms(r.forward_ms), _ms(r.backward_ms),
            f"[red]{ratio}[/]" if r.ratio > RATIO_RULE else ratio,
            f"{r.forward_tflops:.3g} / {r.backward_tflops:.3g}",
            f"{r.forward_pct_of_matmul_peak:.0f} / {r.backward_pct_of_matmul_peak:.0f}",
            human_bytes(r.kept_bytes), human_bytes(r.standard_bytes),
            f"[red]{savings}[/]" if r.memory_savings < SAVINGS_RULE else savings,
            "—" if r.peak_bytes is None else human_bytes(r.peak_bytes),
        )
    table.caption = (f"red: bwd/fwd > {RATIO_RULE:g} or savings < {SAVINGS_RULE:g}. kept = saved "
                     "for backward beyond q, k, v; standard = O + S + P (fadiag.memory)")
    return table


def not_measured_table(report: results.BenchReport) -> Table:
    table = Table(title="not measured", title_justify="left")
    for name in ("S", "backend", "status", "reason"):
        table.add_column(name)
    for r in report.rows:
        if r.status != "ok":
            table.add_row(str(r.seq_len), r.backend, r.status, r.reason)
    return table


def formula_table(report: results.BenchReport) -> Table:
    table = Table(title="standard-bytes formula vs the math backend's kept bytes",
                  title_justify="left")
    for name in ("S", "math kept", "formula O+S+P", "kept/formula", "one [B,H,S,S]"):
        table.add_column(name, justify="right")
    for c in report.formula_checks:
        table.add_row(str(c.seq_len), human_bytes(c.math_kept_bytes),
                      human_bytes(c.standard_bytes), f"{c.ratio:.3f}",
                      human_bytes(c.matrix_bytes))
    return table


def mha_table(report: results.BenchReport) -> Table:
    cfg = report.config
    table = Table(title=(f"nn.MultiheadAttention, embed {cfg.heads * cfg.head_dim}, {cfg.heads} "
                         f"heads, B={cfg.batch}, fwd+bwd ms: need_weights=False (flash) vs "
                         "True (standard)"), title_justify="left")
    for name in ("S", "flash ms", "standard ms", "flash/standard"):
        table.add_column(name, justify="right")
    for m in report.mha_rows:
        ratio = "—" if m.flash_over_standard is None else f"{m.flash_over_standard:.2f}"
        note = f" [dim]{m.status}: {m.reason}[/]" if m.status != "ok" else ""
        table.add_row(str(m.seq_len), _ms(m.flash_ms), _ms(m.standard_ms) + note, ratio)
    return table


def write_outputs(report: results.BenchReport, directory: Path) -> list[Path]:
    """bench.csv, bench.json, bench.png (and mha.csv) under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "bench.csv", directory / "bench.json", directory / "bench.png"]
    device = report.environment["device_name"]
    _write_csv(paths[0], ["device", *(f.name for f in fields(results.BackendRow))],
               [{"device": device, **asdict(r)} for r in report.rows])
    paths[1].write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    plot(report, paths[2])
    if report.mha_rows:
        paths.append(directory / "mha.csv")
        _write_csv(paths[-1], ["device", *(f.name for f in fields(results.MhaRow))],
                   [{"device": device, **asdict(m)} for m in report.mha_rows])
    return paths


def _write_csv(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def plot(report: results.BenchReport, path: Path) -> None:
    """fwd/bwd ms, bwd/fwd and savings against S per backend (+ MHA flash/standard)."""
    from matplotlib.figure import Figure  # Agg via savefig; no pyplot, no global backend

    panels = 4 if report.mha_rows else 3
    fig = Figure(figsize=(5 * panels, 4.2), layout="constrained")
    axes = fig.subplots(1, panels)
    for backend in dict.fromkeys(r.backend for r in report.rows):
        ok = [r for r in report.rows if r.backend == backend and r.status == "ok"]
        if not ok:
            continue
        s = [r.seq_len for r in ok]
        line = axes[0].plot(s, [r.forward_ms for r in ok], "o-", label=f"{backend} fwd")[0]
        axes[0].plot(s, [r.backward_ms for r in ok], "s--", color=line.get_color(),
                     label=f"{backend} bwd")
        axes[1].plot(s, [r.ratio for r in ok], "o-", color=line.get_color(), label=backend)
        axes[2].plot(s, [r.memory_savings for r in ok], "o-", color=line.get_color(),
                     label=backend)
    axes[0].set(title="time per call", ylabel="ms (median)", yscale="log")
    axes[1].axhline(RATIO_RULE, color="red", linestyle=":", label=f"{RATIO_RULE:g}x rule")
    axes[1].set(title="backward / forward", ylabel="ratio")
    axes[2].axhline(SAVINGS_RULE, color="red", linestyle=":", label=f"{SAVINGS_RULE:g} rule")
    axes[2].set(title="memory savings vs O+S+P", ylabel="1 - kept/standard")
    if report.mha_rows:
        mha = [m for m in report.mha_rows if m.flash_over_standard is not None]
        axes[3].plot([m.seq_len for m in mha], [m.flash_over_standard for m in mha], "o-",
                     label="flash / standard")
        axes[3].axhline(1.0, color="grey", linestyle=":")
        axes[3].set(title="nn.MultiheadAttention fwd+bwd", ylabel="flash / standard time")
    ticks = sorted({r.seq_len for r in report.rows})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("sequence length S")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    env = report.environment
    fig.suptitle(f"{env['device_name']} · torch {env['torch']} · {report.config.dtype} · "
                 f"B={report.config.batch} H={report.config.heads} D={report.config.head_dim}")
    fig.savefig(path, dpi=110)
