"""The Prometheus side: a custom collector over fadiag's own counters, one per rank.

The collector builds metric families from a snapshot on each scrape; the registry is injected,
never the global one. export/server.py serves it.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ..steps.counting import KeySums, Row
from ..steps.records import Flag, StepReport
from .sinks import Sink

BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
           0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""10 µs to 10 s: a fused kernel at short S up to a whole step of math-path attention."""

RULES = ("backward_forward_ratio", "memory_savings", "regression", "hang")
SEVERITIES = {"backward_forward_ratio": ("info", "warning"), "memory_savings": ("info", "warning"),
              "regression": ("warning",), "hang": ("critical",)}
"""The severities each rule's flags take: the label values of fadiag_flag_active."""
OTHER_SITE = "other"


class Histogram:
    """Classic-bucket counts over BUCKETS, kept by hand so a scrape builds families from a snapshot."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, v)] += 1
        self.sum += v

    def add(self, counts: list[int], total: float) -> None:
        """Another histogram's counts over the same BUCKETS, and its sum."""
        for i, n in enumerate(counts):
            self.counts[i] += n
        self.sum += total

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs, as HistogramMetricFamily.add_metric takes them."""
        out, acc = [], 0
        for bound, n in zip(BUCKETS, self.counts[:-1], strict=True):
            acc += n
            out.append((repr(bound), float(acc)))
        return [*out, ("+Inf", float(acc + self.counts[-1]))]


class Metrics(Sink):
    """fadiag's metrics for one rank: a sink that records, and a collector that reports.

    Example::

        registry = CollectorRegistry()
        metrics = Metrics(rank=0, registry=registry)
        metrics.emit(report)
        registry.get_sample_value("fadiag_steps_total", {"rank": "0"})
    """

    bounds = BUCKETS
    """The histograms' bucket bounds (steps/steady.py's C++ tally sums over them too)."""

    def __init__(self, *, rank: int = 0, registry: CollectorRegistry | None = None,
                 per_site: bool = False, max_sites: int = 128,
                 build_info: dict[str, str] | None = None, run_info: dict[str, str] | None = None,
                 capture_info: Callable[[], dict[str, str]] | None = None):
        self.rank = str(rank)
        self.per_site = per_site
        self.max_sites = max_sites
        self.build_info = build_info or {}
        self.run_info = run_info or {}
        self.capture_info = capture_info
        """What sees attention on this rank, read at each scrape: `tap` (installed, loading, off,
        not loaded, unavailable) and `eager_wrapper` (native, python)."""
        self._lock = threading.Lock()
        self._fwd: dict[tuple[str, ...], Histogram] = {}
        self._bwd: dict[tuple[str, ...], Histogram] = {}
        self._step = Histogram()
        self._sites: set[str] = set()
        self._calls: dict[str, int] = {}
        self._host_bound: dict[str, int] = {}
        self._flags = dict.fromkeys(RULES, 0)
        self._flag_active: dict[str, dict[str, str]] = {r: {} for r in RULES}  # site -> severity
        self._uninstrumented: dict[str, int] = {}
        self._last: StepReport | None = None
        self._steps = 0
        self._unreported = 0
        self.baseline_seconds: float | None = None
        self.regression_ratio: float | None = None
        self.contended_steps: dict[str, int] = {}
        self.oldest_inflight_seconds = 0.0
        self.resolver_cpu_seconds = 0.0
        self.errors = 0
        if registry is not None:
            registry.register(self)

    # ---- sink side (resolver thread) ------------------------------------------------------

    def emit(self, report: StepReport) -> None:
        self._observe([(c.impl, c.site, c.forward_seconds, c.backward_seconds, c.recompute,
                        c.host_bound) for c in report.calls], report)

    def count(self, calls: list[Row]) -> None:
        """A step counted without a report (sampling.reports_per_second): its calls into the
        histograms and counters as `emit` puts a report's, the step into fadiag_steps_total and
        fadiag_steps_unreported_total. The last-step gauges stay the last report's."""
        self._observe(calls, None)

    def merge(self, steps: int, step_counts: list[int], step_sum: float,
              keys: list[KeySums]) -> None:
        """Steps counted in C++ (steps/steady.py), summed there as `count` sums rows: into the
        histograms and counters, fadiag_steps_total and fadiag_steps_unreported_total."""
        with self._lock:
            for impl, site, fwd, fwd_sum, calls, bwd, bwd_sum, host_bound in keys:
                labels = self._labels(impl, site)
                if calls:
                    self._fwd.setdefault(labels, Histogram()).add(fwd, fwd_sum)
                    self._calls[impl] = self._calls.get(impl, 0) + calls
                if host_bound:
                    self._host_bound[impl] = self._host_bound.get(impl, 0) + host_bound
                if any(bwd):
                    self._bwd.setdefault(labels, Histogram()).add(bwd, bwd_sum)
            self._step.add(step_counts, step_sum)
            self._steps += steps
            self._unreported += steps

    def _observe(self, calls: list[Row], report: StepReport | None) -> None:
        forward = backward = 0.0  # the step's attention seconds, summed as a report sums them
        with self._lock:
            for impl, site, f, b, recompute, host_bound in calls:
                labels = self._labels(impl, site)
                if not recompute:
                    h = self._fwd.get(labels)
                    if h is None:
                        h = self._fwd[labels] = Histogram()
                    h.observe(f)
                    self._calls[impl] = self._calls.get(impl, 0) + 1
                    forward += f
                if host_bound:
                    self._host_bound[impl] = self._host_bound.get(impl, 0) + 1
                if b > 0.0:
                    h = self._bwd.get(labels)
                    if h is None:
                        h = self._bwd[labels] = Histogram()
                    h.observe(b)
                backward += b
            self._steps += 1
            if report is None:
                self._step.observe(forward + backward)
                self._unreported += 1
            else:
                self._step.observe(report.attention_seconds)
                self._last = report

    def counts(self) -> tuple[int, int, int]:
        """Steps resolved, attention calls measured and, of those, host-bound ones, so far."""
        with self._lock:
            return self._steps, sum(self._calls.values()), sum(self._host_bound.values())

    def flag(self, flag: Flag) -> None:
        with self._lock:
            if flag.rule not in self._flags:
                return
            if flag.cleared:
                self._flag_active[flag.rule].pop(flag.site, None)
            else:
                self._flags[flag.rule] += 1
                self._flag_active[flag.rule][flag.site] = flag.severity

    def set_uninstrumented(self, reason: str, total: int) -> None:
        with self._lock:
            self._uninstrumented[reason] = total

    def _labels(self, impl: str, site: str) -> tuple[str, ...]:
        """A call's histogram labels: its impl, and its site where series are per site."""
        return (impl, self._site_label(site)) if self.per_site else (impl,)

    def _site_label(self, site: str) -> str:
        if site in self._sites:
            return site
        if len(self._sites) >= self.max_sites:
            return OTHER_SITE
        self._sites.add(site)
        return site

    # ---- collector side (scrape thread) ----------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            fwd = {k: (h.buckets(), h.sum) for k, h in self._fwd.items()}
            bwd = {k: (h.buckets(), h.sum) for k, h in self._bwd.items()}
            step = (self._step.buckets(), self._step.sum)
            calls = dict(self._calls)
            host_bound = dict(self._host_bound)
            flags = dict(self._flags)
            active = {r: set(s.values()) for r, s in self._flag_active.items()}
            unins = dict(self._uninstrumented)
            last = self._last
            steps = self._steps
            unreported = self._unreported
        r = self.rank
        hist_labels = ["rank", "impl"] + (["site"] if self.per_site else [])
        for name, data, what in (("fadiag_attention_forward_seconds", fwd, "forward"),
                                 ("fadiag_attention_backward_seconds", bwd, "backward")):
            h = HistogramMetricFamily(name, f"Device time of one attention call's {what}.",
                                      labels=hist_labels)
            for labels, (buckets, total) in sorted(data.items()):
                h.add_metric([r, *labels], buckets, total)
            yield h
        h = HistogramMetricFamily("fadiag_step_attention_seconds",
                                  "Attention forward + backward device time per step.", labels=["rank"])
        h.add_metric([r], step[0], step[1])
        yield h
        c = CounterMetricFamily("fadiag_steps", "Resolved training steps.", labels=["rank"])
        c.add_metric([r], steps)
        yield c
        c = CounterMetricFamily("fadiag_steps_unreported",
                                "Resolved steps counted without a step report "
                                "(sampling.reports_per_second): their calls are in the "
                                "histograms and counters; the rules, the log and the JSONL "
                                "file did not see them.", labels=["rank"])
        c.add_metric([r], unreported)
        yield c
        c = CounterMetricFamily("fadiag_attention_calls", "Measured attention calls by backend.",
                                labels=["rank", "impl"])
        for impl, n in sorted(calls.items()):
            c.add_metric([r, impl], n)
        yield c
        c = CounterMetricFamily("fadiag_attention_host_bound_calls",
                                "Measured attention calls whose device window may hold host time "
                                "(the device had passed the window's start before its end mark was "
                                "taken, so it may have waited inside it for the host: idle when "
                                "it opened, dry inside it, or done before it closed): their "
                                "seconds are an upper bound, and the ratio rule does not judge "
                                "them. Checkpointing's recomputations count here, not in "
                                "fadiag_attention_calls_total.", labels=["rank", "impl"])
        for impl in sorted(calls.keys() | host_bound.keys()):  # 0: measured, none host-bound
            c.add_metric([r, impl], host_bound.get(impl, 0))
        yield c
        c = CounterMetricFamily("fadiag_attention_uninstrumented_calls",
                                "Attention calls that ran without measurement, by reason.",
                                labels=["rank", "reason"])
        for reason, n in sorted(unins.items()):
            c.add_metric([r, reason], n)
        yield c
        c = CounterMetricFamily("fadiag_flags", "Flags raised (one per episode), by rule.",
                                labels=["rank", "rule"])
        g = GaugeMetricFamily("fadiag_flag_active",
                              "1 while a flag episode of the rule is open, by its severity (info: "
                              "the ratio measured healthy for the kernel; warning: beyond it).",
                              labels=["rank", "rule", "severity"])
        for rule in RULES:
            c.add_metric([r, rule], flags[rule])
            for severity in SEVERITIES[rule]:
                g.add_metric([r, rule, severity], 1.0 if severity in active[rule] else 0.0)
        yield c
        yield g
        c = CounterMetricFamily("fadiag_contended_steps",
                                "Host-clock steps a timing rule did not judge, by rule: the "
                                "process's threads waited for a CPU more than the rule's "
                                "max_cpu_wait of their runnable time (the machine was "
                                "oversubscribed).", labels=["rank", "rule"])
        for rule in ("backward_forward_ratio", "regression"):
            c.add_metric([r, rule], self.contended_steps.get(rule, 0))
        yield c
        c = CounterMetricFamily("fadiag_internal_errors", "Errors inside fadiag (training unaffected).",
                                labels=["rank"])
        c.add_metric([r], self.errors)
        yield c
        c = CounterMetricFamily("fadiag_resolver_cpu_seconds",
                                "CPU time of fadiag's resolver thread (marks to seconds, the "
                                "reports, the rules, the sinks): its own cost beside training; "
                                "over fadiag_steps_total, per step. Where the host is the "
                                "bottleneck (a launch-bound step) it is step time too.",
                                labels=["rank"])
        c.add_metric([r], self.resolver_cpu_seconds)
        yield c
        yield _gauge("fadiag_attention_oldest_inflight_seconds",
                     "Age of the oldest attention call the device has not finished.", r,
                     self.oldest_inflight_seconds)
        if last is not None:
            yield _gauge("fadiag_step_attention_forward_seconds",
                         "Attention forward seconds of the last resolved step.", r, last.forward_seconds)
            yield _gauge("fadiag_step_attention_backward_seconds",
                         "Attention backward seconds of the last resolved step.", r,
                         last.backward_seconds)
            if last.ratio is not None:
                yield _gauge("fadiag_attention_backward_forward_ratio",
                             "Backward / forward attention seconds, last resolved step.", r, last.ratio)
            if last.memory_savings is not None:
                yield _gauge("fadiag_attention_memory_savings_ratio",
                             "1 - kept / standard bytes, last resolved step.", r, last.memory_savings)
            if last.kept_bytes is not None:
                yield _gauge("fadiag_attention_kept_bytes",
                             "Bytes attention keeps for backward (beyond q, k, v), last step.", r,
                             last.kept_bytes)
            yield _gauge("fadiag_attention_standard_bytes",
                         "Bytes standard attention would keep for the same calls, last step.", r,
                         last.standard_bytes)
            if last.peak_bytes is not None:
                yield _gauge("fadiag_attention_peak_bytes",
                             "Largest allocator peak above start of one attention call.", r,
                             last.peak_bytes)
            if last.step_peak_bytes is not None:
                yield _gauge("fadiag_step_peak_memory_bytes",
                             "Memory of the last resolved step: on GPU/NPU the device allocator's "
                             "peak in the step; on CPU the process's resident set size (RSS, "
                             "sampled at most every 0.5 s), which is not a peak.", r,
                             last.step_peak_bytes)
            if last.cpu_wait is not None:
                yield _gauge("fadiag_host_cpu_wait_ratio",
                             "Host-clock runs: the share of their runnable time the process's "
                             "threads spent waiting for a CPU, last resolved step.", r,
                             last.cpu_wait)
            yield _gauge("fadiag_last_step_timestamp_seconds",
                         "Unix time the last resolved step ended.", r, last.wall_time)
        if self.baseline_seconds is not None:
            yield _gauge("fadiag_attention_baseline_seconds",
                         "Regression baseline of attention seconds per step.", r, self.baseline_seconds)
        if self.regression_ratio is not None:
            yield _gauge("fadiag_attention_regression_ratio",
                         "Attention seconds of the last resolved step over its regression baseline "
                         "(the sites and shapes the baseline covers).", r, self.regression_ratio)
        g = GaugeMetricFamily("fadiag_build_info",
                              "Always 1; the labels say which fadiag and torch versions run, on "
                              "which device type.", labels=list(self.build_info))
        g.add_metric(list(self.build_info.values()), 1.0)
        yield g
        g = GaugeMetricFamily("fadiag_run_info",
                              "Always 1; the labels identify this training process: rank, run_id, "
                              "world_size, hostname, device_name.", labels=list(self.run_info))
        g.add_metric(list(self.run_info.values()), 1.0)
        yield g
        capture = self.capture_info() if self.capture_info is not None else None
        if capture:
            g = GaugeMetricFamily(
                "fadiag_capture_info",
                "Always 1; the labels say what sees attention on this rank: tap (the dispatcher "
                "tap, which measures torch.compile'd attention: installed, loading, off, not "
                "loaded, unavailable) and eager_wrapper (native, python).",
                labels=["rank", *capture])
            g.add_metric([self.rank, *capture.values()], 1.0)
            yield g


def _gauge(name: str, doc: str, rank: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["rank"])
    g.add_metric([rank], float(value))
    return g
