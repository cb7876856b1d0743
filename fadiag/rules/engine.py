"""The rules: backward/forward ratio, memory savings, regression against a baseline, hang.

Each rule looks at a resolved StepReport (or the hang age) and says which conditions hold;
episodes.py keeps the episodes: a flag is raised when a condition starts (or grows graver) and
cleared when it ends, so a sink hears of a problem once.
"""

from __future__ import annotations

import logging
import operator
import statistics
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..config import RulesConfig
from ..steps.records import CallRecord, Flag, SiteSummary, StepReport, ratio, summarize
from .bands import band_for
from .baseline import Baseline
from .episodes import Episodes
from .messages import band_label, memory_advice, memory_expected, ratio_advice, unfused_flex

log = logging.getLogger("fadiag")
_FORWARD, _BACKWARD = operator.itemgetter(0), operator.itemgetter(1)

TOTAL = "*"
"""The `site` of a flag about a whole step."""


_KEYS = 4096
"""Site or step keys whose state the rules keep, at most (a padded batch adds one per length)."""


def _bounded(by_key: dict, key: object, make: Callable[[], Any]) -> Any:
    """`by_key[key]`, made if new, evicting the oldest key past _KEYS."""
    value = by_key.get(key)
    if value is None:
        if len(by_key) >= _KEYS:
            del by_key[next(iter(by_key))]
        value = by_key[key] = make()
    return value


def ratio_calls(calls: Iterable[CallRecord]) -> list[CallRecord]:
    """The calls the ratio rule judges: not a signature's probe (cold caches land in it), and not
    host-bound (a starved device's windows measure the host's launches, not the kernel)."""
    return [c for c in calls if not c.probe and not c.host_bound]


