"""`fadiag report`: a run log turned into a summary, per-site table, PNG plots and optional HTML.

Reads what `fadiag.jsonl` writes; knows nothing of torch. Plots use matplotlib's Agg canvas
directly, so no global pyplot state and no display are involved.
"""

from __future__ import annotations

import base64
import html
import os
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import MemoryRuleConfig, RatioRuleConfig
from ...jsonl import Run
from ...records import Figures, Flag, StepReport

RULES = ("backward_forward_ratio", "memory_savings", "regression", "hang")


@dataclass
class SiteRow(Figures):
    """One call site over the whole run."""

    site: str
    impl: str
    shape: tuple[int, ...]
    dtype: str
    calls: int = 0
    steps: int = 0
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    kept_bytes: int | None = 0
    standard_bytes: int = 0
    flags: int = 0


@dataclass
class Summary:
    """A run's headline figures, as `fadiag report` and the demo print them.

    Example::

        s = summarize(session.history())
        print(format_summary(s))
    """

    rank: int
    steps: int
    first_step: int | None
    last_step: int | None
    median_forward_seconds: float | None
    median_backward_seconds: float | None
    median_ratio: float | None
    median_savings: float | None
    max_peak_bytes: int | None
    flags_by_rule: Counter[str] = field(default_factory=Counter)
    sites: list[SiteRow] = field(default_factory=list)
    impls: Counter[str] = field(default_factory=Counter)


