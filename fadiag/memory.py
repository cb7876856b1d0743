"""The memory model: what standard attention keeps for backward, and what flash-style kernels keep.

One documented formula, used by the recorder for `standard_bytes`, by `fadiag estimate`, and
compared with the real math backend by `fadiag bench` (no dropout, query heads = key heads: the
bench varies neither; with dropout or GQA the math path keeps more than this model, e.g. a
dropout mask in fp32 on CPU and an expanded v).
"""

from __future__ import annotations

LSE_BYTES = 4
"""logsumexp is kept in fp32 by the CUDA and CPU flash-style kernels. Ascend's
npu_fusion_attention keeps softmax_max and softmax_sum instead, each fp32 [B, N, Sq, 8]: 64 bytes
a query row, which `flash_kept_bytes` does not model (the recorder measures what is really kept)."""


def standard_bytes(
    batch: int,
    heads: int,
    seq_q: int,
    seq_k: int,
    head_dim: int,
    elem_size: int,
    dropout: float = 0.0,
    head_dim_v: int | None = None,
) -> int:
    """Bytes standard (unfused) attention keeps from forward for backward, beyond q, k, v.

    O [B, H, Sq, Dv] plus S and P, each [B, H, Sq, Sk], all in the compute dtype, plus a one-byte
    dropout mask [B, H, Sq, Sk] when dropout > 0::

        standard = B*H*Sq*Dv*e + 2*B*H*Sq*Sk*e + (B*H*Sq*Sk if dropout > 0)
    """
    dv = head_dim if head_dim_v is None else head_dim_v
    matrix = batch * heads * seq_q * seq_k
    out = batch * heads * seq_q * dv * elem_size
    mask = matrix if dropout > 0.0 else 0
    return out + 2 * matrix * elem_size + mask


def flash_bytes(
    batch: int,
    heads: int,
    seq_q: int,
    head_dim: int,
    elem_size: int,
    dropout: float = 0.0,
    head_dim_v: int | None = None,
) -> int:
    """Bytes a flash-style kernel keeps beyond q, k, v: O plus an fp32 logsumexp per query row.

    The dropout RNG state (seed, offset: 16 bytes) is kept instead of a mask.
    """
    dv = head_dim if head_dim_v is None else head_dim_v
    rng = 16 if dropout > 0.0 else 0
    return batch * heads * seq_q * (dv * elem_size + LSE_BYTES) + rng


def savings(kept: int, standard: int) -> float:
    """1 - kept / standard."""
    return 1.0 - kept / standard


def scores_bytes(batch: int, heads: int, seq_q: int, seq_k: int, elem_size: int = 4) -> int:
    """One [B, H, Sq, Sk] score matrix: what an unfused path materializes at least once per pass
    (eager flex_attention computes scores in fp32, fp64 for fp64 inputs)."""
    return batch * heads * seq_q * seq_k * elem_size


def window_peak(before: dict[str, int], after: dict[str, int]) -> int:
    """Peak bytes above `before["current"]` in the window, without resetting the user's peak.

    If the allocator's all-time peak rose in the window, the window peak is exactly the new peak;
    otherwise it lies in [max(A0, A1), A0 + (C1 - C0)] and the upper bound is returned.
    """
    a0 = before["current"]
    if after["peak"] > before["peak"]:
        return after["peak"] - a0
    upper = a0 + (after["allocated"] - before["allocated"])
    return max(0, min(upper, before["peak"]) - a0)
