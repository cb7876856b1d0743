"""The ops the dispatcher tap wraps (capture/tap.py, _native/tap.cpp), and what tap.cpp needs of
each: argument positions read from the op's schema (so torch versions may differ), and the
backends it has a kernel for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

KEYS = ("CPU", "CUDA")
"""Backends timed: an op is tapped where it has a kernel for one. torch_npu's ops are not tapped
(no Ascend hardware to check them on); on NPU the Python interceptors measure them in eager code."""


@dataclass(frozen=True)
class TapOp:
    """One dispatcher op the tap wraps: its qualified name, the impl it is, and whether it is a
    backward op. Argument positions are read from its schema, so torch versions may differ."""

    name: str
    impl: str
    backward: bool = False
    bshd: bool = False
    """(B, S, H, D) tensors, or packed (T, H, D) ones with cumulative lengths (varlen)."""


def _pair(forward: str, impl: str, bshd: bool = False,
          backward: str | None = None) -> tuple[TapOp, TapOp]:
    """A forward op and its backward op (by default the forward's name + ``_backward``)."""
    return (TapOp(forward, impl, bshd=bshd),
            TapOp(backward or forward + "_backward", impl, True, bshd))


TAP_OPS: tuple[TapOp, ...] = (
    *_pair("aten::_scaled_dot_product_flash_attention", "flash"),
    *_pair("aten::_scaled_dot_product_efficient_attention", "efficient"),
    *_pair("aten::_scaled_dot_product_cudnn_attention", "cudnn"),
    *_pair("aten::_scaled_dot_product_flash_attention_for_cpu", "cpu_flash"),
    *_pair("aten::_flash_attention_forward", "flash", True, "aten::_flash_attention_backward"),
    *_pair("aten::_efficient_attention_forward", "efficient", True,
           "aten::_efficient_attention_backward"),
    *_pair("flash_attn::_flash_attn_forward", "flash_attn", True, "flash_attn::_flash_attn_backward"),
    *_pair("flash_attn::_flash_attn_varlen_forward", "flash_attn", True,
           "flash_attn::_flash_attn_varlen_backward"),
    *_pair("flash_attn_3::_flash_attn_forward", "flash_attn3", True,
           "flash_attn_3::_flash_attn_backward"),
)

_ARGS = {
    "q": ("query", "q"), "k": ("key", "k"), "v": ("value", "v"),
    "causal": ("is_causal", "causal", "custom_mask_type"), "dropout": ("dropout_p",),
    "scale": ("scale", "softmax_scale"), "cu_q": ("cum_seq_q", "cu_seqlens_q"),
    "max_q": ("max_q", "max_seqlen_q"), "max_k": ("max_k", "max_seqlen_k"),
}
_KEPT = ("out", "logsumexp", "softmax_lse", "philox_seed", "philox_offset", "rng_state", "unused")
"""A backward op's arguments that the forward produced and kept for it (not q, k, v, the
incoming gradient, masks or sequence lengths: those are the caller's)."""
_LSE = ("logsumexp", "softmax_lse", "softmax_logsumexp", "log_sumexp")


def specs() -> list[dict[str, Any]]:
    """What tap.cpp needs of each op of TAP_OPS present here: positions from its schema, and
    the backends it has a kernel for (`backends`; an op with none is left out)."""
    out: list[dict[str, Any]] = []
    for i, op in enumerate(TAP_OPS):
        try:
            schema = torch._C._get_schema(op.name, "")
        except RuntimeError:  # not in this torch, or its library is not imported
            continue
        args = [a.name for a in schema.arguments]
        rets = [r.name for r in schema.returns]
        spec: dict[str, Any] = {"name": op.name, "overload": "", "op": i, "backward": op.backward,
                                "bshd": op.bshd}
        for field, names in _ARGS.items():
            spec[field] = next((args.index(n) for n in names if n in args), -1)
        if op.backward:
            spec["out"] = args.index("out") if "out" in args else -1
            spec["lse"] = next((args.index(n) for n in _LSE if n in args), -1)
            spec["kept"] = [j for j, n in enumerate(args) if n in _KEPT]
        else:
            spec["out"] = 0
            spec["lse"] = next((rets.index(n) for n in _LSE if n in rets), 1)
        if min(spec["q"], spec["k"], spec["v"]) < 0:
            continue
        spec["backends"] = [key for key in KEYS
                            if torch._C._dispatch_has_kernel_for_dispatch_key(op.name, key)]
        if spec["backends"]:
            out.append(spec)
    return out
