"""`fadiag report RUN.jsonl|DIR`: summary, per-site table and PNG plots of a run log."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .. import _args


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report",
        help="summarize a run log and plot it (PNG, optional HTML)",
        description="Summarize a fadiag run log (fadiag-rank<R>.jsonl, or a directory of every "
                    "rank's logs): medians, flags by rule, a per-site table, and PNG plots.",
    )
    p.add_argument("run_log", metavar="RUN", type=_args.existing,
                   help="a fadiag-rank<R>.jsonl file, or the directory holding every rank's file")
    p.add_argument("--out", metavar="DIR", type=_args.output_dir, default=None,
                   help="where the PNGs (and report.html) go (default: <RUN's dir>/fadiag-report)")
    p.add_argument("--html", action="store_true", help="also write report.html with everything inline")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ...jsonl import read_run
    from .summary import format_summary, plot_run, run_logs, summarize_run, write_html

    try:
        logs = run_logs(args.run_log)
    except FileNotFoundError as e:
        print(f"fadiag report: {e}", file=sys.stderr)
        return 1
    source: Path = args.run_log
    out: Path = args.out or (source if source.is_dir() else source.parent) / "fadiag-report"
    sections = []
    try:  # the default --out is beside the run log, which may be read-only
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
            sections.append((summary, plot_run(run_, out, prefix=prefix)))
        if not sections:
            print("fadiag report: no resolved steps to plot", file=sys.stderr)
            return 1
        for _, images in sections:
            for img in images:
                print(f"wrote {img}")
        if args.html:
            print(f"wrote {write_html(out / 'report.html', sections, str(source))}")
    except OSError as e:
        where = e.filename or out
        print(f"fadiag report: {where}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0
