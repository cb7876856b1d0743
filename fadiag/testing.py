"""Test doubles shipped with fadiag: a fake Ascend stack (`torch_npu` + `torch.npu`) on CPU.

The fake follows the real signatures (op-plugin's `npu_fusion_attention`, grad_fn
`NpuFusionAttentionBackward0`, softmax stats fp32 [B, N, Sq, 8]) and the real event rules that
matter: `elapsed_time` synchronises on NPU, so the fake one raises unless `query()` was True; an
event recorded while a graph captures the stream invalidates the capture, so the fake raises;
and `current_stream().query()` is True once every event recorded has passed.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import torch


class FakeNpuEvent:
    """An NPU event the "device" passes `lag` seconds after it is recorded (`lag` as it was at
    the record), and never before an event recorded ahead of it: one stream, in order."""

    lag = 0.001
    strict = True
    created = 0
    queue_ends_ns = 0
    """When the last event recorded is passed: the stream has nothing left to run after it."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._recorded: int | None = None
        self._passed_ns = 0
        self._queried = False
        FakeNpuEvent.created += 1

    def record(self, stream: Any = None) -> None:
        if FakeNpuGraph.capturing:
            raise RuntimeError("event recorded while a graph captures the stream: capture invalidated")
        self._recorded = time.perf_counter_ns()
        self._queried = False
        self._passed_ns = max(FakeNpuEvent.queue_ends_ns, self._recorded + int(self.lag * 1e9))
        FakeNpuEvent.queue_ends_ns = self._passed_ns

    def query(self) -> bool:
        if self._recorded is None:
            return True
        done = time.perf_counter_ns() >= self._passed_ns
        self._queried = self._queried or done
        return done

    def elapsed_time(self, end: FakeNpuEvent) -> float:
        if self.strict and not (self._queried and end._queried):
            raise RuntimeError("elapsed_time before query() was True: this would synchronise the NPU")
        assert self._recorded is not None and end._recorded is not None
        return (end._recorded - self._recorded) / 1e6

    def synchronize(self) -> None:
        if self.strict:
            raise RuntimeError("Event.synchronize() on the training path: a host sync")


class FakeNpuGraph:
    """`torch.npu.NPUGraph`'s capture state, as `torch.npu.is_current_stream_capturing()` reads
    it: an event recorded while it captures raises (on a real NPU the capture is invalidated)."""

    capturing = False


class FakeNpuStream:
    """`torch.npu.current_stream()`: `query()` is True once every event recorded has passed."""

    def query(self) -> bool:
        return time.perf_counter_ns() >= FakeNpuEvent.queue_ends_ns


