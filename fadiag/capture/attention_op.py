"""What an entry of the op table is, and what reading one call gives.

`AttentionOp` says where an attention function lives and how to read its calls; its reader
returns a `CallInfo` (q, k, v, shape, causal, dropout). The helpers every reader shares are here
too, so that ops.py (the table) and flex.py (FlexAttention's entries) both build on this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


class CallInfo:
    """What one call's arguments say: its q, k, v, other tensor inputs and shape."""

    __slots__ = ("q", "k", "v", "others", "shape", "head_dim_v", "kv_heads", "causal", "dropout",
                 "layout", "mask")

    def __init__(self, q: Any, k: Any, v: Any, shape: tuple[int, int, int, int, int],
                 head_dim_v: int, kv_heads: int, causal: bool, dropout: float, layout: str,
                 mask: Any = None, others: Sequence[Any] = ()):
        self.q, self.k, self.v = q, k, v
        self.shape = shape
        self.head_dim_v = head_dim_v
        self.kv_heads = kv_heads
        self.causal = causal
        self.dropout = dropout
        self.layout = layout
        self.mask = mask
        self.others = others


Reader = Callable[[tuple[Any, ...], dict[str, Any]], CallInfo]


@dataclass(frozen=True)
class AttentionOp:
    """One attention implementation: where it lives and how to read its calls.

    `targets` are ``"module:attr"`` strings; `config_key` names the `interceptors.*` switch.
    `output` picks the attention output tensor from the function's result.
    """

    name: str
    config_key: str
    targets: tuple[str, ...]
    read: Reader
    impl: str | None = None
    """Fixed impl name; None: ask torch which SDPA backend ran (fadiag.capture.backends)."""
    output: Callable[[Any], Any] = field(default=lambda out: out)
    sdpa_like: bool = False
    tap_times: bool = False
    """Its call is one fused op and nothing of the caller's: once the dispatcher tap has seen that
    op serve a signature, the tap times its calls (an `instrument()`'d Function is not: its
    backward is the user's, whatever it does besides the fused op)."""
    quick: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, Any, Any, Any]] | None = None
    """Optional cheap reader for the hot path: (q, k, v, what else tells calls apart);
    `read` then runs only on a call signature's first sighting."""
    per_call: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None
    """Optional per-call figures, read before the call's timed window; an object whose
    `resolve()` gives CallRecord fields once the device has passed the call (flex: sparsity)."""
    prepare: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    """Optional: wraps the original function before the recorder's wrapper does."""
    install: Callable[[Any, Any], None] | None = None
    """Optional wiring at attach(), given the session's Patcher and Recorder (for an op that is
    not a module attribute, e.g. what torch.compile returns for flex_attention)."""


def _opt(kwargs: dict[str, Any], args: tuple[Any, ...], i: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _bhsd(q: Any, k: Any, v: Any) -> tuple[tuple[int, int, int, int, int], int, int]:
    """(…, H, S, D) tensors, as SDPA takes them; 3-D is (B, S, D) with one head."""
    if q.is_nested:
        b = q.size(0)
        h = q.size(1) if q.dim() == 4 else 1
        return (b, h, 0, 0, q.size(-1)), v.size(-1), h
    qs, ks = q.shape, k.shape
    if q.dim() == 3:
        return (qs[0], 1, qs[1], ks[1], qs[2]), v.shape[-1], 1
    b = 1
    for d in qs[:-3]:
        b *= d
    return (b, qs[-3], qs[-2], ks[-2], qs[-1]), v.shape[-1], ks[-3]


def first_tensor(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out
