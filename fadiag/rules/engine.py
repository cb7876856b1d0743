"""The rules: backward/forward ratio, memory savings, regression against a baseline, hang.

Each rule looks at a resolved StepReport (or the hang age) and says which conditions hold;
episodes.py keeps the episodes: a flag is raised when a condition starts (or grows graver) and
cleared when it ends, so a sink hears of a problem once.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections import deque
from collections.abc import Iterable, Sequence

from ..config import RulesConfig
from ..memory import scores_bytes
from ..steps.records import CallRecord, Flag, SiteSummary, StepReport, ratio, summarize
from .bands import band_for
from .baseline import Baseline
from .episodes import Episodes
from .keyed import TOTAL, bounded
from .messages import band_label, memory_advice, memory_expected, ratio_advice, site_text
from .regression import Regression

log = logging.getLogger("fadiag")
_FORWARD, _BACKWARD = operator.itemgetter(0), operator.itemgetter(1)


def ratio_calls(calls: Iterable[CallRecord]) -> list[CallRecord]:
    """The calls the ratio rule judges: not a signature's probe (cold caches land in it), and not
    host-bound (a starved device's windows measure the host's launches, not the kernel)."""
    return [c for c in calls if not c.probe and not c.host_bound]


def fastest_ratio(window: Sequence[tuple[float, float]]) -> float:
    """The fastest backward over the fastest forward of (forward, backward) seconds: what the
    ratio rule reads from a window of host-clock steps (Rules._judged_ratio)."""
    return min(map(_BACKWARD, window)) / min(map(_FORWARD, window))


def host_judged_ratios(seconds: Sequence[tuple[float, float]], n: int) -> list[float]:
    """What the ratio rule judges at each step of a site's host-clock (forward, backward)
    seconds, once it has enough: the lowest of the last `n` windows' fastest ratios over `n`
    steps each (Rules._judged_ratio step by step, for a whole run at once)."""
    windows = [fastest_ratio(seconds[i - n:i]) for i in range(n, len(seconds) + 1)]
    return [min(windows[i - n:i]) for i in range(n, len(windows) + 1)]


class Rules:
    """Evaluates every rule on each step; remembers which episodes are open.

    Example::

        rules = Rules(RulesConfig(), device="NVIDIA H200")
        for flag in rules.evaluate(report):
            print(flag.severity, flag.message)
    """

    def __init__(self, cfg: RulesConfig, device: str = "cpu", baseline: Baseline | None = None,
                 rank: int = 0):
        self.cfg = cfg
        self.device = device
        self.rank = rank
        self._episodes = Episodes(rank)
        self.active = self._episodes.active
        """Open episodes by (rule, site): the flag that opened each."""
        self.regression = Regression(cfg.regression, device, baseline,
                                     functools.partial(self._contended, "regression"), self._flag,
                                     self.active)
        self._evaluated = 0
        # Per key on the host clock: its last (forward, backward) seconds and the fastest ratios
        # of its last windows, kept and evicted together.
        self._host: dict[object, tuple[deque[tuple[float, float]], deque[float]]] = {}
        self._device: dict[object, deque[float]] = {}  # device-clock ratios, the last 3, per key
        self.contended_steps = {"backward_forward_ratio": 0, "regression": 0}
        """Host-clock steps a timing rule did not judge, by rule: the process's threads waited
        for a CPU more than the rule's max_cpu_wait of their runnable time."""
        self._contended_warned: set[str] = set()
        self.host_bound_calls = 0
        """Calls the ratio rule left unjudged: their device windows may hold host time."""
        self._host_bound_warned = False
        self._last_step = 0

    @property
    def baseline_seconds(self) -> float | None:
        """The baseline the last step was compared with; None for a step without one."""
        return self.regression.baseline_seconds

    @property
    def regression_ratio(self) -> float | None:
        """The last step's attention seconds over that baseline; None for a step without one."""
        return self.regression.regression_ratio

    # ---- step rules ------------------------------------------------------------------------

    def evaluate(self, report: StepReport) -> list[Flag]:
        """Flags raised or cleared by this step (raised ones have cleared=False)."""
        self._last_step = report.step
        self._evaluated += 1
        conditions: dict[tuple[str, str], Flag] = {}
        # Timing rules judge the steady state: not the calls that learned a signature.
        calls = [c for c in report.calls if not c.probe]
        judged = ratio_calls(calls)
        if len(judged) < len(calls):  # host-bound calls: the ratio is judged on the others
            device_sites = summarize(judged)
            steady = summarize(calls, device_sites)
        else:
            device_sites = steady = summarize(calls)
        if self.cfg.backward_forward_ratio.enabled:
            if device_sites is not steady:
                self._host_bound(len(calls) - len(judged), len(calls), report.step)
            conditions.update(self._ratio(report, device_sites))
        if self.cfg.memory_savings.enabled:
            # Memory is judged on every call (a probe's kept bytes are its signature's).
            all_sites = steady if len(calls) == len(report.calls) else report.sites()
            conditions.update(self._memory(report, all_sites))
        if self.cfg.regression.enabled:
            conditions.update(self.regression.judge(report, steady, self._evaluated))
        out = self._episodes.update(conditions, rules=("backward_forward_ratio", "memory_savings",
                                                "regression"), step=report.step)
        report.flags = [f for f in out if not f.cleared]
        return out

    def _judged_ratio(self, key: object, forward: float, backward: float,
                      host: bool) -> float | None:
        """The ratio the rule judges: the step's own, or on host-clock timings the lowest, over
        the key's last `host_window_steps` windows, of the fastest backward over the fastest
        forward of `host_window_steps` steps (None until it has that many windows).

        A preemption only ever adds time, in scheduler slices of milliseconds: beside a busy
        process most of a two-thread kernel's backward calls wait at a barrier for a preempted
        thread (the median of 9 steps read 2.6-4x for a healthy 2x kernel), while some run
        undisturbed. The fastest call is the closest to what the kernel costs (timeit's rule).
        But a neighbour that comes and goes leaves a short forward undisturbed more often than
        the backward, 2.3x longer: one window's fastest ratio read up to 3.44x for a healthy
        2.0-2.4x kernel beside a spinning process, every window for as long as its luckiest
        forward stays in it. A backward that really is slow is slow in every window: the lowest
        of 9 read at most 2.70x healthy, and over 3x in 94-100 % of the judgments of a backward
        1.8x slower (benchmarks/host_ratio.py, BENCHMARKS.md section 8)."""
        value = ratio(backward, forward)
        if value is None:
            return value
        if not host:
            bounded(self._device, key, lambda: deque(maxlen=3)).append(value)
            return value
        n = self.cfg.backward_forward_ratio.host_window_steps
        recent, windows = bounded(self._host, key, lambda: (deque(maxlen=n), deque(maxlen=n)))
        recent.append((forward, backward))
        if len(recent) < n:
            return None
        windows.append(fastest_ratio(recent))
        return min(windows) if len(windows) == n else None

    def _ratio(self, report: StepReport, sites: list[SiteSummary]) -> dict[tuple[str, str], Flag]:
        cfg = self.cfg.backward_forward_ratio
        out: dict[tuple[str, str], Flag] = {}
        if self._evaluated <= cfg.warmup_steps:
            return out
        wait = report.cpu_wait
        if (wait is not None and wait > cfg.max_cpu_wait
                and any(s.device == "cpu" for s in sites)):
            return self._contended("backward_forward_ratio", report.step, wait, cfg.max_cpu_wait)
        judged: list[tuple[SiteSummary, float, float, object]] = []  # (site, ratio, threshold, key)
        for s in sites:
            if s.forward_seconds < cfg.min_forward_seconds:
                continue
            state = (s.site, s.impl, s.shape)
            r = self._judged_ratio(state, s.ratio_forward_seconds, s.backward_seconds,
                                   s.device == "cpu")
            if r is not None:
                judged.append((s, r, cfg.threshold_for(s.impl), state))
        # With the ratio each one's severity is judged on (_typical).
        over = [(s, r, t, self._typical(state, r)) for s, r, t, state in judged if r > t]
        fwd = sum(s.ratio_forward_seconds for s in sites)
        host = any(s.device == "cpu" for s in sites)
        total = self._judged_ratio(TOTAL, fwd, sum(s.backward_seconds for s in sites), host)
        # The step as a whole is judged against the most lenient threshold of its impls: a step
        # over it has at least one site over its own.
        line = max((j[2] for j in judged), default=cfg.threshold)
        judged_how = ""
        if host:
            wait = report.cpu_wait
            busy = (f"; the process waited for a CPU {wait:.0%} of the time" if wait is not None
                    and wait > self.cfg.regression.max_cpu_wait else "")
            judged_how = (f" (host clock: the lowest of the last {cfg.host_window_steps} "
                          f"windows' fastest backward over fastest forward of "
                          f"{cfg.host_window_steps} steps{busy})")
        if total is not None and total > line and fwd >= cfg.min_forward_seconds and over:
            s, r, _, typical = max(over, key=lambda x: x[1])
            key = ("backward_forward_ratio", TOTAL)
            severity = "info" if all(self._healthy(x, y) for x, _, _, y in over) else "warning"
            out[key] = self._held(key, severity) or self._flag(
                "backward_forward_ratio", total, line, report.step, TOTAL, s,
                ratio_advice(total, line, s, r, typical, len(over), len(sites), self.device,
                             judged_how), severity=severity, band=band_label(s, self.device))
        elif self.cfg.per_site:
            for s, r, t, typical in over:
                key = ("backward_forward_ratio", s.site)
                severity = "info" if self._healthy(s, typical) else "warning"
                out[key] = self._held(key, severity) or self._flag(
                    "backward_forward_ratio", r, t, report.step, s.site, s,
                    ratio_advice(r, t, s, r, typical, None, len(sites), self.device, judged_how),
                    severity=severity, band=band_label(s, self.device))
        return out

    def _memory(self, report: StepReport, sites: list[SiteSummary]) -> dict[tuple[str, str], Flag]:
        cfg = self.cfg.memory_savings
        out: dict[tuple[str, str], Flag] = {}
        under = [s for s in sites if s.memory_savings is not None and s.memory_savings < cfg.threshold]
        m = report.memory_savings
        if m is not None and m < cfg.threshold:
            key = ("memory_savings", TOTAL)
            severity = "info" if under and all(map(memory_expected, under)) else "warning"
            worst = min(under, key=lambda s: s.memory_savings or 0.0, default=None)
            out[key] = self._held(key, severity) or self._flag(
                "memory_savings", m, cfg.threshold, report.step, TOTAL, worst,
                memory_advice(m, cfg.threshold, worst, _fallback(report, worst), len(under),
                              len(sites)), severity=severity)
        elif self.cfg.per_site:
            for s in under:
                assert s.memory_savings is not None
                key = ("memory_savings", s.site)
                severity = "info" if memory_expected(s) else "warning"
                out[key] = self._held(key, severity) or self._flag(
                    "memory_savings", s.memory_savings, cfg.threshold, report.step, s.site, s,
                    memory_advice(s.memory_savings, cfg.threshold, s, _fallback(report, s), None,
                                  len(sites)), severity=severity)
        for s, value, message in _unfused_flex(report, sites, cfg.threshold):
            site = s.site if self.cfg.per_site else TOTAL
            out.setdefault(("memory_savings", site), self._flag(
                "memory_savings", value, cfg.threshold, report.step, site, s, message))
        return out

    def _host_bound(self, n: int, of: int, step: int) -> None:
        self.host_bound_calls += n
        if not self._host_bound_warned:
            self._host_bound_warned = True
            log.info("fadiag: step %d rank %d: %d of %d attention calls ran on a device that had "
                     "nothing left to run (it waited for the host to queue them), so their "
                     "windows may hold host time; the ratio rule does not judge such calls "
                     "(counted in fadiag_attention_host_bound_calls_total)", step, self.rank, n, of)

    def _contended(self, rule: str, step: int, wait: float | None,
                   limit: float) -> dict[tuple[str, str], Flag]:
        """A step the rule does not judge for its times: counted, said once per rule, and the
        rule's open episodes kept open (the step is evidence neither for them nor against)."""
        self.contended_steps[rule] += 1
        if rule not in self._contended_warned:
            self._contended_warned.add(rule)
            log.warning("fadiag: step %d rank %d: the process's threads waited for a CPU %.0f%% "
                        "of their runnable time (rules.%s.max_cpu_wait: %.0f%%): the machine is "
                        "oversubscribed, and on the host clock that reads as slow attention; %s "
                        "does not judge such steps (counted in fadiag_contended_steps_total)",
                        step, self.rank, 100 * (wait or 0.0), rule, 100 * limit, rule)
        return {k: f for k, f in self.active.items() if k[0] == rule}

    # ---- hang ------------------------------------------------------------------------------

    def check_hang(self, oldest_inflight_seconds: float) -> list[Flag]:
        cfg = self.cfg.hang
        if not cfg.enabled:
            return []
        conditions = {}
        if oldest_inflight_seconds > cfg.timeout_seconds:
            conditions[("hang", TOTAL)] = Flag(
                rule="hang", value=oldest_inflight_seconds, threshold=cfg.timeout_seconds,
                step=self._last_step + 1, site=TOTAL, rank=self.rank, severity="critical",
                message=(f"an attention call has not finished after {oldest_inflight_seconds:.0f} s "
                         f"(timeout {cfg.timeout_seconds:.0f} s): the device or a collective it waits "
                         "on may be stuck — dump the stacks (py-spy dump) and check the other ranks"))
        return self._episodes.update(conditions, rules=("hang",), step=self._last_step + 1)

    def _typical(self, key: object, value: float) -> float:
        """The ratio a site's severity is judged on: on device clocks the median of its last three
        steps (one step's outlier past a band is not a slow kernel; a backward that stays slow is
        one from its second step); on the host clock the judged ratio, already a window's."""
        recent = self._device.get(key)
        if recent is None or len(recent) < 3:
            return sum(recent) / len(recent) if recent else value
        a, b, c = recent
        return max(min(a, b), min(max(a, b), c))

    def _healthy(self, s: SiteSummary, value: float) -> bool:
        """Whether a ratio over its threshold is what the site's kernel measures when healthy."""
        band = band_for(s, self.device)
        return band is not None and band.covers(value)

    def _held(self, key: tuple[str, str], severity: str) -> Flag | None:
        """The open episode's flag at `key` when its condition holds again at the same severity
        (Episodes reads only the severity of later flags): its advice is not formatted again every
        step of a healthy cuDNN job, or of a short sequence that keeps out + logsumexp."""
        old = self.active.get(key)
        return old if old is not None and old.severity == severity else None

    def _flag(self, rule: str, value: float, threshold: float, step: int, site: str,
              s: SiteSummary | None, message: str, severity: str = "warning",
              band: str = "") -> Flag:
        return Flag(rule=rule, value=value, threshold=threshold, step=step, site=site,
                    message=message, impl=s.impl if s else "", shape=s.shape if s else None,
                    rank=self.rank, severity=severity, band=band)


