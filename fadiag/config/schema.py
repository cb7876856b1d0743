"""fadiag's configuration schema: one frozen, keyword-only dataclass per component.

Each validates itself on construction and names the dotted key in its `ConfigError` (the checks
are in checks.py); `fadiag.config.loader.load_config()` builds one from YAML, mappings and
overrides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .checks import (
    Check,
    _integer,
    _is_host,
    _mapping_of,
    _number,
    _one_of,
    _validate,
    set_root,
)


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """sampling: which steps are measured."""

    _checks: ClassVar[dict[str, Check]] = {"every_n_steps": _integer(1),
                                           "reports_per_second": _number(lo=0)}

    every_n_steps: int = 1
    """Measure one step in N (1 = every step). Unmeasured steps cost one branch per call."""
    reports_per_second: float = 0.0
    """Build a step report for about this many steps a second of training (0 = every measured
    step). The other measured steps are counted: every call's seconds go to the metrics'
    histograms and counters and fadiag_steps_unreported_total counts the step, but no report is
    built for it (no rules, log line, JSONL line or history entry); the next report's
    counted_before says how many. A step that learned a signature or left a call unmeasured, and
    the newest step at each pass of the resolver, are always reported. A counted step shaped
    like the last of its kind that was resolved in Python (the same calls, the same sites; steps
    with the eager wrapper's calls and steps with none are two kinds) is counted by the dispatcher
    tap's C++, with no Python per call. For launch-bound jobs with many steps a second, where a
    report per step costs the host (benchmarks/BENCHMARKS.md §4)."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class InterceptorsConfig:
    """interceptors: which attention implementations are patched."""

    sdpa: bool = True
    """Patch torch.nn.functional.scaled_dot_product_attention."""
    rebind_imported: bool = True
    """Also rebind modules that imported SDPA by name before attach()."""
    transformers: bool = True
    """Wrap HF transformers' ALL_ATTENTION_FUNCTIONS entries when transformers is imported."""
    flash_attn: bool = True
    """Patch flash_attn.flash_attn_func / flash_attn_varlen_func when flash_attn is importable."""
    npu: bool = True
    """Patch torch_npu.npu_fusion_attention (+ _v2, _v3) when torch_npu is importable."""
    flex: bool = True
    """Patch torch.nn.attention.flex_attention.flex_attention, and wrap what torch.compile returns
    for it."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class StepsConfig:
    """steps: how calls are grouped into steps and how many steps are kept."""

    _checks: ClassVar[dict[str, Check]] = {
        "history": _integer(1),
        "fallback_after": _integer(1),
        "max_calls_per_step": _integer(1),
        "verify_every": _integer(0),
    }

    history: int = 256
    """How many resolved StepReports to keep in memory."""
    fallback_after: int = 32
    """With no optimizer step seen, after this many micro-batches each forward-after-backward ends a step."""
    record_no_grad: bool = False
    """Record attention calls made under no_grad (evaluation); off: they are not measured."""
    max_calls_per_step: int = 4096
    """Calls beyond this in one step are counted but not measured (bounds memory)."""
    verify_every: int = 100
    """Eager SDPA steps that repeat the calls of a step the wrapper measured run no fadiag Python per call (the tap times them, named by that step's order); of this many measured steps in a row, one is the wrapper's, which checks the order. 0: every call through the wrapper."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class RatioRuleConfig:
    """rules.backward_forward_ratio: flag a slow backward relative to its forward."""

    _checks: ClassVar[dict[str, Check]] = {
        "threshold": _number(above=0),
        "per_impl": _mapping_of("impl names to numbers > 0", _number(above=0)),
        "min_forward_seconds": _number(lo=0),
        "warmup_steps": _integer(0),
        "host_window_steps": _integer(1),
        "max_cpu_wait": _number(lo=0, hi=1),
    }

    enabled: bool = True
    """Evaluate this rule."""
    threshold: float = 3.0
    """Flag when backward seconds / forward seconds exceeds this."""
    per_impl: dict[str, float] = field(default_factory=dict, hash=False)
    """Thresholds for some impls ({cudnn: 3.7, flash: 4.0}); the others use threshold. `fadiag
    calibrate` measures the job's shapes and writes them."""
    min_forward_seconds: float = 0.0
    """Ignore sites whose forward time is below this (microsecond noise); 0 keeps the rule as written."""
    warmup_steps: int = 3
    """Measured steps after attach() that are not judged (cold caches, kernel plans, autotuning).
    A call that learned its signature (the first of each shape) is never judged."""
    host_window_steps: int = 9
    """Host-clock timings (CPU) are judged on a site's fastest backward over its fastest forward
    in a window of this many steps, and a site is over the line when its last this-many windows
    all are (2n-1 steps): the host clock counts every preemption (in scheduler slices of
    milliseconds, so one step can read 30x, and beside a busy process most backward calls are
    stretched), a preemption only ever adds time, and a neighbour that comes and goes leaves the
    short forward undisturbed more often than the backward; a really slow backward is slow in
    every window."""
    max_cpu_wait: float = 0.5
    """Host-clock (CPU) steps in which the process's threads spent more than this share of their
    runnable time waiting for a CPU (Linux's schedstat) are not judged: past half, a two-thread
    backward waits at every barrier and even its fastest call of a window measures the machine
    (a healthy 2x kernel read 150-300x at 0.83). Counted in fadiag_contended_steps_total and
    said once in the log. 1 judges every step."""

    def __post_init__(self) -> None:
        _validate(self)
        object.__setattr__(self, "per_impl", {k: float(v) for k, v in self.per_impl.items()})

    def threshold_for(self, impl: str) -> float:
        return self.per_impl.get(impl, self.threshold)


@dataclass(frozen=True, kw_only=True)
class MemoryRuleConfig:
    """rules.memory_savings: flag attention that keeps nearly as much as standard attention."""

    _checks: ClassVar[dict[str, Check]] = {"threshold": _number(lo=0, hi=1)}

    enabled: bool = True
    """Evaluate this rule."""
    threshold: float = 0.8
    """Flag when memory savings (1 - kept / standard) fall below this."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class RegressionRuleConfig:
    """rules.regression: flag attention time rising above its baseline."""

    _checks: ClassVar[dict[str, Check]] = {
        "tolerance": _number(above=0),
        "min_increase_seconds": _number(lo=0),
        "consecutive": _integer(1),
        "sustain_seconds": _number(lo=0),
        "warmup_steps": _integer(0),
        "window": _integer(1),
        "max_cpu_wait": _number(lo=0, hi=1),
    }

    enabled: bool = True
    """Evaluate this rule."""
    tolerance: float = 0.2
    """Flag when attention time exceeds the baseline by more than this fraction."""
    min_increase_seconds: float = 0.0005
    """...and by more than this many seconds per step. Host-timed (CPU) steps drift by ~30 % for
    hundreds of steps on a shared machine; below half a millisecond per step that is noise, not a
    regression worth a flag. 0 judges by the fraction alone."""
    consecutive: int = 5
    """...for this many consecutive steps..."""
    sustain_seconds: float = 30.0
    """...spanning at least this many seconds (first step over to the last): a neighbour's burst
    of a few seconds is not a regression. 0 judges by steps alone."""
    warmup_steps: int = 10
    """Steps after attach() that are not compared (with the rolling baseline or a baseline file);
    then the rolling baseline's window starts collecting."""
    window: int = 50
    """Steps after the warm-up whose median becomes the baseline (then fixed for the run)."""
    baseline_file: str | None = None
    """A baseline written by `fadiag baseline save`; replaces the rolling baseline where it matches."""
    max_cpu_wait: float = 0.1
    """Host-clock (CPU) steps in which the process's threads spent more than this share of their
    runnable time waiting for a CPU (another process holds the cores: Linux's schedstat) are
    contended: neither compared nor learned into the rolling baseline (an impl switch is still
    judged), since on the host clock a busier machine reads as slower attention. Counted in
    fadiag_contended_steps_total and said once in the log. An idle machine reads below 0.02,
    one busy process beside a two-thread run about 0.3. 1 compares every step."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class HangRuleConfig:
    """rules.hang: flag an attention call that has not finished."""

    _checks: ClassVar[dict[str, Check]] = {"timeout_seconds": _number(above=0)}

    enabled: bool = True
    """Evaluate this rule."""
    timeout_seconds: float = 300.0
    """Flag when the oldest unfinished attention call is older than this."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class RulesConfig:
    """rules: the checks run on every resolved step."""

    backward_forward_ratio: RatioRuleConfig = field(default_factory=RatioRuleConfig)
    memory_savings: MemoryRuleConfig = field(default_factory=MemoryRuleConfig)
    regression: RegressionRuleConfig = field(default_factory=RegressionRuleConfig)
    hang: HangRuleConfig = field(default_factory=HangRuleConfig)
    per_site: bool = True
    """Evaluate the ratio and memory rules per call site as well as for the step total."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class ExporterConfig:
    """exporter: the Prometheus /metrics endpoint."""

    _checks: ClassVar[dict[str, Check]] = {
        "addr": Check("an IP address or a host name", _is_host),
        "port": _integer(0, 65535),
        "on_port_in_use": _one_of("next", "disable", "fail"),
        "max_sites": _integer(1),
    }
    _together: ClassVar[tuple[tuple[str, str], ...]] = (("certfile", "keyfile"),)

    enabled: bool = True
    """Serve /metrics."""
    addr: str = "127.0.0.1"
    """Address the /metrics endpoint binds to; loopback by default, 0.0.0.0 to be scraped from outside."""
    port: int = 9464
    """Base port; each process serves on port + LOCAL_RANK. 0 picks a free port."""
    on_port_in_use: str = "next"
    """next: try the following ports; disable: run without the exporter; fail: attach() raises."""
    per_site: bool = False
    """Add a site label to the forward/backward histograms."""
    max_sites: int = 128
    """Cap on distinct site label values; further sites are folded into site="other"."""
    certfile: str | None = None
    """TLS certificate (with keyfile) for the endpoint, served by prometheus_client."""
    keyfile: str | None = None
    """TLS private key for certfile."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class JsonlConfig:
    """jsonl: the run log, one JSON line per step and per flag."""

    _checks: ClassVar[dict[str, Check]] = {"max_bytes": _integer(1024), "backups": _integer(0)}

    path: str | None = None
    """Directory for the run log (one file per rank); None disables it."""
    max_bytes: int = 64 * 1024 * 1024
    """Rotate a file once it exceeds this size."""
    backups: int = 3
    """Rotated files kept."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """log: warnings written through the `fadiag` logger."""

    _checks: ClassVar[dict[str, Check]] = {"flag_interval_seconds": _number(lo=0)}

    flag_interval_seconds: float = 60.0
    """At most one warning per rule and site in this interval."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration.

    Example::

        cfg = load_config({"exporter": {"port": 0}, "rules": {"memory_savings": {"threshold": 0.9}}})
        fadiag.attach(cfg)
    """

    _checks: ClassVar[dict[str, Check]] = {
        "device": _one_of("auto", "cpu", "cuda", "npu"),
        # YAML 1.1 reads a bare `native: off` as false: a boolean means on/off.
        "native": Check("one of auto|on|off", lambda v: isinstance(v, bool) or v in ("auto", "on", "off")),
        "tap": Check("one of auto|on|off", lambda v: isinstance(v, bool) or v in ("auto", "on", "off")),
    }

    enabled: bool = True
    """False: attach() returns a session that patches nothing."""
    device: str = "auto"
    """Timing backend: auto (each tensor's device), cpu, cuda or npu."""
    native: str = "auto"
    """Timing marks in C++ (fadiag/capture/native.py). auto: on CUDA, built or loaded in the background
    and used from then on (Python marks until then, and wherever no C++ compiler is present);
    on: also on CPU, built at first use, waiting for it; off: Python marks only. NPU: Python.
    true and false (what YAML makes of a bare on and off) mean on and off."""
    tap: str = "auto"
    """The dispatcher tap (fadiag/capture/tap.py): measures the fused attention ops that no Python wrapper
    sees (torch.compile'd code), and times eager calls once their signature is learned (below
    autograd; the wrapper names the site). auto: a build already cached is loaded and the tap
    installed at attach() (~0.1 s), so the first step's compiled attention is measured; a build
    goes to the background (a minute or more, the first use with a torch and fadiag) and the tap
    is installed at the first step boundary after, the log naming the step it measures from; on:
    built at attach(), waiting for it; off: compiled attention is not measured and eager calls keep the wrapper's
    marks. Needs torch >= 2.9 and a C++ compiler."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    interceptors: InterceptorsConfig = field(default_factory=InterceptorsConfig)
    steps: StepsConfig = field(default_factory=StepsConfig)
    rules: RulesConfig = field(default_factory=RulesConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    jsonl: JsonlConfig = field(default_factory=JsonlConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        for name in ("native", "tap"):
            value = getattr(self, name)
            if isinstance(value, bool):
                object.__setattr__(self, name, "on" if value else "off")
        _validate(self)

    def to_dict(self) -> dict[str, Any]:
        """Every key and its value, nested as in the YAML file; `load_config()` accepts it back."""
        return dataclasses.asdict(self)


set_root(Config)
