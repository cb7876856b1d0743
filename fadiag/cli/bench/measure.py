"""The training-attention benchmark: forward and backward time, kept and peak bytes per backend.

The measurement library behind `fadiag bench`; results come back as dataclasses.
"""

from __future__ import annotations

import contextlib
import platform
import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from ... import memory
from ...capture.device import available
from ...errors import FadiagError
from ...version import __version__
from ..estimate.arithmetic import human_bytes

DEVICE_BACKENDS = {
    "cuda": ("flash", "efficient", "cudnn", "math"),
    "cpu": ("cpu_flash", "math"),
    "npu": ("npu_fusion", "math"),
}
"""Backends each device can run, in the order they are measured (all of them by default)."""

BACKENDS = ("flash", "efficient", "cudnn", "cpu_flash", "npu_fusion", "math")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_SDPA = {
    "flash": "FLASH_ATTENTION",
    "cpu_flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}
_CAN_USE = {
    "flash": "can_use_flash_attention",
    "efficient": "can_use_efficient_attention",
    "cudnn": "can_use_cudnn_attention",
}
# torch.OutOfMemoryError is torch >= 2.5; the CUDA alias exists on every supported version.
_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
MATH_PEAK_MATRICES = 5
"""The math path's peak, in fp32 [B, H, Sq, Sk] matrices (measured 4.1 on an H200 at S=4096)."""


class DeviceUnavailableError(FadiagError, RuntimeError):
    """The requested device is not usable in this process."""


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


def default_device() -> str:
    """The accelerator this machine has: npu (torch_npu imports and sees one), cuda, else cpu."""
    return next(kind for kind in ("npu", "cuda", "cpu") if available(kind))


class Accelerator:
    """The bench's access to one device: clock, synchronisation, allocator peak, free memory.

    The bench owns its process, so unlike the always-on seam in `fadiag.device` it synchronises
    freely and resets the allocator's peak counter.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.device = torch.device(kind)
        self.module: Any = None if kind == "cpu" else getattr(torch, kind)

    @classmethod
    def open(cls, kind: str) -> Accelerator:
        if kind == "npu":
            try:
                import torch_npu  # noqa: F401  (registers torch.npu)
            except ImportError as e:
                raise DeviceUnavailableError(
                    f"torch_npu does not import here ({e}); run on an Ascend machine with "
                    "torch_npu installed, or use --device cpu."
                ) from None
        if kind != "cpu" and not getattr(torch, kind).is_available():
            raise DeviceUnavailableError(
                f"no {kind.upper()} device is available to torch {torch.__version__}; "
                "run on a machine with one, or use --device cpu."
            )
        return cls(kind)

    def name(self) -> str:
        if self.module is not None:
            return str(self.module.get_device_name())
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        return platform.processor() or platform.machine() or "cpu"

    def sync(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def marks(self, n: int) -> Marks:
        return Marks(self.module, n)

    def free_bytes(self) -> int:
        if self.module is None:
            import psutil

            return int(psutil.virtual_memory().available)
        return int(self.module.mem_get_info()[0])

    def start_peak(self) -> int | None:
        """Reset the allocator's peak; returns the bytes allocated now (None on CPU)."""
        if self.module is None:
            return None
        self.sync()
        self.module.reset_peak_memory_stats()
        return int(self.module.memory_allocated())

    def peak_since(self, base: int | None) -> int | None:
        if base is None:
            return None
        self.sync()
        return int(self.module.max_memory_allocated()) - base

    def empty_cache(self) -> None:
        if self.module is not None:
            self.module.empty_cache()


class Marks:
    """Pre-made timing marks: device events on CUDA/NPU, perf_counter_ns on CPU."""

    def __init__(self, module: Any, n: int):
        self._events = module is not None
        self._m: list[Any] = (
            [module.Event(enable_timing=True) for _ in range(n)] if self._events else [0] * n
        )

    def mark(self, i: int) -> None:
        if self._events:
            self._m[i].record()
        else:
            self._m[i] = time.perf_counter_ns()

    def ms(self, i: int, j: int) -> float:
        """Milliseconds from mark i to mark j; call after the device has been synchronised."""
        if self._events:
            return float(self._m[i].elapsed_time(self._m[j]))
        return (self._m[j] - self._m[i]) / 1e6


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs: QKᵀ and PV, 2·2·B·H·Sq·Sk·D, halved when causal. Backward is 2.5x this."""
    flops = 4.0 * batch * heads * seq_q * seq_k * head_dim
    return flops / 2 if causal else flops


def matmul_tflops(acc: Accelerator, dtype: torch.dtype) -> tuple[float, str]:
    """A large square matmul's TFLOP/s on the device: the reference peak (fp32 on CPU)."""
    n, dtype, warmup, iters = (1024, torch.float32, 2, 5) if acc.module is None else (
        8192, dtype, 3, 10)
    a = torch.randn(n, n, device=acc.device, dtype=dtype)
    b = torch.randn(n, n, device=acc.device, dtype=dtype)
    for _ in range(warmup):
        a @ b
    marks = acc.marks(2 * iters)
    acc.sync()
    for i in range(iters):
        marks.mark(2 * i)
        a @ b
        marks.mark(2 * i + 1)
    acc.sync()
    ms = statistics.median(marks.ms(2 * i, 2 * i + 1) for i in range(iters))
    return 2.0 * n**3 / (ms * 1e-3) / 1e12, str(dtype).removeprefix("torch.")


def attention_callable(backend: str, causal: bool, device: torch.device
                       ) -> tuple[Callable[..., torch.Tensor], contextlib.AbstractContextManager]:
    """The attention call for a backend and the context that forces that backend."""
    if backend == "npu_fusion":
        import torch_npu

        # sparse_mode=2 (top-left causal) takes the compressed 2048x2048 upper-triangle mask.
        mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), 1)

        def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            extra = {"atten_mask": mask, "sparse_mode": 2} if causal else {}
            return torch_npu.npu_fusion_attention(
                q, k, v, q.shape[1], "BNSD", scale=q.shape[-1] ** -0.5, keep_prob=1.0, **extra
            )[0]

        return fused, contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return sdpa, sdpa_kernel(getattr(SDPBackend, _SDPA[backend]))


