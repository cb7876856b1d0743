"""The table of attention implementations fadiag intercepts.

Each `AttentionOp` says where the function lives, how to read (B, H, Sq, Sk, D), causal and
dropout from its arguments, and which tensor of its result starts the backward. Supporting a new
implementation is adding one entry to `OPS` (or calling `fadiag.instrument`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from . import flex
from .attention_op import AttentionOp, CallInfo, Reader, _bhsd, _opt, first_tensor


def read_sdpa(args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallInfo:
    q = _opt(kwargs, args, 0, "query", None)
    k = _opt(kwargs, args, 1, "key", None)
    v = _opt(kwargs, args, 2, "value", None)
    mask = _opt(kwargs, args, 3, "attn_mask", None)
    dropout = float(_opt(kwargs, args, 4, "dropout_p", 0.0))
    causal = bool(_opt(kwargs, args, 5, "is_causal", False))
    shape, dv, kvh = _bhsd(q, k, v)
    return CallInfo(q, k, v, shape, dv, kvh, causal, dropout, "BHSD", mask,
                    (mask,) if isinstance(mask, torch.Tensor) else ())


def quick_sdpa(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """q, k, v and the other arguments that change SDPA's choice of kernel, read cheaply."""
    n = len(args)
    if n >= 3:  # q, k, v by position (nearly every caller); the flags either way
        get = kwargs.get
        mask = args[3] if n > 3 else get("attn_mask")
        dropout = args[4] if n > 4 else get("dropout_p", 0.0)
        causal = args[5] if n > 5 else get("is_causal", False)
        q, k, v = args[0], args[1], args[2]
    else:
        q = _opt(kwargs, args, 0, "query", None)
        k = _opt(kwargs, args, 1, "key", None)
        v = _opt(kwargs, args, 2, "value", None)
        mask = _opt(kwargs, args, 3, "attn_mask", None)
        dropout = _opt(kwargs, args, 4, "dropout_p", 0.0)
        causal = _opt(kwargs, args, 5, "is_causal", False)
    # scale and enable_gqa are keyword-only
    return q, k, v, (bool(causal), dropout > 0.0, mask_key(mask),
                     bool(kwargs.get("enable_gqa", False)) if kwargs else False)


def mask_key(mask: Any) -> Any:
    if isinstance(mask, torch.Tensor):
        return (mask.dtype, mask.shape, mask.requires_grad)
    return mask is not None


def read_bshd(q: Any, k: Any, v: Any, causal: bool, dropout: float) -> CallInfo:
    """(B, S, H, D) tensors, as flash_attn takes them."""
    b, sq, h, d = q.shape
    return CallInfo(q, k, v, (b, h, sq, k.shape[1], d), v.shape[-1], k.shape[2], causal, dropout,
                    "BSHD")


def read_flash_attn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallInfo:
    q, k, v = args[0], args[1], args[2]
    dropout = float(_opt(kwargs, args, 3, "dropout_p", 0.0))
    causal = bool(_opt(kwargs, args, 5, "causal", False))
    return read_bshd(q, k, v, causal, dropout)


