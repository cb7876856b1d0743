"""The rules: backward/forward ratio, memory savings, regression against a baseline, hang.

Each rule looks at a resolved StepReport (or the hang age) and keeps episodes: a flag is raised
when its condition starts and cleared when it ends, so a sink hears of a problem once.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Iterable

from .baseline import Baseline
from .config import RulesConfig
from .records import Flag, SiteSummary, StepReport

log = logging.getLogger("fadiag")

TOTAL = "*"
CLEAR_AFTER = 3
"""Calm evaluations (steps, or hang checks) before an open episode is cleared."""
_FUSED = ("flash", "cudnn", "cpu_flash", "flash_attn", "npu_fusion", "overrideable")
"""The `site` of a flag about a whole step."""


class Rules:
    """Evaluates every rule on each step; remembers which episodes are open.

    Example::

        rules = Rules(RulesConfig(), device="NVIDIA H200")
        for flag in rules.evaluate(report):
            print(flag.message)
    """

    def __init__(self, cfg: RulesConfig, device: str = "cpu", baseline: Baseline | None = None,
                 rank: int = 0):
        self.cfg = cfg
        self.device = device
        self.rank = rank
        self.baseline = baseline
        self.active: dict[tuple[str, str], Flag] = {}
        self.baseline_seconds: float | None = None
        """The baseline the last step was compared with (its sites, its key); None for a step
        without one (a shape still in its warm-up)."""
        self.regression_ratio: float | None = None
        """The last step's attention seconds over that baseline; None for a step without one."""
        self._warm: dict[object, list[float]] = {}
        self._frozen: dict[object, tuple[float, float]] = {}
        self._seen_steps = 0
        self._over: deque[bool] = deque(maxlen=max(1, cfg.regression.consecutive))
        self._baseline_warned = False
        # (observed / expected, observed - expected - allowed) of the last three judged steps:
        # ratios, so steps of different keys (shapes a run alternates between) compare.
        self._recent: deque[tuple[float, float]] = deque(maxlen=3)
        self._calm: dict[tuple[str, str], int] = {}
        self._last_step = 0

    # ---- step rules ------------------------------------------------------------------------

    def evaluate(self, report: StepReport) -> list[Flag]:
        """Flags raised or cleared by this step (raised ones have cleared=False)."""
        self._last_step = report.step
        conditions: dict[tuple[str, str], Flag] = {}
        sites = report.sites()
        if self.cfg.backward_forward_ratio.enabled:
            conditions.update(self._ratio(report, sites))
        if self.cfg.memory_savings.enabled:
            conditions.update(self._memory(report, sites))
        if self.cfg.regression.enabled:
            conditions.update(self._regression(report, sites))
        out = self._episodes(conditions, rules=("backward_forward_ratio", "memory_savings",
                                                "regression"), step=report.step)
        report.flags = [f for f in out if not f.cleared]
        return out

    def _episodes(self, conditions: dict[tuple[str, str], Flag], rules: Iterable[str],
                  step: int) -> list[Flag]:
        out = []
        for key, flag in conditions.items():
            if key not in self.active:
                self.active[key] = flag
                out.append(flag)
        rules = tuple(rules)
        for key in list(self.active):
            if key[0] not in rules:
                continue
            if key in conditions:
                self._calm.pop(key, None)
                continue
            # An episode ends after CLEAR_AFTER calm evaluations, so a value hovering at the
            # threshold is one episode, not a flag every other step.
            self._calm[key] = self._calm.get(key, 0) + 1
            if self._calm[key] < CLEAR_AFTER:
                continue
            del self._calm[key]
            old = self.active.pop(key)
            out.append(Flag(rule=old.rule, value=old.value, threshold=old.threshold, step=step,
                            site=old.site, message=f"cleared: {old.rule} at {old.site}",
                            impl=old.impl, shape=old.shape, rank=self.rank, cleared=True))
        return out

    def _ratio(self, report: StepReport, sites: list[SiteSummary]) -> dict[tuple[str, str], Flag]:
        cfg = self.cfg.backward_forward_ratio
        out: dict[tuple[str, str], Flag] = {}
        over = [s for s in sites if s.ratio is not None and s.ratio > cfg.threshold
                and s.forward_seconds >= cfg.min_forward_seconds]
        r = report.ratio
        if r is not None and r > cfg.threshold and report.forward_seconds >= cfg.min_forward_seconds:
            worst = max(over, key=lambda s: s.ratio or 0.0, default=None)
            out[("backward_forward_ratio", TOTAL)] = self._flag(
                "backward_forward_ratio", r, cfg.threshold, report.step, TOTAL, worst,
                _ratio_advice(r, cfg.threshold, worst, len(over), len(sites)))
        elif self.cfg.per_site:
            for s in over:
                assert s.ratio is not None
                out[("backward_forward_ratio", s.site)] = self._flag(
                    "backward_forward_ratio", s.ratio, cfg.threshold, report.step, s.site, s,
                    _ratio_advice(s.ratio, cfg.threshold, s, None, len(sites)))
        return out

    def _memory(self, report: StepReport, sites: list[SiteSummary]) -> dict[tuple[str, str], Flag]:
        cfg = self.cfg.memory_savings
        out: dict[tuple[str, str], Flag] = {}
        under = [s for s in sites if s.memory_savings is not None and s.memory_savings < cfg.threshold]
        m = report.memory_savings
        if m is not None and m < cfg.threshold:
            worst = min(under, key=lambda s: s.memory_savings or 0.0, default=None)
            reason = next((c.fallback_reason for c in report.calls
                           if worst is not None and c.site == worst.site and c.fallback_reason), None)
            out[("memory_savings", TOTAL)] = self._flag(
                "memory_savings", m, cfg.threshold, report.step, TOTAL, worst,
                _memory_advice(m, cfg.threshold, worst, reason, len(under), len(sites)))
        elif self.cfg.per_site:
            for s in under:
                assert s.memory_savings is not None
                reason = next((c.fallback_reason for c in report.calls
                               if c.site == s.site and c.fallback_reason), None)
                out[("memory_savings", s.site)] = self._flag(
                    "memory_savings", s.memory_savings, cfg.threshold, report.step, s.site, s,
                    _memory_advice(s.memory_savings, cfg.threshold, s, reason, None, len(sites)))
        return out

    def _regression(self, report: StepReport, sites: list[SiteSummary]) -> dict[tuple[str, str], Flag]:
        cfg = self.cfg.regression
        self.regression_ratio = self.baseline_seconds = None
        observed = report.attention_seconds
        expected: float | None = None
        spread = 0.0
        if self.baseline is not None:
            pair = self.baseline.expected(sites, self.device)
            if pair is not None:
                observed, expected = pair
            elif not self._baseline_warned:
                self._baseline_warned = True
                log.warning("fadiag: baseline file matches no site of this run (device %s); "
                            "using the rolling baseline instead", self.device)
        if expected is None:
            key = frozenset((s.site, s.shape, s.dtype) for s in sites)
            frozen = self._frozen.get(key)
            if frozen is None:
                self._seen_steps += 1
                if self._seen_steps > cfg.warmup_steps:
                    warm = self._warm.setdefault(key, [])
                    warm.append(observed)
                    if len(warm) >= cfg.window:
                        med = statistics.median(warm)
                        mad = statistics.median(abs(x - med) for x in warm)
                        self._frozen[key] = (med, mad)
                        del self._warm[key]
                self._over.append(False)
                return {}
            expected, mad = frozen
            # A clean run on a noisy machine stays within a few MADs of its own warm-up.
            spread = 3.0 * 1.4826 * mad
        self.baseline_seconds = expected
        self.regression_ratio = observed / expected if expected > 0.0 else None
        if self.regression_ratio is None:
            self._over.append(False)
            return {}
        # A median of the last three steps: one slow step (a GC pause, a neighbour's burst) is
        # not a regression; a real slowdown lifts the median from its second step on.
        self._recent.append((self.regression_ratio,
                             observed - expected - max(spread, cfg.min_increase_seconds)))
        value = statistics.median(r for r, _ in self._recent)
        over = value > 1.0 + cfg.tolerance and statistics.median(x for _, x in self._recent) > 0.0
        self._over.append(over)
        if len(self._over) == self._over.maxlen and all(self._over):
            worst = max(sites, key=lambda s: s.forward_seconds + s.backward_seconds, default=None)
            msg = (f"attention {observed * 1e3:.2f} ms/step is {value:.2f}x its baseline "
                   f"{expected * 1e3:.2f} ms (median of the last 3 steps' ratios) for "
                   f"{cfg.consecutive} steps"
                   + (f"; largest site {worst.site} impl={worst.impl}" if worst else "")
                   + " — check for a backend change (fadiag doctor), a new shape, or a noisy neighbour")
            return {("regression", TOTAL): self._flag("regression", value, 1.0 + cfg.tolerance,
                                                      report.step, TOTAL, worst, msg)}
        if ("regression", TOTAL) in self.active and over:
            return {("regression", TOTAL): self.active[("regression", TOTAL)]}
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
                step=self._last_step + 1, site=TOTAL, rank=self.rank,
                message=(f"an attention call has not finished after {oldest_inflight_seconds:.0f} s "
                         f"(timeout {cfg.timeout_seconds:.0f} s): the device or a collective it waits "
                         "on may be stuck — dump the stacks (py-spy dump) and check the other ranks"))
        return self._episodes(conditions, rules=("hang",), step=self._last_step + 1)

    def _flag(self, rule: str, value: float, threshold: float, step: int, site: str,
              s: SiteSummary | None, message: str) -> Flag:
        return Flag(rule=rule, value=value, threshold=threshold, step=step, site=site,
                    message=message, impl=s.impl if s else "", shape=s.shape if s else None,
                    rank=self.rank)