def kept_bytes(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[int, str]:
    """Bytes `fn` saves for backward beyond q, k, v storage, and its output's grad_fn name.

    Each saved tensor's whole storage counts once (views of one storage are deduplicated).
    """
    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        saved[(str(t.device), s.data_ptr())] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(q, k, v)
    inputs = {(str(x.device), x.untyped_storage().data_ptr()) for x in (q, k, v)}
    return sum(n for key, n in saved.items() if key not in inputs), type(out.grad_fn).__name__


def time_forward_backward(acc: Accelerator, fn: Callable[[], torch.Tensor], grad: torch.Tensor,
                          inputs: tuple[torch.Tensor, ...], *, iters: int, warmup: int
                          ) -> tuple[float, float, float]:
    """Median forward, backward and forward+backward ms of `fn()` over `iters` after `warmup`.

    Backward is `torch.autograd.grad(out, inputs, grad)`: the whole backward, nothing accumulated.
    """
    for _ in range(warmup):
        torch.autograd.grad(fn(), inputs, grad)
    marks = acc.marks(3 * iters)
    acc.sync()
    for i in range(iters):
        marks.mark(3 * i)
        out = fn()
        marks.mark(3 * i + 1)
        torch.autograd.grad(out, inputs, grad)
        marks.mark(3 * i + 2)
        del out
    acc.sync()
    fwd = [marks.ms(3 * i, 3 * i + 1) for i in range(iters)]
    bwd = [marks.ms(3 * i + 1, 3 * i + 2) for i in range(iters)]
    both = [f + b for f, b in zip(fwd, bwd, strict=True)]
    return statistics.median(fwd), statistics.median(bwd), statistics.median(both)


def math_peak_estimate(batch: int, heads: int, seq_len: int) -> int:
    """Bytes the math path may need at its peak: `MATH_PEAK_MATRICES` fp32 score matrices."""
    return MATH_PEAK_MATRICES * batch * heads * seq_len * seq_len * 4


def _too_big(acc: Accelerator, cfg: BenchConfig, seq_len: int) -> str:
    need = math_peak_estimate(cfg.batch, cfg.heads, seq_len)
    free = acc.free_bytes()
    if need <= cfg.memory_fraction * free:
        return ""
    return (f"estimated peak {human_bytes(need)} ({MATH_PEAK_MATRICES} fp32 [B,H,S,S] matrices) "
            f"is more than {cfg.memory_fraction:g} of the {human_bytes(free)} free")


@contextlib.contextmanager
def _torch_warnings() -> Iterator[list[str]]:
    """Collect torch's warnings (its reasons for refusing a kernel) instead of printing them."""
    texts: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield texts
        finally:
            for w in caught:
                text = re.sub(r"\s*\(Triggered internally at .*?\)", "", str(w.message)).strip()
                if text and text not in texts:
                    texts.append(text)


def _cuda_reason(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 causal: bool) -> str:
    """torch's own debug explanation of why a CUDA SDPA backend can't take this shape."""
    check = getattr(torch.backends.cuda, _CAN_USE.get(backend, ""), None)
    params_cls = getattr(torch.backends.cuda, "SDPAParams", None)
    if check is None or params_cls is None:
        return ""
    with _torch_warnings() as texts:
        try:
            try:
                params = params_cls(q, k, v, None, 0.0, causal, False)
            except TypeError:  # torch < 2.5: no enable_gqa argument
                params = params_cls(q, k, v, None, 0.0, causal)
            check(params, True)
        except (TypeError, RuntimeError):  # an explanation only: never fail the run for it
            return ""
    return "; ".join(texts)


def _failure(e: BaseException) -> tuple[str, str]:
    """(status, first line of the message): oom for any allocator failure, else unsupported."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    oom = isinstance(e, _OOM) or "out of memory" in text.lower()  # NPU raises RuntimeError
    return ("oom" if oom else "unsupported"), text


def measure_backend(acc: Accelerator, cfg: BenchConfig, backend: str, seq_len: int,
                    peak_tflops: float) -> BackendRow:
    """Time, kept bytes and peak of one backend at one sequence length."""
    b, h, d = cfg.batch, cfg.heads, cfg.head_dim
    dtype = DTYPES[cfg.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    row = BackendRow(backend=backend, seq_len=seq_len, batch=b, heads=h, head_dim=d,
                     dtype=cfg.dtype, causal=cfg.causal,
                     standard_bytes=memory.standard_bytes(b, h, seq_len, seq_len, d, elem))
    if backend == "math" and (reason := _too_big(acc, cfg, seq_len)):
        row.status, row.reason = "skipped", reason
        return row
    q, k, v = (torch.randn(b, h, seq_len, d, device=acc.device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)
    fn, forced = attention_callable(backend, cfg.causal, acc.device)
    with forced, _torch_warnings() as texts:
        try:
            row.kept_bytes, row.grad_fn = kept_bytes(fn, q, k, v)
            fwd, bwd, _ = time_forward_backward(acc, lambda: fn(q, k, v), grad, (q, k, v),
                                                iters=cfg.iters, warmup=cfg.warmup)
            base = acc.start_peak()
            torch.autograd.grad(fn(q, k, v), (q, k, v), grad)
            row.peak_bytes = acc.peak_since(base)
        except (RuntimeError, NotImplementedError, ValueError) as e:
            row.status, row.reason = _failure(e)
    if row.status == "unsupported" and not texts and acc.kind == "cuda":
        texts.append(_cuda_reason(backend, q, k, v, cfg.causal))
    if row.status != "ok":
        row.kept_bytes, row.peak_bytes, row.grad_fn = None, None, ""
        why = "; ".join(t for t in texts if t)
        row.reason = f"{row.reason} ({why})" if why else row.reason
        return row
    flops = attention_flops(b, h, seq_len, seq_len, d, cfg.causal)
    row.forward_ms, row.backward_ms, row.ratio = fwd, bwd, bwd / fwd
    row.memory_savings = memory.savings(row.kept_bytes or 0, row.standard_bytes)
    row.forward_tflops = flops / (fwd * 1e-3) / 1e12
    row.backward_tflops = 2.5 * flops / (bwd * 1e-3) / 1e12
    row.forward_pct_of_matmul_peak = 100 * row.forward_tflops / peak_tflops
    row.backward_pct_of_matmul_peak = 100 * row.backward_tflops / peak_tflops
    return row


def measure_mha(acc: Accelerator, cfg: BenchConfig, seq_len: int) -> MhaRow:
    """The seed's nn.MultiheadAttention benchmark done right: fwd+bwd, flash vs standard."""
    embed = cfg.heads * cfg.head_dim
    dtype = DTYPES[cfg.dtype]
    row = MhaRow(seq_len=seq_len, embed_dim=embed)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(embed, cfg.heads, batch_first=True, device=acc.device,
                                      dtype=dtype).train()
    x = torch.randn(cfg.batch, seq_len, embed, device=acc.device, dtype=dtype)
    grad = torch.randn_like(x)
    params = tuple(mha.parameters())
    try:
        # need_weights=False routes through SDPA (flash); True computes bmm + softmax weights.
        row.flash_forward_ms, row.flash_backward_ms, row.flash_ms = time_forward_backward(
            acc, lambda: mha(x, x, x, need_weights=False)[0], grad, params,
            iters=cfg.iters, warmup=cfg.warmup)
        if reason := _too_big(acc, cfg, seq_len):
            row.status, row.reason = "skipped", f"standard attention: {reason}"
            return row
        row.standard_forward_ms, row.standard_backward_ms, row.standard_ms = (
            time_forward_backward(acc, lambda: mha(x, x, x, need_weights=True)[0], grad, params,
                                  iters=cfg.iters, warmup=cfg.warmup))
        row.flash_over_standard = row.flash_ms / row.standard_ms
    except RuntimeError as e:  # out of memory (CUDA's error is a RuntimeError too)
        row.status, row.reason = _failure(e)
    return row


def environment(acc: Accelerator) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": acc.kind,
        "device_name": acc.name(),
        "torch": torch.__version__,
        "fadiag": __version__,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if acc.kind == "cuda":
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    if acc.kind == "npu":
        import torch_npu

        env["torch_npu"] = getattr(torch_npu, "__version__", "unknown")
    return env


def total_steps(cfg: BenchConfig) -> int:
    """Progress steps `run_bench` reports: the matmul peak, each (S, backend), each MHA S."""
    return 1 + len(cfg.seq_lens) * (len(cfg.backend_list) + (1 if cfg.mha else 0))


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> BenchReport:
    """Measure every backend at every sequence length; `progress(description)` precedes each step.

    Raises DeviceUnavailableError when `cfg.device` can't be used here.
    """
    tick = progress or (lambda _: None)
    acc = Accelerator.open(cfg.device)
    torch.manual_seed(0)
    tick("matmul peak")
    peak, peak_dtype = matmul_tflops(acc, DTYPES[cfg.dtype])
    report = BenchReport(config=cfg, environment=environment(acc), matmul_tflops=peak,
                         matmul_dtype=peak_dtype)
    elem = torch.empty((), dtype=DTYPES[cfg.dtype]).element_size()
    for seq_len in cfg.seq_lens:
        for backend in cfg.backend_list:
            tick(f"{backend} S={seq_len}")
            row = measure_backend(acc, cfg, backend, seq_len, peak)
            acc.empty_cache()
            report.rows.append(row)
            if backend == "math" and row.kept_bytes is not None:
                report.formula_checks.append(FormulaCheck(
                    seq_len=seq_len, math_kept_bytes=row.kept_bytes,
                    standard_bytes=row.standard_bytes,
                    matrix_bytes=cfg.batch * cfg.heads * seq_len * seq_len * elem,
                    ratio=row.kept_bytes / row.standard_bytes))
    if cfg.mha:
        for seq_len in cfg.seq_lens:
            tick(f"MultiheadAttention S={seq_len}")
            report.mha_rows.append(measure_mha(acc, cfg, seq_len))
            acc.empty_cache()
    return report