def read_flash_attn_varlen(args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallInfo:
    """(T, H, D) packed sequences; Sq/Sk are the max lengths, so standard bytes are an upper bound."""
    q, k, v = args[0], args[1], args[2]
    cu_q = _opt(kwargs, args, 3, "cu_seqlens_q", None)
    max_q = int(_opt(kwargs, args, 5, "max_seqlen_q", q.shape[0]))
    max_k = int(_opt(kwargs, args, 6, "max_seqlen_k", k.shape[0]))
    dropout = float(_opt(kwargs, args, 7, "dropout_p", 0.0))
    causal = bool(_opt(kwargs, args, 9, "causal", False))
    batch = (cu_q.shape[0] - 1) if cu_q is not None else 1
    return CallInfo(q, k, v, (batch, q.shape[1], max_q, max_k, q.shape[2]), v.shape[-1],
                    k.shape[1], causal, dropout, "TND")


def read_npu_fusion(args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallInfo:
    """torch_npu.npu_fusion_attention(query, key, value, head_num, input_layout, …)."""
    q = _opt(kwargs, args, 0, "query", None)
    k = _opt(kwargs, args, 1, "key", None)
    v = _opt(kwargs, args, 2, "value", None)
    heads = int(_opt(kwargs, args, 3, "head_num", 1))
    layout = str(_opt(kwargs, args, 4, "input_layout", "BSND"))
    keep_prob = float(kwargs.get("keep_prob", 1.0))
    sparse_mode = int(kwargs.get("sparse_mode", 0))
    next_tockens = int(kwargs.get("next_tockens", 2147483647))
    mask = kwargs.get("atten_mask")
    causal = sparse_mode in (2, 3) or (mask is not None and next_tockens == 0)
    if layout == "BNSD":
        b, h, sq, d = q.shape
        sk, kvh, dv = k.shape[2], k.shape[1], v.shape[3]
    elif layout == "BSND":
        b, sq, h, d = q.shape
        sk, kvh, dv = k.shape[1], k.shape[2], v.shape[3]
    elif layout in ("BSH", "SBH"):
        if layout == "BSH":
            b, sq, hd = q.shape
            sk = k.shape[1]
        else:
            sq, b, hd = q.shape
            sk = k.shape[0]
        h, d = heads, hd // heads
        kvh = k.shape[-1] // d
        dv = v.shape[-1] // kvh
    elif layout == "TND":
        lens_q = list(kwargs.get("actual_seq_qlen") or [q.shape[0]])
        lens_k = list(kwargs.get("actual_seq_kvlen") or [k.shape[0]])
        b, h, d = len(lens_q), q.shape[1], q.shape[2]
        sq = max(e - s for s, e in zip([0] + lens_q[:-1], lens_q, strict=True))
        sk = max(e - s for s, e in zip([0] + lens_k[:-1], lens_k, strict=True))
        kvh, dv = k.shape[1], v.shape[2]
    else:
        raise ValueError(f"unknown input_layout {layout!r}")
    return CallInfo(q, k, v, (b, h, sq, sk, d), dv, kvh, causal, 1.0 - keep_prob, layout, mask,
                    (mask,) if isinstance(mask, torch.Tensor) else ())


def read_hf(args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallInfo:
    """HF attention interface: fn(module, query, key, value, attention_mask, dropout=…, …)."""
    q = _opt(kwargs, args, 1, "query", None)
    k = _opt(kwargs, args, 2, "key", None)
    v = _opt(kwargs, args, 3, "value", None)
    mask = _opt(kwargs, args, 4, "attention_mask", None)
    dropout = float(kwargs.get("dropout", 0.0) or 0.0)
    module = args[0] if args else None
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", False)
    shape, dv, kvh = _bhsd(q, k, v)
    return CallInfo(q, k, v, shape, dv, kvh, bool(causal), dropout, "BHSD", mask,
                    (mask,) if isinstance(mask, torch.Tensor) else ())


LAYOUTS = ("BHSD", "BSHD", "BSH", "SBH", "BNSD", "BSND", "TND")


_CAUSAL_NAMES = ("is_causal", "causal")


def causal_reader(fn: Any = None, causal_arg: int | str | None = None
                  ) -> Callable[[tuple[Any, ...], dict[str, Any]], bool]:
    """How a call of the user's op says causal: `Fn.apply(q, k, v, True)` takes no keywords.

    `causal_arg` is the argument's position in the call (0 = the first, q) or its parameter
    name; None finds a parameter named is_causal or causal in the signature of `fn` (an
    autograd Function's forward, less ctx, or the function). Read by position or keyword, with
    the parameter's default when the call leaves it out; keywords alone when nothing is known.
    """
    function = isinstance(fn, type) and issubclass(fn, torch.autograd.Function)
    target = fn.forward if function else fn
    offset = 1 if function else 0  # the wrapped apply() is called with the class first
    params: list[inspect.Parameter] = []
    if target is not None:
        try:
            params = list(inspect.signature(target).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature
            params = []
        if function:
            params = params[1:]  # ctx
    names = [p.name for p in params]
    if isinstance(causal_arg, str) and causal_arg not in names and params:
        raise ValueError(f"causal_arg {causal_arg!r} is not a parameter of {fn!r}; "
                         f"its parameters are {', '.join(names)}")
    if isinstance(causal_arg, int):
        position: int | None = causal_arg
        name = names[causal_arg] if causal_arg < len(names) else None
    else:
        name = causal_arg if causal_arg is not None else next(
            (n for n in _CAUSAL_NAMES if n in names), None)
        position = names.index(name) if name in names else None
    default = False
    if name in names:
        p = params[names.index(name)]
        if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD, p.VAR_POSITIONAL):
            position = None
        if p.default is not p.empty:
            default = bool(p.default)

    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if position is not None and len(args) > position + offset:
            return bool(args[position + offset])
        if name is not None and name in kwargs:
            return bool(kwargs[name])
        if name is None:
            return bool(kwargs.get("is_causal", kwargs.get("causal", False)))
        return default

    return read


def reader_for_layout(layout: str, heads: int | None = None, fn: Any = None,
                      causal_arg: int | str | None = None) -> Reader:
    """A reader for a user op whose first three tensor arguments are q, k, v in `layout`, and
    whose causal flag `causal_reader(fn, causal_arg)` finds."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout in ("BSH", "SBH") and not heads:
        raise ValueError(f"layout {layout} needs heads= (the number of query heads)")
    if causal_arg is not None and (isinstance(causal_arg, bool) or not (
            isinstance(causal_arg, str) and causal_arg
            or isinstance(causal_arg, int) and causal_arg >= 0)):
        raise ValueError(f"causal_arg must be a position (an integer >= 0) or a parameter name, "
                         f"got {causal_arg!r}")
    read_causal = causal_reader(fn, causal_arg)

    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallInfo:
        tensors = [a for a in args if isinstance(a, torch.Tensor)][:3]
        tensors += [kwargs[n] for n in ("q", "k", "v", "query", "key", "value")
                    if isinstance(kwargs.get(n), torch.Tensor)]
        q, k, v = tensors[:3]
        causal = read_causal(args, kwargs)
        dropout = float(kwargs.get("dropout_p", kwargs.get("dropout", 0.0)) or 0.0)
        if layout == "BHSD":
            shape, dv, kvh = _bhsd(q, k, v)
            return CallInfo(q, k, v, shape, dv, kvh, causal, dropout, layout)
        if layout in ("BSHD", "BSND"):
            info = read_bshd(q, k, v, causal, dropout)
            info.layout = layout
            return info
        npu_kwargs = {"input_layout": layout, "keep_prob": 1.0 - dropout}
        info = read_npu_fusion((q, k, v, heads or 1), npu_kwargs)
        info.causal = causal
        return info

    return read


OPS: tuple[AttentionOp, ...] = (
    AttentionOp(
        name="sdpa",
        config_key="sdpa",
        targets=("torch.nn.functional:scaled_dot_product_attention",),
        read=read_sdpa,
        sdpa_like=True,
        quick=quick_sdpa,
        tap_times=True,
    ),
    AttentionOp(
        name="flash_attn_func",
        config_key="flash_attn",
        targets=("flash_attn:flash_attn_func", "flash_attn.flash_attn_interface:flash_attn_func"),
        read=read_flash_attn,
        impl="flash_attn",
        output=first_tensor,
        tap_times=True,
    ),
    AttentionOp(
        name="flash_attn_varlen_func",
        config_key="flash_attn",
        targets=("flash_attn:flash_attn_varlen_func",
                 "flash_attn.flash_attn_interface:flash_attn_varlen_func"),
        read=read_flash_attn_varlen,
        impl="flash_attn",
        output=first_tensor,
        tap_times=True,
    ),
) + tuple(
    AttentionOp(
        name=f"npu_fusion_attention{suffix}",
        config_key="npu",
        targets=(f"torch_npu:npu_fusion_attention{suffix}",),
        read=read_npu_fusion,
        impl="npu_fusion",
        output=first_tensor,
    )
    for suffix in ("", "_v2", "_v3")
)


OPS += (flex.EAGER, flex.COMPILED)


def resolve_target(target: str, import_missing: bool) -> tuple[Any, str] | None:
    """(owner object, attribute) for ``"module:attr"``, or None when it is not there."""
    module_name, attr = target.split(":")
    module = sys.modules.get(module_name)
    if module is None and import_missing:
        try:
            module = importlib.import_module(module_name)
        except Exception:
            return None
    if module is None or not hasattr(module, attr):
        return None
    return module, attr
