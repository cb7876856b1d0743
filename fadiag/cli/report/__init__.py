"""`fadiag report RUN.jsonl|DIR`: summary, per-site table, flag episodes and PNG plots of a run log.

`summary.py` holds the figures and their text, `plots.py` the PNGs and the HTML page.
"""

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
        description="Summarize a fadiag run log (fadiag-rank<R>.jsonl, plain or gzip-compressed, "
                    "or a directory of every rank's logs): medians, flags by rule, a per-site "
                    "table, each flag episode with its cause, and PNG plots.",
    )
    p.add_argument("run_log", metavar="RUN", type=_args.existing,
                   help="a fadiag-rank<R>.jsonl (or .jsonl.gz) file, or the directory holding "
                        "every rank's file")
    p.add_argument("--out", metavar="DIR", type=_args.output_dir, default=None,
                   help="where the PNGs (and report.html) go (default: <RUN's dir>/fadiag-report)")
    p.add_argument("--html", action="store_true", help="also write report.html with everything inline")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ...errors import RunLogError
    from ...export.jsonl import read_run
    from .plots import plot_run, write_html
    from .summary import format_summary, run_logs, summarize_run

    try:
        logs = run_logs(args.run_log)
        runs = [(log, read_run(log)) for log in logs]
    except (FileNotFoundError, RunLogError) as e:
        print(f"fadiag report: {e}", file=sys.stderr)
        return 1
    source: Path = args.run_log
    out: Path = args.out or (source if source.is_dir() else source.parent) / "fadiag-report"
    summaries = [summarize_run(r) for _, r in runs]
    # The files first, then the text: a reader that stops early (`| head`) must not cost the
    # report its files, and a stdout that fails must not be blamed on the output directory.
    sections = []
    written: list[Path] = []
    try:  # the default --out is beside the run log, which may be read-only
        for (_, run_), summary in zip(runs, summaries, strict=True):
            if run_.steps:
                prefix = f"rank{summary.rank}-" if len(logs) > 1 else ""
                images = plot_run(run_, out, prefix=prefix)
                sections.append((summary, images))
                written += images
        if sections and args.html:
            written.append(write_html(out / "report.html", sections, str(source)))
    except OSError as e:
        print(f"fadiag report: {e.filename or out}: {e.strerror or e}", file=sys.stderr)
        return 1
    for (log, run_), summary in zip(runs, summaries, strict=True):
        print(f"{log}:")
        print(format_summary(summary))
        if run_.bad_lines:
            print(f"  ({run_.bad_lines} unreadable lines skipped)")
        print()
    if not sections:
        print("fadiag report: no resolved steps to plot", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0
