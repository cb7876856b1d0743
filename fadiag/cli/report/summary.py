"""A run's summary: medians over steps, a per-site table, and each flag episode with its cause.

Reads what `fadiag.export.jsonl` writes (or a live session's history); knows nothing of torch. The
demo prints the same summary at its end.
"""

from __future__ import annotations

import os
import statistics
import textwrap
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...export.jsonl import Run
from ...rules.engine import TOTAL
from ...steps.records import Flag, SiteSummary, StepReport

EPISODES_SHOWN = 20
"""Episodes the text summary lists; the HTML page lists every one."""


@dataclass
class SiteRow:
    """One call site over the whole run: its figure in each step it ran in, and their medians.

    Medians, like the summary's, so a first step that pays for warm-up does not weigh on them.
    """

    site: str
    impl: str
    shape: tuple[int, ...]
    dtype: str
    calls: int = 0
    per_step: list[SiteSummary] = field(default_factory=list)
    flags: int = 0
    """Flag episodes this site was part of (a step-total flag counts for every site that was
    past the rule's threshold in the step it was raised)."""
    host_bound: int = 0
    """Its calls whose windows may hold host time: not in its ratio (SiteSummary.device_bound)."""

    @property
    def steps(self) -> int:
        return len(self.per_step)

    @property
    def forward_seconds(self) -> float | None:
        return _median(s.forward_seconds for s in self.per_step)

    @property
    def backward_seconds(self) -> float | None:
        return _median(s.backward_seconds for s in self.per_step)

    @property
    def ratio(self) -> float | None:
        return _median(s.ratio for s in self.per_step)

    @property
    def memory_savings(self) -> float | None:
        return _median(s.memory_savings for s in self.per_step)

    @property
    def kept_bytes(self) -> float | None:
        kept = [s.kept_bytes for s in self.per_step]
        return None if not kept or None in kept else statistics.median(kept)  # type: ignore[type-var]

    @property
    def standard_bytes(self) -> float | None:
        return _median(s.standard_bytes for s in self.per_step)

    @property
    def sparsity(self) -> float | None:
        """flex_attention: the block mask's sparsity (fraction of blocks skipped), else None."""
        return _median(s.sparsity for s in self.per_step)

    @property
    def dense_forward_seconds(self) -> float | None:
        """Forward seconds per computed fraction of the score matrix (see SiteSummary)."""
        return _median(s.dense_forward_seconds for s in self.per_step if s.sparsity is not None)


@dataclass
class Episode:
    """One flag episode: raised once, open until the rule has been calm for a few steps."""

    flag: Flag
    """The flag as raised: rule, value, threshold, site, message (and severity, where rules set one)."""
    sites: list[str]
    """The call sites involved: the flag's own site, or for a step-total flag the sites past the
    threshold in the step it was raised (empty when the step is not in the log)."""
    total_sites: int
    """Sites in that step, to read `sites` against."""
    cleared_at: int | None = None
    """The step it cleared at; None when it had not (or, see `tracked`, is not known to have)."""
    tracked: bool = True
    """Whether clearings were recorded (a run log, a session's flags) rather than only the
    raised flags steps carry, so that no `cleared_at` means still open at the end."""


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
    episodes: list[Episode] = field(default_factory=list)
    unmeasured: Counter[str] = field(default_factory=Counter)
    """Attention calls seen and not measured, by reason, over the steps (StepReport.unmeasured)."""
    host_bound_calls: int = 0
    """Measured calls whose windows may hold host time (a starved device): not in any ratio."""
    measured_calls: int = 0
    counted_steps: int = 0
    """Steps resolved and counted without a report (sampling.reports_per_second): in the
    metrics, not in these figures."""


