"""The data fadiag produces: one CallRecord per attention call, one StepReport per step, Flags.

Plain dataclasses with no torch in them, so sinks, rules and the CLI can use them anywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

Shape = tuple[int, int, int, int, int]
"""(B, H, Sq, Sk, D): batch, query heads, query length, key length, head dim."""
HOST_BOUND_SHARE = 0.05
"""A device window is host-bound when the host time it may hold is over this share of it."""


def windows_host_bound(forward: float, backward: float, forward_host: float,
                       backward_host: float) -> bool:
    """Whether a call's forward or backward window (seconds) may hold more host time than
    HOST_BOUND_SHARE of it (CallRecord.host_bound; a counted step's calls, steps/counting.py)."""
    return forward_host > HOST_BOUND_SHARE * forward or backward_host > HOST_BOUND_SHARE * backward


class Figures:
    """The two derived figures of anything with forward/backward seconds and kept/standard bytes
    (a call, a site, a step, a site over a run): the same definition everywhere (DESIGN.md)."""

    __slots__ = ()

    @property
    def ratio(self) -> float | None:
        return ratio(self.backward_seconds, self.ratio_forward_seconds)  # type: ignore[attr-defined]

    @property
    def ratio_forward_seconds(self) -> float:
        """The forward time the ratio divides by: the forward's own (overridden where the same
        kernel was also timed in a checkpointed recomputation)."""
        return self.forward_seconds  # type: ignore[attr-defined,no-any-return]

    @property
    def memory_savings(self) -> float | None:
        return savings(self.kept_bytes, self.standard_bytes)  # type: ignore[attr-defined]


@dataclass(slots=True)
class CallRecord(Figures):
    """One attention call, measured.

    Times are device seconds (CUDA/NPU events, or the host clock on CPU); bytes are device bytes.
    ``backward_seconds`` is 0.0 for a call whose backward never ran (no grad, or not yet).
    """

    site: str
    impl: str
    shape: Shape
    dtype: str
    causal: bool
    dropout: float = 0.0
    kv_heads: int = 0
    layout: str = "BHSD"
    device: str = "cpu"
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    kept_bytes: int | None = None
    standard_bytes: int = 0
    peak_bytes: int | None = None
    recompute: bool = False
    interceptor: str = "sdpa"
    fallback_reason: str | None = None
    probe: bool = False
    """The call its signature was learned on: its forward also counted saved bytes and read the
    allocator, and cold caches (kernel plans, autotuning) land in it, so rules do not judge it."""
    forward_only: bool = False
    """No backward to time: no input required grad (or grad was off), so ``backward_seconds``
    is 0 by absence, and nothing is kept for a backward (``kept_bytes`` None)."""
    sparsity: float | None = None
    """flex_attention: the fraction of score blocks its block mask skips (0 without one, about
    0.5 causal), so time per computed block compares across masks; None for other ops."""
    flex: dict[str, Any] | None = None
    """flex_attention: score_mod / block_mask present, enable_gqa, kernel_options."""
    forward_host_seconds: float = 0.0
    backward_host_seconds: float = 0.0
    """The host time the forward / backward window may hold: the device had passed the window's
    start mark when its end mark was taken — it was idle when the window opened, ran dry inside it
    while the host was still queueing the op, or finished the op before the end mark — so up to
    this long (the host's time between the marks). 0: the device had not reached the start when
    the end mark was taken, so every kernel of the window was queued before it got there, and the
    window is device work (CUDA and NPU; 0 on CPU)."""

    @property
    def host_bound(self) -> bool:
        """Whether either window may hold more host time than HOST_BOUND_SHARE of it: its
        seconds then measure the host's launches as much as the kernel (a starved device), and
        the ratio rule does not judge the call."""
        return windows_host_bound(self.forward_seconds, self.backward_seconds,
                                  self.forward_host_seconds, self.backward_host_seconds)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CallRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs["shape"] = tuple(kwargs.get("shape", (0, 0, 0, 0, 0)))
        return cls(**kwargs)


@dataclass
class Flag:
    """A rule that fired: what, how far over its threshold, where, and what to do about it."""

    rule: str
    value: float
    threshold: float
    step: int
    site: str
    message: str
    impl: str = ""
    shape: Shape | None = None
    rank: int = 0
    cleared: bool = False
    severity: str = "warning"
    """info: within the range measured healthy for its impl, shape and device (the kernel, not a
    fault); warning: beyond that range, or none is known; critical: a hang."""
    band: str = ""
    """Ratio flags: the healthy range they were judged against ("cudnn S≈2048 H200: 2.65-3.48x"),
    or "unknown" where none was measured (fadiag.rules.bands)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.shape is not None:
            d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Flag:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if kwargs.get("shape") is not None:
            kwargs["shape"] = tuple(kwargs["shape"])
        return cls(**kwargs)


@dataclass(slots=True)
class SiteSummary(Figures):
    """One call site's totals within a step."""

    site: str
    impl: str
    shape: Shape
    dtype: str
    calls: int
    forward_seconds: float
    backward_seconds: float
    kept_bytes: int | None
    standard_bytes: int
    device: str = ""
    """The timer kind of its calls: "cpu" means host-clock timings."""
    sparsity: float | None = None
    """The mean block-mask sparsity of the site's calls (flex_attention), else None."""
    recompute_forward_seconds: float = 0.0
    recomputes: int = 0
    """Checkpointing: the forward time and number of the site's recomputations."""
    host_bound: int = 0
    """Calls (recomputations included) whose windows may hold host time (CallRecord.host_bound)."""
    device_bound: SiteSummary | None = None
    """Where some calls were host-bound: the site over its other calls, whose windows are device
    work (None if there were none). The ratio is theirs: a starved device's windows measure the
    host's launches as much as the kernel (1.8-4.4x for a 3.3x cuDNN kernel, BENCHMARKS.md)."""

    @property
    def ratio(self) -> float | None:
        if self.host_bound:
            return self.device_bound.ratio if self.device_bound is not None else None
        return ratio(self.backward_seconds, self.ratio_forward_seconds)

    @property
    def ratio_forward_seconds(self) -> float:
        """Under checkpointing every forward of the site runs twice, the same kernel on the same
        tensors' shapes: once in the forward pass and again in the backward. Each window holds
        the kernel and whatever host time the device waited for inside it (a first pass starved
        by checkpointing's own Python reads up to 1.8x the kernel; BENCHMARKS.md), never less,
        so the faster of the two is the ratio's forward."""
        if self.recomputes and self.recompute_forward_seconds > 0.0:
            if not self.calls:  # the first pass's calls left out (host-bound): the recomputation's
                return self.recompute_forward_seconds
            if self.recomputes == self.calls:
                return min(self.forward_seconds, self.recompute_forward_seconds)
        return self.forward_seconds

    @property
    def computed_fraction(self) -> float:
        """The fraction of the score matrix the kernel computes (1 without a block mask)."""
        return 1.0 - (self.sparsity or 0.0)

    @property
    def dense_forward_seconds(self) -> float | None:
        """Forward seconds per computed fraction: what the kernel would take for the dense
        matrix at the same speed, so a 50 %-sparse causal mask does not look 2x fast."""
        c = self.computed_fraction
        return self.forward_seconds / c if c > 0.0 else None


@dataclass
class StepReport(Figures):
    """Everything fadiag knows about one training step, once the device has finished it.

    Example::

        report = session.last_step()
        if report and report.ratio and report.ratio > 3:
            print(report.step, report.sites()[0].impl)
    """

    step: int
    forward_seconds: float
    backward_seconds: float
    kept_bytes: int | None
    standard_bytes: int
    peak_bytes: int | None
    step_peak_bytes: int | None = None
    calls: list[CallRecord] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)
    rank: int = 0
    wall_time: float = 0.0
    recompute_seconds: float = 0.0
    unmeasured: dict[str, int] = field(default_factory=dict)
    """Attention calls of this step that fadiag saw and did not measure, by reason
    (``cuda_graph``: replayed inside a CUDA graph; ``sampling``; ``per_step_cap``; …)."""
    cpu_wait: float | None = None
    """Host-clock steps: the share of their runnable time the process's threads spent waiting for
    a CPU since the previous measured step (0.3: another process held a core a third of the
    time); None where it is not read (device clocks) or not known (no Linux schedstat)."""
    counted_before: int = 0
    """Steps resolved since the previous report and counted without one
    (sampling.reports_per_second): their calls are in the metrics, not in any report."""

    @property
    def attention_seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    @property
    def host_bound_calls(self) -> int:
        """Calls whose device windows may hold host time (CallRecord.host_bound)."""
        return sum(1 for c in self.calls if c.host_bound)

    @property
    def ratio(self) -> float | None:
        """Backward over forward seconds of the step's calls whose windows are device work (all of
        them but host-bound ones: CallRecord.host_bound); None if none was."""
        if not any(c.host_bound for c in self.calls):
            return ratio(self.backward_seconds, self.ratio_forward_seconds)
        sites = summarize([c for c in self.calls if not c.host_bound])
        return ratio(sum(s.backward_seconds for s in sites),
                     sum(s.ratio_forward_seconds for s in sites))

    @property
    def ratio_forward_seconds(self) -> float:
        """The forward time the step's ratio divides by: its sites' (SiteSummary), which differ
        from `forward_seconds` only where checkpointed recomputations ran."""
        if not self.recompute_seconds or not self.calls:
            return self.forward_seconds
        return sum(s.ratio_forward_seconds for s in self.sites())

    def sites(self) -> list[SiteSummary]:
        """Per-site totals, in first-call order."""
        return summarize(self.calls)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rank": self.rank,
            "wall_time": self.wall_time,
            "forward_seconds": self.forward_seconds,
            "backward_seconds": self.backward_seconds,
            "recompute_seconds": self.recompute_seconds,
            "unmeasured": dict(self.unmeasured),
            "cpu_wait": self.cpu_wait,
            "counted_before": self.counted_before,
            "ratio": self.ratio,
            "kept_bytes": self.kept_bytes,
            "standard_bytes": self.standard_bytes,
            "memory_savings": self.memory_savings,
            "peak_bytes": self.peak_bytes,
            "step_peak_bytes": self.step_peak_bytes,
            "calls": [c.to_dict() for c in self.calls],
            "flags": [f.to_dict() for f in self.flags],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepReport:
        return cls(
            step=int(d["step"]),
            forward_seconds=float(d["forward_seconds"]),
            backward_seconds=float(d["backward_seconds"]),
            kept_bytes=d.get("kept_bytes"),
            standard_bytes=int(d.get("standard_bytes", 0)),
            peak_bytes=d.get("peak_bytes"),
            step_peak_bytes=d.get("step_peak_bytes"),
            calls=[CallRecord.from_dict(c) for c in d.get("calls", [])],
            flags=[Flag.from_dict(f) for f in d.get("flags", [])],
            rank=int(d.get("rank", 0)),
            wall_time=float(d.get("wall_time", 0.0)),
            recompute_seconds=float(d.get("recompute_seconds", 0.0)),
            unmeasured={str(k): int(v) for k, v in (d.get("unmeasured") or {}).items()},
            cpu_wait=d.get("cpu_wait"),
            counted_before=int(d.get("counted_before", 0)),
        )


