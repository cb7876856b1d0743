"""The regression rule: a step's attention seconds against a baseline, per set of shapes.

The baseline is a saved file's (`fadiag baseline`), or rolling: a window of the run's own steps
at each set of sites, shapes and dtypes, frozen once full. Rules (engine.py) calls it each step.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, deque
from collections.abc import Callable

from ..config import RegressionRuleConfig
from ..steps.records import Flag, SiteSummary, StepReport
from .baseline import Baseline
from .keyed import TOTAL, bounded

log = logging.getLogger("fadiag")


class Regression:
    """The rule's state: per step key its warm-up window, then its frozen baseline; the last
    three steps' ratios; whether the condition held over `consecutive` steps.

    Rules (engine.py) owns one, and hands it how a contended step and a flag are made and the
    open episodes; it judges each step's sites after the warm-up::

        conditions = rules.regression.judge(report, report.sites(), evaluated=100)
    """

    def __init__(self, cfg: RegressionRuleConfig, device: str, baseline: Baseline | None,
                 contended: Callable[[int, float | None, float], dict[tuple[str, str], Flag]],
                 flag: Callable[..., Flag], active: dict[tuple[str, str], Flag]):
        self.cfg = cfg
        self.device = device
        self.baseline = baseline
        self._contended = contended
        self._flag = flag
        self.active = active
        self.baseline_seconds: float | None = None
        """The baseline the last step was compared with (its sites, its key); None for a step
        without one (the warm-up, or a shape still in its window)."""
        self.regression_ratio: float | None = None
        """The last step's attention seconds over that baseline; None for a step without one."""
        self._warm: dict[object, list[tuple[float, dict[str, str]]]] = {}
        self._frozen: dict[object, tuple[float, float, dict[str, str]]] = {}
        self._over: deque[bool] = deque(maxlen=max(1, cfg.consecutive))
        self._over_since: float | None = None
        self._baseline_warned = False
        # (observed / expected, observed - expected - allowed) of the last three judged steps:
        # ratios, so steps of different keys (shapes a run alternates between) compare.
        self._recent: deque[tuple[float, float]] = deque(maxlen=3)

    def judge(self, report: StepReport, sites: list[SiteSummary],
              evaluated: int) -> dict[tuple[str, str], Flag]:
        """The step's regression condition, if it holds; `evaluated`: steps the rules saw."""
        cfg = self.cfg
        self.regression_ratio = self.baseline_seconds = None
        if evaluated <= cfg.warmup_steps or not sites:
            return self._calm()
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
                    return self._contended(report.step, wait, limit)
                warm = bounded(self._warm, key, list)
                warm.append((observed, {s.site: s.impl for s in sites}))
                if len(warm) >= cfg.window:
                    seconds = [x for x, _ in warm]
                    med = statistics.median(seconds)
                    mad = statistics.median(abs(x - med) for x in seconds)
                    impls = {site: Counter(i[site] for _, i in warm).most_common(1)[0][0]
                             for site in warm[-1][1]}
                    bounded(self._frozen, key, lambda: (med, mad, impls))
                    del self._warm[key]
                return self._calm()
            expected, mad, impls = frozen
            changes = [(s.site, impls[s.site], s.impl) for s in sites
                       if impls.get(s.site, s.impl) != s.impl]
            # A clean run on a noisy machine stays within a few MADs of its own warm-up.
            spread = 3.0 * 1.4826 * mad
        self.baseline_seconds = expected
        self.regression_ratio = observed / expected if expected > 0.0 else None
        if self.regression_ratio is None:
            return self._calm()
        if contended and not changes:
            return self._contended(report.step, wait, limit)
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

    def _calm(self) -> dict[tuple[str, str], Flag]:
        self._over.append(False)
        self._over_since = None
        return {}
