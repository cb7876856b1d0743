"""The training-attention benchmark: forward and backward time, kept and peak bytes per backend.

The measurement library behind `fadiag bench`; results come back as dataclasses.
"""

from __future__ import annotations

import contextlib
import platform
import re
import statistics
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import torch

from ... import memory
from ...capture.device import available
from ...version import __version__
from ..estimate.arithmetic import human_bytes
from .accelerator import Accelerator
from .results import (
    DTYPES,
    BackendRow,
    BenchConfig,
    BenchReport,
    FormulaCheck,
    MhaRow,
)

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


def default_device() -> str:
    """The accelerator this machine has: npu (torch_npu imports and sees one), cuda, else cpu."""
    return next(kind for kind in ("npu", "cuda", "cpu") if available(kind))


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

