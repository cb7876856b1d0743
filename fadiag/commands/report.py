"""`fadiag report RUN.jsonl|DIR`: summary, per-site table and PNG plots of a run log."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _existing(text: str) -> Path:
    p = Path(text)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text}")
    return p


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report",
        help="summarize a run log and plot it (PNG, optional HTML)",
        description="Summarize a fadiag run log (fadiag-rank<R>.jsonl, or a directory of every "
                    "rank's logs): medians, flags by rule, a per-site table, and PNG plots.",
    )
    p.add_argument("run_log", metavar="RUN", type=_existing,
                   help="a fadiag-rank<R>.jsonl file, or the directory holding every rank's file")
    p.add_argument("--out", metavar="DIR", type=Path, default=None,
                   help="where the PNGs (and report.html) go (default: <RUN's dir>/fadiag-report)")
    p.add_argument("--html", action="store_true", help="also write report.html with everything inline")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..jsonl import read_run
    from ..report import format_summary, plot_run, run_logs, summarize_run, write_html

    try:
        logs = run_logs(args.run_log)
    except FileNotFoundError as e:
        print(f"fadiag report: {e}")
        return 1
    source: Path = args.run_log
    out: Path = args.out or (source if source.is_dir() else source.parent) / "fadiag-report"
    sections = []
    for log in logs:
        run_ = read_run(log)
        summary = summarize_run(run_)
        print(f"{log}:")
        print(format_summary(summary))
        if run_.bad_lines:
            print(f"  ({run_.bad_lines} unreadable lines skipped)")
        print()
        if not run_.steps:
            continue
        prefix = f"rank{summary.rank}-" if len(logs) > 1 else ""
        images = plot_run(run_, out, prefix=prefix)
        sections.append((summary, images))
    if not sections:
        print("fadiag report: no resolved steps to plot")
        return 1
    for _, images in sections:
        for img in images:
            print(f"wrote {img}")
    if args.html:
        print(f"wrote {write_html(out / 'report.html', sections, str(source))}")
    return 0