def run_logs(path: str | os.PathLike[str]) -> list[Path]:
    """The run log files at path: the file itself, or every rank's file in a directory
    (``fadiag-rank<R>.jsonl``, or gzip-compressed, ``.jsonl.gz``)."""
    p = Path(path)
    if p.is_dir():
        found = sorted([*p.glob("fadiag-rank*.jsonl"), *p.glob("fadiag-rank*.jsonl.gz")],
                       key=lambda f: (_rank_of(f), f.name))
        if not found:
            raise FileNotFoundError(f"no fadiag-rank*.jsonl (or .jsonl.gz) files in {p}")
        return found
    if not p.exists():
        raise FileNotFoundError(f"no such file: {p}")
    return [p]


def _rank_of(p: Path) -> int:
    digits = p.name.removeprefix("fadiag-rank").removesuffix(".gz").removesuffix(".jsonl")
    return int(digits) if digits.isdigit() else 0


def _median(values: Iterable[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


def summarize(steps: Sequence[StepReport], flags: Sequence[Flag] | None = None,
              rank: int | None = None) -> Summary:
    """Medians over steps, flags by rule (raised, not cleared), a per-site table, episodes.

    ``flags``: every flag raised and cleared (a run log's flag events, or a session's
    ``on_flag`` callback); default: the raised flags the steps carry, which say nothing of
    when an episode cleared.
    """
    tracked = flags is not None
    if flags is None:
        flags = [f for s in steps for f in s.flags]
    by_rule: Counter[str] = Counter(f.rule for f in flags if not f.cleared)
    sites: dict[str, SiteRow] = {}
    impls: Counter[str] = Counter()
    unmeasured: Counter[str] = Counter()
    for s in steps:
        unmeasured.update(s.unmeasured)
        for c in s.calls:
            if not c.recompute:
                impls[c.impl] += 1
        for ss in s.sites():
            row = sites.get(ss.site)
            if row is None:
                row = sites[ss.site] = SiteRow(ss.site, ss.impl, tuple(ss.shape), ss.dtype)
            row.calls += ss.calls
            row.host_bound += ss.host_bound
            row.per_step.append(ss)
            if ss.impl not in row.impl.split("+"):
                row.impl += "+" + ss.impl
    found = episodes(steps, flags, tracked)
    for e in found:
        for site in e.sites:
            if site in sites:
                sites[site].flags += 1
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
        episodes=found,
        unmeasured=unmeasured,
        host_bound_calls=sum(s.host_bound_calls for s in steps),
        measured_calls=sum(len(s.calls) for s in steps),
        counted_steps=sum(s.counted_before for s in steps),
    )


def episodes(steps: Sequence[StepReport], flags: Sequence[Flag],
             tracked: bool = True) -> list[Episode]:
    """Each raised flag with the sites it involved and the step it cleared at, in order."""
    by_step = {s.step: s for s in steps}
    out: list[Episode] = []
    open_: dict[tuple[str, str], Episode] = {}
    for f in flags:
        key = (f.rule, f.site)
        if f.cleared:
            e = open_.pop(key, None)
            if e is not None:
                e.cleared_at = f.step
            continue
        step = by_step.get(f.step)
        step_sites = step.sites() if step is not None else []
        involved = ([f.site] if f.site != TOTAL
                    else [s.site for s in step_sites if _past(f, s)])
        e = Episode(flag=f, sites=involved, total_sites=len(step_sites), tracked=tracked)
        open_[key] = e
        out.append(e)
    return out


def _past(flag: Flag, s: SiteSummary) -> bool:
    """Whether a site's own figure was past the threshold of a step-total flag."""
    if flag.rule == "backward_forward_ratio":
        return s.ratio is not None and s.ratio > flag.threshold
    if flag.rule == "memory_savings":
        return s.memory_savings is not None and s.memory_savings < flag.threshold
    return False  # regression and hang judge the step as a whole


def summarize_run(run: Run) -> Summary:
    """`summarize` over a run log; the log's flag events are the record of what was raised."""
    rank = int(run.meta.get("rank", run.steps[0].rank if run.steps else 0))
    return summarize(run.steps, run.flags if run.flags else None, rank=rank)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def site_table(s: Summary) -> list[list[str]]:
    """The per-site table: header row, then one row per site (medians over its steps)."""
    rows = [["site", "impl", "shape (B,H,Sq,Sk,D)", "dtype", "calls", "fwd ms", "bwd ms",
             "ratio", "savings", "kept MiB", "standard MiB", "flags"]]
    for r in s.sites:
        ratio = num(r.ratio) if r.ratio is not None or not r.host_bound else "host-bound"
        rows.append([r.site, r.impl, "x".join(str(d) for d in r.shape), r.dtype, str(r.calls),
                     ms(r.forward_seconds), ms(r.backward_seconds), ratio,
                     num(r.memory_savings, 3), mib(r.kept_bytes), mib(r.standard_bytes),
                     str(r.flags)])
    if any(r.sparsity is not None for r in s.sites):
        # Block-sparse flex sites: time per computed block, so a causal mask's half-skipped
        # matrix does not read as a kernel twice as fast (or a dense one as twice as slow).
        rows[0] += ["sparsity", "fwd ms dense"]
        for row, r in zip(rows[1:], s.sites, strict=True):
            row += [num(r.sparsity, 3), ms(r.dense_forward_seconds)]
    return rows


def episode_lines(e: Episode) -> tuple[str, str]:
    """An episode as a heading (rule, severity, steps, sites, value) and its message."""
    f = e.flag
    severity = getattr(f, "severity", None)
    rule = f"{f.rule} [{severity}]" if severity else f.rule
    if e.cleared_at is not None:
        when = f"steps {f.step}..{e.cleared_at} (cleared)"
    elif e.tracked:
        when = f"from step {f.step} (still open at the end)"
    else:
        when = f"from step {f.step}"
    if f.site != TOTAL:
        where = f"site {f.site}"
    elif e.sites:
        names = ", ".join(e.sites[:3]) + (", ..." if len(e.sites) > 3 else "")
        where = f"{len(e.sites)}/{e.total_sites} sites ({names})"
    else:
        where = "the step as a whole"
    value = f"value {f.value:.4g}, threshold {f.threshold:g}"
    return f"{rule}  {when}  {where}  {value}", f.message


def format_summary(s: Summary) -> str:
    """Plain-text summary: headline figures, flags by rule, per-site table, flag episodes."""
    if s.steps == 0:
        return f"rank {s.rank}: no resolved steps"
    unreported = (f"; {s.counted_steps} more counted in the metrics without a report "
                  "(sampling.reports_per_second)" if s.counted_steps else "")
    lines = [
        f"rank {s.rank}: {s.steps} steps ({s.first_step}..{s.last_step}){unreported}",
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
    counted = [(k, v) for k, v in s.unmeasured.most_common() if v]
    if counted:  # attention that ran and is in no figure above
        lines.append("  not measured     " + ", ".join(f"{k} ({v} calls)" for k, v in counted))
    if s.host_bound_calls:
        lines.append(f"  host-bound       {s.host_bound_calls} of {s.measured_calls} calls: the "
                     "device waited for the host inside their windows; not in any ratio")
    if s.sites:
        lines += ["", "  per site, medians over the steps it ran in:"]
        lines.extend(_aligned(site_table(s), indent="  "))
    if s.episodes:
        lines += ["", "  flag episodes:"]
        for e in s.episodes[:EPISODES_SHOWN]:
            heading, message = episode_lines(e)
            lines.append("    " + heading)
            lines.append(textwrap.fill(message, width=100, initial_indent="      ",
                                       subsequent_indent="      "))
        if len(s.episodes) > EPISODES_SHOWN:
            lines.append(f"    ... {len(s.episodes) - EPISODES_SHOWN} more episodes "
                         "(report.html, from --html, lists every one)")
    return "\n".join(lines)


def headline(s: Summary) -> str:
    """The summary's figures without the tables."""
    return format_summary(s).split("\n\n")[0]


def _aligned(rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append(indent + "  ".join(cells).rstrip())
    return out