def _fallback(report: StepReport, s: SiteSummary | None) -> str | None:
    """Why a site's calls fell back to the math path, where one said."""
    return next((c.fallback_reason for c in report.calls
                 if s is not None and c.site == s.site and c.fallback_reason), None)


def _unfused_flex(report: StepReport, sites: list[SiteSummary],
                 threshold: float) -> list[tuple[SiteSummary, float, str]]:
    """Eager flex_attention sites whose materialized scores fall below the savings threshold.

    The unfused path keeps only O and logsumexp for backward, but materializes the score matrix
    in each pass; it is judged on that: the allocator's peak, or at least one fp32 matrix where
    the device has no allocator figures (CPU)."""
    out = []
    for s in sites:
        if s.impl != "flex_unfused" or s.calls == 0 or s.standard_bytes <= 0:
            continue
        peaks = [c.peak_bytes for c in report.calls if c.site == s.site and c.peak_bytes]
        b, h, sq, sk, _ = s.shape
        materialized = max(peaks) if peaks else scores_bytes(b, h, sq, sk,
                                                             8 if s.dtype == "float64" else 4)
        value = 1.0 - materialized / (s.standard_bytes / s.calls)
        if value >= threshold:
            continue
        how = ("the allocator's peak" if peaks else
               "at least one fp32 matrix: this device reports no allocator peak")
        out.append((s, value, (
            f"memory savings {value:.1%} < {threshold:.0%}{site_text(s, None, len(sites))} — "
            "flex_attention ran without torch.compile, so it materializes [B,H,Sq,Sk] scores "
            f"({materialized / 2**20:.3g} MiB a call, {how}) in each pass: wrap it with "
            "torch.compile (torch.compile(flex_attention)) to run the fused kernel")))
    return out