def _fake_npu_module() -> types.ModuleType:
    npu = types.ModuleType("torch.npu")
    npu.Event = FakeNpuEvent  # type: ignore[attr-defined]
    npu.is_available = lambda: True  # type: ignore[attr-defined]
    npu.device_count = lambda: 1  # type: ignore[attr-defined]
    npu.current_device = lambda: 0  # type: ignore[attr-defined]
    npu.current_stream = lambda device=None: FakeNpuStream()  # type: ignore[attr-defined]
    npu.is_current_stream_capturing = lambda: FakeNpuGraph.capturing  # type: ignore[attr-defined]
    npu.get_device_name = lambda device=None: "Ascend910B (fake)"  # type: ignore[attr-defined]
    npu.memory_stats = lambda device=None: {  # type: ignore[attr-defined]
        "allocated_bytes.all.current": 0, "allocated_bytes.all.peak": 0,
        "allocated_bytes.all.allocated": 0}

    def synchronize(device: Any = None) -> None:
        if FakeNpuEvent.strict:
            raise RuntimeError("torch.npu.synchronize() on the training path: a host sync")

    npu.synchronize = synchronize  # type: ignore[attr-defined]
    return npu


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, hd = t.shape
        return t.view(b, s, heads, hd // heads).transpose(1, 2)
    if layout == "SBH":
        s, b, hd = t.shape
        return t.view(s, b, heads, hd // heads).permute(1, 2, 0, 3)
    raise ValueError(f"fake npu_fusion_attention: layout {layout} not supported here")


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask.bool(), float("-inf"))  # NPU masks mark positions to drop
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    l_ = e.sum(-1, keepdim=True)
    o = (e / l_) @ v.float()
    return o.to(q.dtype), m, l_


class NpuFusionAttention(torch.autograd.Function):
    """CPU stand-in for the fused op: keeps O and the fp32 softmax stats, recomputes P in backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        o, m, l_ = _attention(q, k, v, scale, mask)
        smax = m.expand(*m.shape[:-1], 8).contiguous()
        ssum = l_.expand(*l_.shape[:-1], 8).contiguous()
        ctx.save_for_backward(q, k, v, o, smax, ssum)
        ctx.scale, ctx.mask = scale, mask
        ctx.mark_non_differentiable(smax, ssum)
        return o, smax, ssum

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        q, k, v, _o, _smax, _ssum = ctx.saved_tensors
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            o, _, _ = _attention(qq, kk, vv, ctx.scale, ctx.mask)
            dq, dk, dv = torch.autograd.grad(o, (qq, kk, vv), do)
        return dq, dk, dv, None, None


NpuFusionAttention._backward_cls.__name__ = "NpuFusionAttentionBackward0"  # type: ignore[attr-defined]


def npu_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                         input_layout: str, pse: Any = None, padding_mask: Any = None,
                         atten_mask: torch.Tensor | None = None, scale: float = 1.0,
                         keep_prob: float = 1.0, pre_tockens: int = 2147483647,
                         next_tockens: int = 2147483647, inner_precise: int = 0,
                         prefix: Any = None, actual_seq_qlen: Any = None,
                         actual_seq_kvlen: Any = None, sparse_mode: int = 0,
                         gen_mask_parallel: bool = True, sync: bool = False,
                         softmax_layout: str = "", sink: Any = None, dropout_mask: Any = None,
                         seed: int = 0, offset: int = 0) -> tuple[Any, ...]:
    """Same signature and return tuple as torch_npu's (attention_out, softmax_max, softmax_sum,
    softmax_out, seed, offset, numels); dropout is not simulated."""
    kv_heads = key.shape[-1] * head_num // query.shape[-1] if input_layout in ("BSH", "SBH") \
        else head_num
    q = _to_bnsd(query, input_layout, head_num)
    k = _to_bnsd(key, input_layout, kv_heads)
    v = _to_bnsd(value, input_layout, kv_heads)
    mask = atten_mask
    if sparse_mode in (2, 3) and mask is None:
        sq, sk = q.shape[2], k.shape[2]
        mask = torch.ones(sq, sk, dtype=torch.bool).triu(1)
    o, smax, ssum = NpuFusionAttention.apply(q, k, v, scale, mask)
    return (_from_bnsd(o, input_layout), smax, ssum, torch.empty(0), seed, offset,
            int(math.prod(q.shape[:3]) * k.shape[2]))


def _fake_torch_npu_module() -> types.ModuleType:
    mod = types.ModuleType("torch_npu")
    mod.__version__ = "2.6.0.fake"  # type: ignore[attr-defined]
    mod.npu_fusion_attention = npu_fusion_attention  # type: ignore[attr-defined]
    mod.npu_fusion_attention_v2 = npu_fusion_attention  # type: ignore[attr-defined]
    return mod


@contextlib.contextmanager
def fake_npu(lag: float = 0.001, strict: bool = True) -> Iterator[types.ModuleType]:
    """Install the fake `torch_npu` and `torch.npu` for the duration of the block.

    Example::

        with fake_npu() as torch_npu:
            fadiag.attach(device="npu", port=0)
            out = torch_npu.npu_fusion_attention(q, k, v, 8, "BSND")[0]
    """
    FakeNpuEvent.lag, FakeNpuEvent.strict, FakeNpuEvent.queue_ends_ns = lag, strict, 0
    FakeNpuGraph.capturing = False
    saved_mod = sys.modules.get("torch_npu")
    had_npu = hasattr(torch, "npu")
    saved_npu = getattr(torch, "npu", None)
    fake = _fake_torch_npu_module()
    sys.modules["torch_npu"] = fake
    torch.npu = _fake_npu_module()  # type: ignore[attr-defined]
    try:
        yield fake
    finally:
        if saved_mod is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = saved_mod
        if had_npu:
            torch.npu = saved_npu  # type: ignore[attr-defined]
        else:
            del torch.npu  # type: ignore[attr-defined]