def fastest_ratio(window: Sequence[tuple[float, float]]) -> float:
    """The fastest backward over the fastest forward of (forward, backward) seconds: how the
    ratio rule judges host-clock timings over a window of steps (Rules._judged_ratio)."""
    return min(map(_BACKWARD, window)) / min(map(_FORWARD, window))


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
        self.baseline = baseline
        self._episodes = Episodes(rank)
        self.active = self._episodes.active
        """Open episodes by (rule, site): the flag that opened each."""
        self.baseline_seconds: float | None = None
        """The baseline the last step was compared with (its sites, its key); None for a step
        without one (the warm-up, or a shape still in its window)."""
        self.regression_ratio: float | None = None
        """The last step's attention seconds over that baseline; None for a step without one."""
        self._evaluated = 0
        self._host: dict[object, deque[float]] = {}  # host-clock ratios, per site key
        self._device: dict[object, deque[float]] = {}  # device-clock ratios, the last 3, per key
        self._warm: dict[object, list[tuple[float, dict[str, str]]]] = {}
        self._frozen: dict[object, tuple[float, float, dict[str, str]]] = {}
        self._over: deque[bool] = deque(maxlen=max(1, cfg.regression.consecutive))
        self._over_since: float | None = None
        self._baseline_warned = False
        self.contended_steps = {"backward_forward_ratio": 0, "regression": 0}
        """Host-clock steps a timing rule did not judge, by rule: the process's threads waited
        for a CPU more than the rule's max_cpu_wait of their runnable time."""
        self._contended_warned: set[str] = set()
        self.host_bound_calls = 0
        """Calls the ratio rule left unjudged: their device windows may hold host time."""
        self._host_bound_warned = False
        # (observed / expected, observed - expected - allowed) of the last three judged steps:
        # ratios, so steps of different keys (shapes a run alternates between) compare.
        self._recent: deque[tuple[float, float]] = deque(maxlen=3)
        self._last_step = 0

    # ---- step rules ------------------------------------------------------------------------

    def evaluate(self, report: StepReport) -> list[Flag]:
        """Flags raised or cleared by this step (raised ones have cleared=False)."""
        self._last_step = report.step
        self._evaluated += 1
        conditions: dict[tuple[str, str], Flag] = {}
        # Timing rules judge the steady state: not the calls that learned a signature.
        calls = [c for c in report.calls if not c.probe]
        steady = summarize(calls)
        if self.cfg.backward_forward_ratio.enabled:
            judged = ratio_calls(calls)
            if len(judged) < len(calls):
                self._host_bound(len(calls) - len(judged), len(calls), report.step)
                conditions.update(self._ratio(report, summarize(judged)))
            else:
                conditions.update(self._ratio(report, steady))
        if self.cfg.memory_savings.enabled:
            # Memory is judged on every call (a probe's kept bytes are its signature's).
            all_sites = steady if len(calls) == len(report.calls) else report.sites()
            conditions.update(self._memory(report, all_sites))
        if self.cfg.regression.enabled:
            conditions.update(self._regression(report, steady))
        out = self._episodes.update(conditions, rules=("backward_forward_ratio", "memory_savings",
                                                "regression"), step=report.step)
        report.flags = [f for f in out if not f.cleared]
        return out

    def _judged_ratio(self, key: object, forward: float, backward: float,
                      host: bool) -> float | None:
        """The ratio the rule judges: the step's own, or on host-clock timings the fastest
        backward over the fastest forward of the key's last `host_window_steps` steps (None until
        it has that many).

        A preemption only ever adds time, in scheduler slices of milliseconds: beside a busy
        process most of a two-thread kernel's backward calls wait at a barrier for a preempted
        thread (the median of 9 steps read 2.6-4x for a healthy 2x kernel), while some run
        undisturbed. The fastest call is the closest to what the kernel costs (timeit's rule);
        a backward that really is slow is slow in every step."""
        value = ratio(backward, forward)
        if value is None:
            return value
        if not host:
            _bounded(self._device, key, lambda: deque(maxlen=3)).append(value)
            return value
        n = self.cfg.backward_forward_ratio.host_window_steps
        recent = _bounded(self._host, key, lambda: deque(maxlen=n))
        recent.append((forward, backward))
        if len(recent) < n:
            return None
        return fastest_ratio(recent)

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
            key = (s.site, s.impl, s.shape)
            r = self._judged_ratio(key, s.ratio_forward_seconds, s.backward_seconds,
                                   s.device == "cpu")
            if r is not None:
                judged.append((s, r, cfg.threshold_for(s.impl), key))
        # With the ratio each one's severity is judged on (_typical).
        over = [(s, r, t, self._typical(key, r)) for s, r, t, key in judged if r > t]
        fwd = sum(s.ratio_forward_seconds for s in sites)
        host = any(s.device == "cpu" for s in sites)
        total = self._judged_ratio(TOTAL, fwd, sum(s.backward_seconds for s in sites), host)
        # The step as a whole is judged against the most lenient threshold of its impls: a step
        # over it has at least one site over its own.
        line = max((j[2] for j in judged), default=cfg.threshold)
        median = ""
        if host:
            wait = report.cpu_wait
            busy = (f"; the process waited for a CPU {wait:.0%} of the time" if wait is not None
                    and wait > self.cfg.regression.max_cpu_wait else "")
            median = f" (fastest of the last {cfg.host_window_steps} steps{busy})"
        if total is not None and total > line and fwd >= cfg.min_forward_seconds and over:
            s, r, _, typical = max(over, key=lambda x: x[1])
            key = ("backward_forward_ratio", TOTAL)
            severity = "info" if all(self._healthy(x, y) for x, _, _, y in over) else "warning"
            out[key] = self._held(key, severity) or self._flag(
                "backward_forward_ratio", total, line, report.step, TOTAL, s,
                ratio_advice(total, line, s, r, typical, len(over), len(sites), self.device,
                             median), severity=severity, band=band_label(s, self.device))
        elif self.cfg.per_site:
            for s, r, t, typical in over:
                key = ("backward_forward_ratio", s.site)
                severity = "info" if self._healthy(s, typical) else "warning"
                out[key] = self._held(key, severity) or self._flag(
                    "backward_forward_ratio", r, t, report.step, s.site, s,
                    ratio_advice(r, t, s, r, typical, None, len(sites), self.device, median),
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
        for s, value, message in unfused_flex(report, sites, cfg.threshold):
            site = s.site if self.cfg.per_site else TOTAL
            out.setdefault(("memory_savings", site), self._flag(
                "memory_savings", value, cfg.threshold, report.step, site, s, message))
        return out

    def _regression(self, report: StepReport, sites: list[SiteSummary]) -> dict[tuple[str, str], Flag]:
        cfg = self.cfg.regression
        self.regression_ratio = self.baseline_seconds = None
        if self._evaluated <= cfg.warmup_steps or not sites:
            return self._calm_regression()
        # On the host clock a busier machine reads as slower attention: a step whose process
        # waited for its CPUs is neither compared nor learned, only checked for an impl switch.
        wait = report.cpu_wait
        contended = (wait is not None and wait > cfg.max_cpu_wait
                     and any(s.device == "cpu" for s in sites))
        limit = cfg.max_cpu_wait
        observed = sum(s.forward_seconds + s.backward_seconds for s in sites)
        expected: float | None = None
        spread = 0.0
        changes: list[tuple[str, str, str]] = []
        if self.baseline is not None:
            match = self.baseline.expected(sites, self.device)
            if match is not None:
                observed, expected, changes = match.observed, match.expected, match.changes
            elif not self._baseline_warned:
                self._baseline_warned = True
                log.warning("fadiag: baseline file matches no site of this run (device %s); "
                            "using the rolling baseline instead", self.device)
        if expected is None:
            key = frozenset((s.site, s.shape, s.dtype) for s in sites)
            frozen = self._frozen.get(key)
            if frozen is None:
                if contended:
                    return self._contended("regression", report.step, wait, limit)
                warm = _bounded(self._warm, key, list)
                warm.append((observed, {s.site: s.impl for s in sites}))
                if len(warm) >= cfg.window:
                    seconds = [x for x, _ in warm]
                    med = statistics.median(seconds)
                    mad = statistics.median(abs(x - med) for x in seconds)
                    impls = {site: Counter(i[site] for _, i in warm).most_common(1)[0][0]
                             for site in warm[-1][1]}
                    _bounded(self._frozen, key, lambda: (med, mad, impls))
                    del self._warm[key]
                return self._calm_regression()
            expected, mad, impls = frozen
            changes = [(s.site, impls[s.site], s.impl) for s in sites
                       if impls.get(s.site, s.impl) != s.impl]
            # A clean run on a noisy machine stays within a few MADs of its own warm-up.
            spread = 3.0 * 1.4826 * mad
        self.baseline_seconds = expected
        self.regression_ratio = observed / expected if expected > 0.0 else None
        if self.regression_ratio is None:
            return self._calm_regression()
        if contended and not changes:
            return self._contended("regression", report.step, wait, limit)
        # A median of the last three steps: one slow step (a GC pause, a neighbour's burst) is
        # not a regression; a real slowdown lifts the median from its second step on.
        self._recent.append((self.regression_ratio,
                             observed - expected - max(spread, cfg.min_increase_seconds)))
        value = statistics.median(r for r, _ in self._recent)
        slower = value > 1.0 + cfg.tolerance and statistics.median(x for _, x in self._recent) > 0.0
        # A switch of impl at the same shapes (flash to math: the fallback) is a regression in
        # itself, whatever the time says.
        over = slower or bool(changes)
        self._over.append(over)
        if not over:
            self._over_since = None
        elif self._over_since is None:
            self._over_since = report.wall_time
        sustained = (len(self._over) == self._over.maxlen and all(self._over)
                     and self._over_since is not None
                     and report.wall_time - self._over_since >= cfg.sustain_seconds)
        if sustained:
            worst = max(sites, key=lambda s: s.forward_seconds + s.backward_seconds, default=None)
            if changes:
                site, was, now = changes[0]
                worst = next((s for s in sites if s.site == site), worst)
                more = f" (and {len(changes) - 1} more sites)" if len(changes) > 1 else ""
                head = (f"site {site} switched impl {was} → {now} at the baseline's shapes{more}; "
                        f"attention {observed * 1e3:.2f} ms/step is {value:.2f}x its baseline "
                        f"{expected * 1e3:.2f} ms")
                tail = " — a silent fallback: see the memory flag and fadiag doctor for why"
            else:
                head = (f"attention {observed * 1e3:.2f} ms/step is {value:.2f}x its baseline "
                        f"{expected * 1e3:.2f} ms (median of the last 3 steps' ratios)")
                tail = (f"; largest site {worst.site} impl={worst.impl}" if worst else "") + (
                    " — check for a backend change (fadiag doctor), a new shape, or a noisy "
                    "neighbour")
            msg = (f"{head} for {len(self._over)} steps over "
                   f"{report.wall_time - (self._over_since or report.wall_time):.0f} s{tail}")
            return {("regression", TOTAL): self._flag("regression", value, 1.0 + cfg.tolerance,
                                                      report.step, TOTAL, worst, msg)}
        if ("regression", TOTAL) in self.active and over:
            return {("regression", TOTAL): self.active[("regression", TOTAL)]}
        return {}

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

    def _calm_regression(self) -> dict[tuple[str, str], Flag]:
        self._over.append(False)
        self._over_since = None
        return {}

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
