"""Configuration: the schema (one frozen, keyword-only dataclass per section) and its loader.

`fadiag.config.loader.load_config()` builds a `Config` from defaults, a YAML file, a mapping and
overrides; the schema's classes are importable from here.
"""

from .schema import (
    Config,
    ExporterConfig,
    HangRuleConfig,
    InterceptorsConfig,
    JsonlConfig,
    LogConfig,
    MemoryRuleConfig,
    RatioRuleConfig,
    RegressionRuleConfig,
    RulesConfig,
    SamplingConfig,
    StepsConfig,
)

__all__ = [
    "Config",
    "ExporterConfig",
    "HangRuleConfig",
    "InterceptorsConfig",
    "JsonlConfig",
    "LogConfig",
    "MemoryRuleConfig",
    "RatioRuleConfig",
    "RegressionRuleConfig",
    "RulesConfig",
    "SamplingConfig",
    "StepsConfig",
]