def summarize(calls: list[CallRecord],
              device_bound: list[SiteSummary] | None = None) -> list[SiteSummary]:
    """Per-site totals of `calls`, in first-call order (a recomputation adds its backward, and its
    forward to `recompute_forward_seconds`; a site with host-bound calls also gets its
    `device_bound` summary, which its ratio is). `device_bound`: those summaries where the caller
    already has them (`summarize` of the calls that are not host-bound), not made again."""
    by_site: dict[str, SiteSummary] = {}
    sparsity: dict[str, list[float]] = {}
    host_bound = False
    for c in calls:
        s = by_site.get(c.site)
        if s is None:
            s = by_site[c.site] = SiteSummary(c.site, c.impl, c.shape, c.dtype, 0, 0.0, 0.0, 0, 0,
                                              c.device)
        if c.host_bound:
            s.host_bound += 1
            host_bound = True
        if not c.recompute:
            s.calls += 1
            s.forward_seconds += c.forward_seconds
            s.standard_bytes += c.standard_bytes
            if s.kept_bytes is not None:
                s.kept_bytes = None if c.kept_bytes is None else s.kept_bytes + c.kept_bytes
            if c.sparsity is not None:
                sparsity.setdefault(c.site, []).append(c.sparsity)
        else:
            s.recomputes += 1
            s.recompute_forward_seconds += c.forward_seconds
        s.backward_seconds += c.backward_seconds
    for site, values in sparsity.items():
        by_site[site].sparsity = sum(values) / len(values)
    if host_bound:
        if device_bound is None:
            device_bound = summarize([c for c in calls if not c.host_bound])
        for d in device_bound:
            by_site[d.site].device_bound = d
    return list(by_site.values())


def ratio(backward: float, forward: float) -> float | None:
    """backward / forward, or None when there is no forward time to divide by."""
    if forward <= 0.0 or backward <= 0.0:
        return None
    return backward / forward


def savings(kept: int | None, standard: int) -> float | None:
    """1 - kept / standard, or None when either is unknown."""
    if kept is None or standard <= 0:
        return None
    return 1.0 - kept / standard