def _shape_text(s: SiteSummary | None) -> str:
    if s is None:
        return ""
    b, h, sq, sk, d = s.shape
    return f"impl={s.impl} B={b} H={h} Sq={sq} Sk={sk} D={d} {s.dtype}"


def _where(s: SiteSummary | None, n: int | None, n_sites: int) -> str:
    """Which site: the worst of the step's `n` over the line, or (n None) the flag's own site."""
    if s is None:
        return ""
    if n is None:
        return f" (site {s.site}: {_shape_text(s)})"
    return f" ({n}/{n_sites} sites; worst {s.site}: {_shape_text(s)})"


def _ratio_advice(r: float, threshold: float, s: SiteSummary | None, n_over: int | None,
                  n_sites: int) -> str:
    head = f"backward/forward {r:.2f}x > {threshold:g}x"
    where = _where(s, n_over, n_sites)
    if s is None:
        why = ""
    elif s.impl == "efficient":
        why = (f" — mem-efficient backend at S={s.shape[2]}; flash and cuDNN are faster in both "
               "passes (their ratio is 2.5-3.1x at S >= 4096 on an H200): use fp16/bf16 and a head "
               "dim flash supports, or enable the cuDNN backend")
    elif s.impl == "math":
        why = " — the math path: see the memory flag for why fused kernels were not used"
    elif s.impl not in _FUSED:
        why = (f" — {s.impl}'s own backward is slow: check that it recomputes only what it must "
               "and launches fused kernels")
    elif s.shape[2] <= 512:
        why = (f" — short sequence (S={s.shape[2]}): the step is launch-bound and backward ≈4x forward "
               "is normal here; raise rules.backward_forward_ratio.min_forward_seconds to ignore it")
    elif s.shape[2] <= 2048 and s.impl in ("flash", "cudnn"):
        why = (f" — {s.impl} at S={s.shape[2]}: backward does 2.5x forward's FLOPs, but these "
               "kernels' backward is less efficient than their forward at short lengths (3.0-3.6x "
               "measured on an H200 with torch 2.11, benchmarks/BENCHMARKS.md); if that is what "
               "this job runs, raise rules.backward_forward_ratio.threshold")
    else:
        why = (" — backward does 2.5x forward's FLOPs; above 3x the backward kernel is inefficient "
               "for this shape: try another backend (fadiag bench) or a newer kernel version")
    return head + where + why


def _memory_advice(m: float, threshold: float, s: SiteSummary | None, reason: str | None,
                   n_under: int | None, n_sites: int) -> str:
    head = f"memory savings {m:.1%} < {threshold:.0%}"
    where = _where(s, n_under, n_sites)
    if s is None:
        why = ""
    elif s.impl == "math":
        why = (" — SDPA fell back to the math path, which keeps [B,H,Sq,Sk] matrices"
               + (f": {reason}" if reason else "")
               + "; pass a bool mask or is_causal, use fp16/bf16 and a supported head dim, "
                 "or nn.MultiheadAttention(need_weights=False)")
    elif s.shape[4] * 2 >= s.shape[3]:
        why = (f" — short sequence (Sk={s.shape[3]}) with head dim {s.shape[4]}: the output itself "
               "is a large share of standard attention's memory; expected, not a fault")
    else:
        why = f" — {s.impl} keeps more than O and logsumexp for backward: check what it saves"
    return head + where + why
