"""What attention keeps for backward in a whole model: standard (unfused) versus flash-style.

Pure arithmetic over `fadiag.memory`; `fadiag estimate` prints it, `fadiag bench` measures it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ... import memory

ELEMENT_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
}
"""Bytes per element of each compute dtype `estimate` accepts (names as in `torch.<name>`)."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The attention shape of a model, as given to ``fadiag estimate``.

        shape = ModelShape(seq_len=4096, heads=32, head_dim=128, layers=32)
        estimate(shape).standard_bytes_total   # 32 * (2 GiB + 32 MiB)
    """

    seq_len: int
    """Sequence length of queries and keys (self-attention)."""
    heads: int
    """Query heads; the kept matrices and the output scale with these."""
    head_dim: int
    """Head dimension of q, k and v."""
    layers: int
    """Attention layers in the model; totals are per-layer figures times this."""
    batch: int = 1
    """Sequences per micro-batch."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means equal to `heads`."""
    dtype: str = "float16"
    """Compute dtype of q, k, v, O, S and P (a key of `ELEMENT_BYTES`)."""
    dropout: float = 0.0
    """Attention dropout probability; above 0 standard attention also keeps a one-byte mask."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "heads", "head_dim", "layers", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(
                f"kv_heads must be a positive divisor of heads ({self.heads}), got {self.kv_heads}."
            )
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(ELEMENT_BYTES)}, got {self.dtype!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}.")


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Bytes per layer and for all layers; every field name says its unit and scope."""

    shape: ModelShape
    element_bytes: int
    q_bytes_per_layer: int
    k_bytes_per_layer: int
    v_bytes_per_layer: int
    output_bytes_per_layer: int
    s_matrix_bytes_per_layer: int
    """One [B, H, S, S] matrix in the compute dtype (S = QKᵀ; P = softmax(S) has the same size)."""
    s_plus_p_bytes_per_layer: int
    """S and P together: the two matrices standard attention keeps."""
    dropout_mask_bytes_per_layer: int
    logsumexp_bytes_per_layer: int
    standard_bytes_per_layer: int
    flash_bytes_per_layer: int
    standard_bytes_total: int
    flash_bytes_total: int
    memory_savings: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        """Flat, self-describing numbers for ``--json``: the inputs echoed, then the bytes."""
        d = asdict(self)
        shape = d.pop("shape")
        shape["kv_heads"] = self.kv_heads
        return {**shape, **d}

    @property
    def kv_heads(self) -> int:
        return self.shape.kv_heads or self.shape.heads


def estimate(shape: ModelShape) -> Estimate:
    """Standard vs flash kept bytes for `shape`, from `fadiag.memory` (the one formula)."""
    b, h, s, d = shape.batch, shape.heads, shape.seq_len, shape.head_dim
    hkv = shape.kv_heads or h
    e = ELEMENT_BYTES[shape.dtype]
    standard = memory.standard_bytes(b, h, s, s, d, e, dropout=shape.dropout)
    flash = memory.flash_bytes(b, h, s, d, e, dropout=shape.dropout)
    notes = []
    if hkv != h:
        notes.append(
            f"GQA: k and v have {hkv} heads, so their input bytes are {h // hkv}x smaller than q's; "
            f"the kept O, S, P and logsumexp are per query head ({h})."
        )
    if shape.dropout > 0:
        notes.append(
            "dropout: standard attention keeps a one-byte mask per S element; flash-style "
            "kernels keep the 16-byte RNG state (seed, offset) and regenerate the mask."
        )
    return Estimate(
        shape=shape,
        element_bytes=e,
        q_bytes_per_layer=b * h * s * d * e,
        k_bytes_per_layer=b * hkv * s * d * e,
        v_bytes_per_layer=b * hkv * s * d * e,
        output_bytes_per_layer=b * h * s * d * e,
        s_matrix_bytes_per_layer=b * h * s * s * e,
        s_plus_p_bytes_per_layer=2 * b * h * s * s * e,
        dropout_mask_bytes_per_layer=b * h * s * s if shape.dropout > 0 else 0,
        logsumexp_bytes_per_layer=b * h * s * memory.LSE_BYTES,
        standard_bytes_per_layer=standard,
        flash_bytes_per_layer=flash,
        standard_bytes_total=standard * shape.layers,
        flash_bytes_total=flash * shape.layers,
        memory_savings=memory.savings(flash, standard),
        notes=notes,
    )


def human_bytes(n: int | float) -> str:
    """Binary units: ``human_bytes(2**30) == '1.00 GiB'``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    units = ("KiB", "MiB", "GiB", "TiB")
    value, i = n / 1024, 0
    while abs(value) >= 1024 and i < len(units) - 1:
        value, i = value / 1024, i + 1
    return f"{value:.2f} {units[i]}"
