"""`fadiag report`'s pictures: five PNGs per rank and a self-contained HTML page.

Plots use matplotlib's Agg canvas directly, so no global pyplot state and no display are involved.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...config import MemoryRuleConfig, RatioRuleConfig
from ...export.jsonl import Run
from .summary import Summary, episode_lines, headline, site_table

RULES = ("backward_forward_ratio", "memory_savings", "regression", "hang")


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


def _figure(title: str, ylabel: str, rows: int = 1) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6 if rows == 1 else 6.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    axes[0].set_title(title)
    for ax in axes:
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig, axes if rows > 1 else axes[0]


def on_cpu(run: Run) -> bool:
    """Whether the run's attention ran on the CPU (where the step figure is the process RSS)."""
    devices = {c.device.split(":")[0] for s in run.steps for c in s.calls}
    return devices == {"cpu"} if devices else str(run.meta.get("device", "")) == "cpu"


def memory_figure(run: Run) -> Any:
    """Attention's bytes on one axis, the step's memory on its own below: the step figure
    (a whole process's RSS on CPU) is hundreds of times larger and would flatten the others."""
    steps = run.steps
    x = [s.step for s in steps]
    nan = float("nan")
    fig, (top, bottom) = _figure("Attention memory per step", "MiB", rows=2)
    for label, values in (
        ("kept for backward", [s.kept_bytes for s in steps]),
        ("standard (O + S + P)", [s.standard_bytes for s in steps]),
        ("attention peak", [s.peak_bytes for s in steps]),
    ):
        if any(v is not None for v in values):
            top.plot(x, [nan if v is None else v / 2**20 for v in values], label=label, marker=".")
    top.set_ylim(bottom=0)
    if top.get_legend_handles_labels()[0]:
        top.legend()
    step_peaks = [s.step_peak_bytes for s in steps]
    label = ("process RSS (CPU; sampled, not a peak)" if on_cpu(run)
             else "allocator peak in the step")
    bottom.set_title(f"Step memory: {label}")
    if any(v is not None for v in step_peaks):
        bottom.plot(x, [nan if v is None else v / 2**20 for v in step_peaks], label=label,
                    marker=".", color="tab:gray")
        bottom.legend()
    bottom.set_ylim(bottom=0)
    return fig


def plot_run(run: Run, out_dir: str | os.PathLike[str], prefix: str = "") -> list[Path]:
    """Write the five PNGs for one rank's run; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = run.steps
    x = [s.step for s in steps]
    nan = float("nan")
    limits = thresholds(run)
    paths: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out / f"{prefix}{name}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)

    fig, ax = _figure("Attention time per step", "ms")
    ax.plot(x, [s.forward_seconds * 1e3 for s in steps], label="forward", marker=".")
    ax.plot(x, [s.backward_seconds * 1e3 for s in steps], label="backward", marker=".")
    ax.legend()
    save(fig, "times")

    fig, ax = _figure("Backward / forward ratio", "ratio")
    ax.plot(x, [nan if s.ratio is None else s.ratio for s in steps], label="ratio", marker=".")
    ax.axhline(limits["backward_forward_ratio"], color="red", linestyle="--",
               label=f"threshold {limits['backward_forward_ratio']:g}")
    ax.set_ylim(bottom=0)
    ax.legend()
    save(fig, "ratio")

    fig, ax = _figure("Memory savings (1 - kept / standard)", "savings")
    ax.plot(x, [nan if s.memory_savings is None else s.memory_savings for s in steps],
            label="savings", marker=".")
    ax.axhline(limits["memory_savings"], color="red", linestyle="--",
               label=f"threshold {limits['memory_savings']:g}")
    lowest = min((s.memory_savings for s in steps if s.memory_savings is not None), default=0.0)
    ax.set_ylim(min(0.0, lowest) - 0.05, 1.05)
    ax.legend()
    save(fig, "savings")

    save(memory_figure(run), "memory")

    fig, ax = _figure("Flags raised", "rule")
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
    """One self-contained page: per rank, the summary, the per-site table, every flag episode
    with its message, and the PNGs inline."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>fadiag report: {html.escape(source)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "td:nth-child(-n+4),th{text-align:left}img{display:block;margin:1em 0}"
        "li{margin:.5em 0}</style>",
        f"</head><body><h1>fadiag report</h1><p>{html.escape(source)}</p>",
    ]
    for summary, images in sections:
        parts.append(f"<h2>rank {summary.rank}</h2><pre>{html.escape(headline(summary))}</pre>")
        rows = site_table(summary)
        parts.append("<p>Per site, medians over the steps it ran in:</p>")
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in rows[0]) + "</tr>")
        for r in rows[1:]:
            parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
        parts.append("</table>")
        if summary.episodes:
            parts.append("<h3>Flag episodes</h3><ul class='episodes'>")
            for e in summary.episodes:
                heading, message = episode_lines(e)
                parts.append(f"<li><b>{html.escape(heading)}</b><br>{html.escape(message)}</li>")
            parts.append("</ul>")
        for img in images:
            data = base64.b64encode(Path(img).read_bytes()).decode("ascii")
            parts.append(f"<img alt='{html.escape(Path(img).stem)}' "
                         f"src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    out = Path(path)
    out.write_text("\n".join(parts), encoding="utf-8")
    return out
