"""What is kept of each measured attention call: its Call, and the Signature its arguments share.

A Signature (impl, shape, kept bytes, ...) is learned once from the first call with the same
shapes, dtypes and backend flags; a Call holds one call's device marks, filled in by the training
and autograd threads. The dispatcher tap (tap.py) builds the same records for what it measures.
"""

from __future__ import annotations

import time
from typing import Any

from ..memory import standard_bytes, window_peak
from . import backends
from .attention_op import AttentionOp, CallInfo
from .graph import SavedBytes, find_fused


class Signature:
    """What is the same for every call with the same arguments' shapes, dtypes and backend flags."""

    __slots__ = ("op", "impl", "shape", "dtype", "causal", "dropout", "kv_heads", "layout",
                 "device", "standard_bytes", "kept_bytes", "peak_bytes", "fused_path",
                 "fallback_reason", "interceptor", "forward_only", "tapped")

    def __init__(self, op: AttentionOp, info: CallInfo, impl: str, device: str):
        q = info.q
        self.op = op
        self.impl = impl
        b, h, sq, sk, d = (int(x) for x in info.shape)
        self.shape: tuple[int, int, int, int, int] = (b, h, sq, sk, d)  # B, H, Sq, Sk, D
        self.dtype = str(q.dtype).replace("torch.", "")
        self.causal = info.causal
        self.dropout = info.dropout
        self.kv_heads = int(info.kv_heads)
        self.layout = info.layout
        self.device = device
        self.standard_bytes = standard_bytes(b, h, sq, sk, d, q.element_size(), info.dropout,
                                             int(info.head_dim_v))
        self.kept_bytes: int | None = None
        self.peak_bytes: int | None = None
        self.fused_path: tuple[int, ...] | None = None
        self.fallback_reason: str | None = None
        self.interceptor = op.name
        self.forward_only = False
        self.tapped = False
        """The dispatcher tap saw its fused op: its later calls are the tap's to time (tap.py)."""


class Call:
    """One measured call; its marks are filled in by the training and autograd threads."""

    __slots__ = ("sig", "site", "timer", "fwd0", "fwd1", "bwd0", "bwd1", "remaining", "host_ns",
                 "recompute", "aborted", "mem0", "probe", "saved", "key", "info", "qkv", "extra",
                 "link", "graph_backward")

    def __init__(self, site: str, timer: Any, recompute: bool, key: Any, info: CallInfo | None,
                 qkv: tuple[Any, Any, Any]):
        self.sig: Signature | None = None
        self.site = site
        self.timer = timer
        self.fwd0: Any = None
        self.fwd1: Any = None
        self.bwd0: Any = None
        self.bwd1: Any = None
        self.remaining = 0
        self.host_ns = time.monotonic_ns()
        self.recompute = recompute
        self.aborted = False
        self.mem0: dict[str, int] | None = None
        self.probe = False
        self.saved: SavedBytes | None = None
        self.key = key
        self.info = info
        self.qkv: tuple[Any, Any, Any] | None = qkv
        self.extra: Any = None  # AttentionOp.per_call's figures
        self.link = 0
        """Non-zero: the dispatcher tap times this call; its record carries this number."""
        self.graph_backward = False
        """Its backward ran while a CUDA (NPU) graph captured the stream: no mark could be taken
        (the graph's replays run it unseen), so the call is reported unmeasured."""


def learn(call: Call, op: AttentionOp, info: CallInfo, node: Any) -> Signature:
    """The Signature a signature's first call teaches: the impl that ran (the fused backward node
    found behind its output, else the math path; without a graph, SDPA's own choice), why SDPA fell
    back to math, and what the probe counted (kept bytes, the allocator's peak)."""
    impl = op.impl
    fused_path = None
    if impl is None:
        found = find_fused(node) if node is not None else None
        if found is not None:
            impl, fused_path = found
        elif node is not None:
            impl = "math"
        else:
            impl = backends.sdpa_choice(info.q, info.k, info.v, info.mask, info.dropout,
                                        info.causal, info.kv_heads != info.shape[1]) or "unknown"
    elif node is not None:
        found = find_fused(node)
        fused_path = found[1] if found is not None else None
    sig = Signature(op, info, impl, call.timer.kind)
    sig.fused_path = fused_path
    sig.forward_only = node is None
    if op.sdpa_like and impl == "math":
        sig.fallback_reason = backends.fallback_reason(
            info.q, info.k, info.v, info.mask, info.dropout, info.causal,
            info.kv_heads != info.shape[1])
    saved = call.saved
    if saved is not None:
        sig.kept_bytes = saved.total()
        if call.mem0 is not None:
            sig.peak_bytes = window_peak(call.mem0, call.timer.memory_stats())
    return sig
