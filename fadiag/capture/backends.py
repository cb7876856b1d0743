"""Which attention backend really ran, and why SDPA fell back to the math path.

Asks torch itself: `torch._fused_sdp_choice` (the selector SDPA uses), the backward node names,
and `torch.backends.cuda.can_use_*` with debug output for the reason.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

_CHOICE = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}

# Substrings of fused backward node names; checked in order (the CPU flash node contains "Flash").
_NODE_IMPLS = (
    ("FlashAttentionForCpu", "cpu_flash"),
    ("FlashAttention", "flash"),
    ("EfficientAttention", "efficient"),
    ("CudnnAttention", "cudnn"),
    ("OverrideableAttention", "overrideable"),
    ("NpuFusionAttention", "npu_fusion"),
)


def _flag_getters() -> tuple[Any, Any, Any, Any]:
    c, b = torch._C, torch.backends.cuda
    try:  # the C getters behind torch.backends.cuda.*_sdp_enabled(), without the Python frames
        return (c._get_flash_sdp_enabled, c._get_mem_efficient_sdp_enabled,
                c._get_math_sdp_enabled, c._get_cudnn_sdp_enabled)
    except AttributeError:
        return (b.flash_sdp_enabled, b.mem_efficient_sdp_enabled, b.math_sdp_enabled,
                b.cudnn_sdp_enabled)


_FLASH, _EFFICIENT, _MATH, _CUDNN = _flag_getters()


def backend_flags() -> tuple[bool, bool, bool, bool]:
    """The global SDPA backend switches (also set by `sdpa_kernel`); part of a call's signature."""
    return (_FLASH(), _EFFICIENT(), _MATH(), _CUDNN())


def sdpa_choice(q: Any, k: Any, v: Any, mask: Any, dropout: float, causal: bool,
                enable_gqa: bool = False) -> str | None:
    """The backend SDPA will pick for these arguments, by torch's own selector."""
    try:
        idx = torch._fused_sdp_choice(q, k, v, mask, dropout, causal, enable_gqa=enable_gqa)
    except Exception:
        return None
    name = _CHOICE.get(int(idx))
    if name == "flash" and q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type == "npu" and name not in (None, "math"):
        return "npu_fusion"
    return name


def impl_of_node(node: Any) -> str | None:
    """The fused backend whose backward node `node` is, else None."""
    name = type(node).__name__
    for needle, impl in _NODE_IMPLS:
        if needle in name:
            return impl
    return None


def fallback_reason(q: Any, k: Any, v: Any, mask: Any, dropout: float, causal: bool,
                    enable_gqa: bool = False) -> str:
    """Why the fused backends can't run this call, in torch's words where it gives them."""
    reasons = []
    flags = backend_flags()
    if not any(flags[:2]) and not flags[3]:
        reasons.append("fused backends are disabled (sdpa_kernel / torch.backends.cuda.enable_*_sdp)")
    elif q.device.type == "cpu" and not flags[0]:
        reasons.append("the CPU flash kernel is disabled (sdpa_kernel / enable_flash_sdp(False))")
    if mask is not None and isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        reasons.append(f"attn_mask is {str(mask.dtype).replace('torch.', '')}; a bool mask or "
                       "is_causal=True lets fused kernels run")
    if q.device.type == "cuda":
        reasons.extend(_cuda_debug_reasons(q, k, v, mask, dropout, causal, enable_gqa))
    if q.dtype == torch.float32 and q.device.type == "cuda":
        reasons.append("float32 inputs: flash and cuDNN need fp16/bf16")
    return "; ".join(dict.fromkeys(reasons)) or "torch's selector chose the math path"


def _cuda_debug_reasons(q: Any, k: Any, v: Any, mask: Any, dropout: float, causal: bool,
                        enable_gqa: bool) -> list[str]:
    out: list[str] = []
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout, causal, enable_gqa)
    except Exception:
        return out
    for check in ("can_use_flash_attention", "can_use_efficient_attention",
                  "can_use_cudnn_attention"):
        fn = getattr(torch.backends.cuda, check, None)
        if fn is None:
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ok = fn(params, True)
            except Exception:
                continue
        if not ok:
            text = " ".join(str(w.message).splitlines()[0] for w in caught)
            if text:
                out.append(f"{check.removeprefix('can_use_')}: {text}")
    return out
