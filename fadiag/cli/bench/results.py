"""What a bench run is asked to measure (`BenchConfig`) and what it returns (`BenchReport`).

Plain dataclasses: `fadiag bench` prints and writes them; measure.py fills them in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

DEVICE_BACKENDS = {
    "cuda": ("flash", "efficient", "cudnn", "math"),
    "cpu": ("cpu_flash", "math"),
    "npu": ("npu_fusion", "math"),
}
"""Backends each device can run, in the order they are measured (all of them by default)."""

BACKENDS = ("flash", "efficient", "cudnn", "cpu_flash", "npu_fusion", "math")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to measure.

        report = run_bench(BenchConfig(device="cpu", seq_lens=(128, 256), heads=4, head_dim=32))
    """

    device: str = "cpu"
    """cpu, cuda or npu."""
    seq_lens: tuple[int, ...] = (128, 256, 512, 1024)
    """Sequence lengths (queries = keys: self-attention)."""
    backends: tuple[str, ...] = ()
    """Backends to measure; empty means every backend of the device (`DEVICE_BACKENDS`)."""
    dtype: str = "float32"
    """float16, bfloat16 or float32."""
    batch: int = 1
    heads: int = 32
    head_dim: int = 128
    causal: bool = False
    iters: int = 20
    """Timed iterations; the median is reported."""
    warmup: int = 5
    mha: bool = False
    """Also time nn.MultiheadAttention with need_weights=False (flash) and True (standard)."""
    memory_fraction: float = 0.9
    """Skip the math path where its estimated peak exceeds this fraction of free memory."""

    def __post_init__(self) -> None:
        if self.device not in DEVICE_BACKENDS:
            raise ValueError(f"bench.device must be one of cpu, cuda, npu, got {self.device!r}.")
        for name in ("batch", "heads", "head_dim", "iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench.{name} must be greater than 0.")
        if self.warmup < 0:
            raise ValueError("bench.warmup must be 0 or more.")
        if not self.seq_lens or min(self.seq_lens) < 1:
            raise ValueError("bench.seq_lens must be one or more positive integers.")
        if self.dtype not in DTYPES:
            raise ValueError(f"bench.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        wrong = [b for b in self.backends if b not in DEVICE_BACKENDS[self.device]]
        if wrong:
            raise ValueError(
                f"bench.backends: {', '.join(wrong)} cannot run on {self.device}; "
                f"choose from {', '.join(DEVICE_BACKENDS[self.device])}."
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError("bench.memory_fraction must be in (0, 1].")

    @property
    def backend_list(self) -> tuple[str, ...]:
        return self.backends or DEVICE_BACKENDS[self.device]


@dataclass(kw_only=True)
class BackendRow:
    """One backend at one sequence length. Times in ms (median), bytes in bytes."""

    backend: str
    seq_len: int
    batch: int
    heads: int
    head_dim: int
    dtype: str
    causal: bool
    status: str = "ok"
    """ok, unsupported (torch refused the shape), skipped (memory guard) or oom."""
    reason: str = ""
    forward_ms: float | None = None
    backward_ms: float | None = None
    ratio: float | None = None
    """backward_ms / forward_ms."""
    kept_bytes: int | None = None
    """Saved for backward, excluding storage shared with q, k, v."""
    standard_bytes: int = 0
    """`fadiag.memory.standard_bytes` for this shape: O + S + P."""
    memory_savings: float | None = None
    peak_bytes: int | None = None
    """Allocator peak above the start during forward + backward; None on CPU."""
    forward_tflops: float | None = None
    backward_tflops: float | None = None
    forward_pct_of_matmul_peak: float | None = None
    backward_pct_of_matmul_peak: float | None = None
    grad_fn: str = ""


@dataclass(kw_only=True)
class FormulaCheck:
    """The math backend's measured kept bytes against `fadiag.memory.standard_bytes`."""

    seq_len: int
    math_kept_bytes: int
    standard_bytes: int
    matrix_bytes: int
    """One [B, H, S, S] matrix in the compute dtype."""
    ratio: float
    """math_kept_bytes / standard_bytes."""


@dataclass(kw_only=True)
class MhaRow:
    """nn.MultiheadAttention fwd+bwd: need_weights=False (SDPA, flash) vs True (standard)."""

    seq_len: int
    embed_dim: int
    flash_forward_ms: float | None = None
    flash_backward_ms: float | None = None
    flash_ms: float | None = None
    standard_forward_ms: float | None = None
    standard_backward_ms: float | None = None
    standard_ms: float | None = None
    flash_over_standard: float | None = None
    status: str = "ok"
    reason: str = ""


@dataclass(kw_only=True)
class BenchReport:
    config: BenchConfig
    environment: dict[str, Any]
    matmul_tflops: float
    matmul_dtype: str
    rows: list[BackendRow] = field(default_factory=list)
    formula_checks: list[FormulaCheck] = field(default_factory=list)
    mha_rows: list[MhaRow] = field(default_factory=list)

    def skipped(self) -> list[str]:
        return [f"{r.backend} S={r.seq_len}: {r.reason}" for r in self.rows if r.status == "skipped"]

    def to_dict(self) -> dict[str, Any]:
        """The JSON document `fadiag bench --out` writes."""
        return {
            "environment": self.environment,
            "config": asdict(self.config),
            "matmul_tflops": self.matmul_tflops,
            "matmul_dtype": self.matmul_dtype,
            "rows": [asdict(r) for r in self.rows],
            "formula_check": [asdict(c) for c in self.formula_checks],
            "mha": [asdict(m) for m in self.mha_rows],
            "skipped": self.skipped(),
        }