def run_logs(path: str | os.PathLike[str]) -> list[Path]:
    """The run log files at path: the file itself, or every rank's file in a directory."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("fadiag-rank*.jsonl"), key=_rank_of)
        if not found:
            raise FileNotFoundError(f"no fadiag-rank*.jsonl files in {p}")
        return found
    if not p.exists():
        raise FileNotFoundError(f"no such file: {p}")
    return [p]


def _rank_of(p: Path) -> int:
    digits = p.name.removeprefix("fadiag-rank").removesuffix(".jsonl")
    return int(digits) if digits.isdigit() else 0


def _median(values: Iterable[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


def summarize(steps: Sequence[StepReport], flags: Sequence[Flag] | None = None,
              rank: int | None = None) -> Summary:
    """Medians over steps, flags by rule (raised, not cleared) and a per-site table.

    ``flags`` defaults to the flags carried by the steps themselves.
    """
    if flags is None:
        flags = [f for s in steps for f in s.flags]
    raised = [f for f in flags if not f.cleared]
    by_rule: Counter[str] = Counter(f.rule for f in raised)
    by_site: Counter[str] = Counter(f.site for f in raised)
    sites: dict[str, SiteRow] = {}
    impls: Counter[str] = Counter()
    for s in steps:
        for c in s.calls:
            if not c.recompute:
                impls[c.impl] += 1
        for ss in s.sites():
            row = sites.get(ss.site)
            if row is None:
                row = sites[ss.site] = SiteRow(ss.site, ss.impl, tuple(ss.shape), ss.dtype)
            row.calls += ss.calls
            row.steps += 1
            row.forward_seconds += ss.forward_seconds
            row.backward_seconds += ss.backward_seconds
            row.standard_bytes += ss.standard_bytes
            if row.kept_bytes is not None:
                row.kept_bytes = None if ss.kept_bytes is None else row.kept_bytes + ss.kept_bytes
            if ss.impl not in row.impl.split("+"):
                row.impl += "+" + ss.impl
    for row in sites.values():
        row.flags = by_site.get(row.site, 0)
    peaks = [s.peak_bytes for s in steps if s.peak_bytes is not None]
    return Summary(
        rank=steps[0].rank if rank is None and steps else (rank or 0),
        steps=len(steps),
        first_step=steps[0].step if steps else None,
        last_step=steps[-1].step if steps else None,
        median_forward_seconds=_median(s.forward_seconds for s in steps),
        median_backward_seconds=_median(s.backward_seconds for s in steps),
        median_ratio=_median(s.ratio for s in steps),
        median_savings=_median(s.memory_savings for s in steps),
        max_peak_bytes=max(peaks) if peaks else None,
        flags_by_rule=by_rule,
        sites=list(sites.values()),
        impls=impls,
    )


def summarize_run(run: Run) -> Summary:
    """`summarize` over a run log; the log's flag events are the record of what was raised."""
    rank = int(run.meta.get("rank", run.steps[0].rank if run.steps else 0))
    return summarize(run.steps, run.flags if run.flags else None, rank=rank)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def site_table(s: Summary) -> list[list[str]]:
    """The per-site table: header row, then one row per site."""
    rows = [["site", "impl", "shape (B,H,Sq,Sk,D)", "dtype", "calls", "fwd ms/step",
             "bwd ms/step", "ratio", "savings", "kept MiB", "standard MiB", "flags"]]
    for r in s.sites:
        n = max(r.steps, 1)
        rows.append([r.site, r.impl, "x".join(str(d) for d in r.shape), r.dtype, str(r.calls),
                     ms(r.forward_seconds / n), ms(r.backward_seconds / n), num(r.ratio),
                     num(r.memory_savings, 3),
                     mib(None if r.kept_bytes is None else r.kept_bytes // n),
                     mib(r.standard_bytes // n), str(r.flags)])
    return rows


def format_summary(s: Summary) -> str:
    """Plain-text summary: headline figures, flags by rule, per-site table."""
    if s.steps == 0:
        return f"rank {s.rank}: no resolved steps"
    lines = [
        f"rank {s.rank}: {s.steps} steps ({s.first_step}..{s.last_step})",
        f"  median forward   {ms(s.median_forward_seconds)} ms",
        f"  median backward  {ms(s.median_backward_seconds)} ms",
        f"  median ratio     {num(s.median_ratio)}  (backward / forward)",
        f"  median savings   {num(s.median_savings, 3)}  (1 - kept / standard)",
        f"  peak attention   {mib(s.max_peak_bytes)} MiB",
        "  impls            " + (", ".join(f"{k} ({v} calls)" for k, v in s.impls.most_common())
                                 or "-"),
        "  flags            " + (", ".join(f"{k}: {v}" for k, v in sorted(s.flags_by_rule.items()))
                                 or "none"),
    ]
    if s.sites:
        lines.append("")
        lines.extend(_aligned(site_table(s), indent="  "))
    return "\n".join(lines)


def _aligned(rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append(indent + "  ".join(cells).rstrip())
    return out


def thresholds(run: Run) -> dict[str, float]:
    """Rule thresholds as the run used them: from its flags, its logged config, else defaults."""
    found = {"backward_forward_ratio": RatioRuleConfig().threshold,
             "memory_savings": MemoryRuleConfig().threshold}
    rules = run.meta.get("config", {}).get("rules", {}) if isinstance(run.meta.get("config"), dict) else {}
    for rule in found:
        value = rules.get(rule, {}).get("threshold") if isinstance(rules.get(rule), dict) else None
        if isinstance(value, (int, float)):
            found[rule] = float(value)
    for f in run.flags or [f for s in run.steps for f in s.flags]:
        if f.rule in found and not f.cleared:
            found[f.rule] = f.threshold
    return found


def plot_run(run: Run, out_dir: str | os.PathLike[str], prefix: str = "") -> list[Path]:
    """Write the five PNGs for one rank's run; returns their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = run.steps
    x = [s.step for s in steps]
    nan = float("nan")
    limits = thresholds(run)
    paths: list[Path] = []

    def figure(title: str, ylabel: str) -> tuple[Any, Any]:
        fig = Figure(figsize=(9, 3.6), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        return fig, ax

    def save(fig: Any, name: str) -> None:
        path = out / f"{prefix}{name}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)

    fig, ax = figure("Attention time per step", "ms")
    ax.plot(x, [s.forward_seconds * 1e3 for s in steps], label="forward", marker=".")
    ax.plot(x, [s.backward_seconds * 1e3 for s in steps], label="backward", marker=".")
    ax.legend()
    save(fig, "times")

    fig, ax = figure("Backward / forward ratio", "ratio")
    ax.plot(x, [nan if s.ratio is None else s.ratio for s in steps], label="ratio", marker=".")
    ax.axhline(limits["backward_forward_ratio"], color="red", linestyle="--",
               label=f"threshold {limits['backward_forward_ratio']:g}")
    ax.set_ylim(bottom=0)
    ax.legend()
    save(fig, "ratio")

    fig, ax = figure("Memory savings (1 - kept / standard)", "savings")
    ax.plot(x, [nan if s.memory_savings is None else s.memory_savings for s in steps],
            label="savings", marker=".")
    ax.axhline(limits["memory_savings"], color="red", linestyle="--",
               label=f"threshold {limits['memory_savings']:g}")
    lowest = min((s.memory_savings for s in steps if s.memory_savings is not None), default=0.0)
    ax.set_ylim(min(0.0, lowest) - 0.05, 1.05)
    ax.legend()
    save(fig, "savings")

    fig, ax = figure("Attention memory per step", "MiB")
    for label, values in (
        ("kept", [s.kept_bytes for s in steps]),
        ("standard", [s.standard_bytes for s in steps]),
        ("attention peak", [s.peak_bytes for s in steps]),
        ("step peak", [s.step_peak_bytes for s in steps]),
    ):
        if any(v is not None for v in values):
            ax.plot(x, [nan if v is None else v / 2**20 for v in values], label=label, marker=".")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    save(fig, "memory")

    fig, ax = figure("Flags raised", "rule")
    flags = run.flags or [f for s in steps for f in s.flags]
    ax.set_yticks(range(len(RULES)), list(RULES))
    ax.set_ylim(-0.5, len(RULES) - 0.5)
    for i, rule in enumerate(RULES):
        hits = [f.step for f in flags if f.rule == rule and not f.cleared]
        if hits:
            ax.scatter(hits, [i] * len(hits), marker="|", s=200)
    if x:
        ax.set_xlim(min(x) - 0.5, max(x) + 0.5)
    save(fig, "flags")
    return paths


def write_html(path: str | os.PathLike[str], sections: Sequence[tuple[Summary, Sequence[Path]]],
               source: str) -> Path:
    """One self-contained page: per rank, the summary, the per-site table and the PNGs inline."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>fadiag report: {html.escape(source)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "td:nth-child(-n+4),th{text-align:left}img{display:block;margin:1em 0}</style>",
        f"</head><body><h1>fadiag report</h1><p>{html.escape(source)}</p>",
    ]
    for summary, images in sections:
        parts.append(f"<h2>rank {summary.rank}</h2><pre>{html.escape(_headline(summary))}</pre>")
        rows = site_table(summary)
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in rows[0]) + "</tr>")
        for r in rows[1:]:
            parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
        parts.append("</table>")
        for img in images:
            data = base64.b64encode(Path(img).read_bytes()).decode("ascii")
            parts.append(f"<img alt='{html.escape(Path(img).stem)}' "
                         f"src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    out = Path(path)
    out.write_text("\n".join(parts), encoding="utf-8")
    return out


def _headline(s: Summary) -> str:
    return format_summary(s).split("\n\n")[0]
