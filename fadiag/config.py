"""fadiag's configuration: one frozen, keyword-only dataclass per component.

`load_config()` builds a `Config` from defaults, a YAML file, a dict and overrides, and rejects
unknown keys and bad values with a `ConfigError` naming the dotted key.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    every_n_steps: int = 1
    """Measure one step in N (1 = every step). Unmeasured steps cost one branch per call."""


@dataclass(frozen=True, kw_only=True)
class InterceptorsConfig:
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


@dataclass(frozen=True, kw_only=True)
class StepsConfig:
    history: int = 256
    """How many resolved StepReports to keep in memory."""
    fallback_after: int = 32
    """With no optimizer step seen, after this many micro-batches each forward-after-backward ends a step."""
    record_no_grad: bool = False
    """Record attention calls made under no_grad (evaluation); off: they are not measured."""
    max_calls_per_step: int = 4096
    """Calls beyond this in one step are counted but not measured (bounds memory)."""


@dataclass(frozen=True, kw_only=True)
class RatioRuleConfig:
    enabled: bool = True
    threshold: float = 3.0
    """Flag when backward seconds / forward seconds exceeds this."""
    min_forward_seconds: float = 0.0
    """Ignore sites whose forward time is below this (microsecond noise); 0 keeps the rule as written."""


@dataclass(frozen=True, kw_only=True)
class MemoryRuleConfig:
    enabled: bool = True
    threshold: float = 0.8
    """Flag when memory savings (1 - kept / standard) fall below this."""


@dataclass(frozen=True, kw_only=True)
class RegressionRuleConfig:
    enabled: bool = True
    tolerance: float = 0.2
    """Flag when attention time exceeds the baseline by more than this fraction."""
    consecutive: int = 5
    """...for this many consecutive steps."""
    warmup_steps: int = 10
    """Steps skipped before the rolling baseline starts collecting."""
    window: int = 50
    """Steps in the rolling baseline (median)."""
    baseline_file: str | None = None
    """A baseline written by `fadiag baseline save`; replaces the rolling baseline where it matches."""


@dataclass(frozen=True, kw_only=True)
class HangRuleConfig:
    enabled: bool = True
    timeout_seconds: float = 300.0
    """Flag when the oldest unfinished attention call is older than this."""


@dataclass(frozen=True, kw_only=True)
class RulesConfig:
    backward_forward_ratio: RatioRuleConfig = field(default_factory=RatioRuleConfig)
    memory_savings: MemoryRuleConfig = field(default_factory=MemoryRuleConfig)
    regression: RegressionRuleConfig = field(default_factory=RegressionRuleConfig)
    hang: HangRuleConfig = field(default_factory=HangRuleConfig)
    per_site: bool = True
    """Evaluate the ratio and memory rules per call site as well as for the step total."""


@dataclass(frozen=True, kw_only=True)
class ExporterConfig:
    enabled: bool = True
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


@dataclass(frozen=True, kw_only=True)
class JsonlConfig:
    path: str | None = None
    """Directory for the run log (one file per rank); None disables it."""
    max_bytes: int = 64 * 1024 * 1024
    """Rotate a file once it exceeds this size."""
    backups: int = 3
    """Rotated files kept."""


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    flag_interval_seconds: float = 60.0
    """At most one warning per rule and site in this interval."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration.

    Example::

        cfg = load_config({"exporter": {"port": 0}, "rules": {"memory_savings": {"threshold": 0.9}}})
        fadiag.attach(cfg)
    """

    enabled: bool = True
    """False: attach() returns a session that patches nothing."""
    device: str = "auto"
    """Timing backend: auto (each tensor's device), cpu, cuda or npu."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    interceptors: InterceptorsConfig = field(default_factory=InterceptorsConfig)
    steps: StepsConfig = field(default_factory=StepsConfig)
    rules: RulesConfig = field(default_factory=RulesConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    jsonl: JsonlConfig = field(default_factory=JsonlConfig)
    log: LogConfig = field(default_factory=LogConfig)
