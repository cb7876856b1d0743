"""What a flag says: the figure, where it was seen, and what to do about it.

Ratio flags name the healthy band their kernel was measured in (bands.py) and say whether the
value lies inside it; memory flags say why the savings are low (a fallback to the math path, a
short sequence, an op that keeps more than it must, flex_attention run unfused).
"""

from __future__ import annotations

from ..steps.records import SiteSummary
from .bands import band_for

_FUSED = ("flash", "cudnn", "cpu_flash", "flash_attn", "npu_fusion", "overrideable", "flex")


def band_label(s: SiteSummary, device: str) -> str:
    b = band_for(s, device)
    return "unknown" if b is None else b.label()


def shape_text(s: SiteSummary | None) -> str:
    if s is None:
        return ""
    b, h, sq, sk, d = s.shape
    return f"impl={s.impl} B={b} H={h} Sq={sq} Sk={sk} D={d} {s.dtype}"


def site_text(s: SiteSummary | None, n: int | None, n_sites: int) -> str:
    """Which site: the worst of the step's `n` over the line, or (n None) the flag's own site."""
    if s is None:
        return ""
    if n is None:
        return f" (site {s.site}: {shape_text(s)})"
    return f" ({n}/{n_sites} sites; worst {s.site}: {shape_text(s)})"


def ratio_advice(value: float, threshold: float, s: SiteSummary, site_value: float,
                 typical: float, n_over: int | None, n_sites: int, device: str,
                 judged_how: str) -> str:
    """What the flag says: the figure (with `judged_how`, how a host-clock figure was judged),
    where, and whether it is what the kernel does when healthy (the measured band, against
    `typical`: the site's ratio over its last steps), then what to do."""
    head = f"backward/forward {value:.2f}x > {threshold:g}x{judged_how}"
    if n_over is None:
        where = f" (site {s.site}: {shape_text(s)})"
    else:
        where = f" ({n_over}/{n_sites} sites; worst {s.site} {site_value:.2f}x: {shape_text(s)})"
    band = band_for(s, device)
    # One step's outlier is judged with the site's recent steps (Rules._typical).
    recent = (f" (the site's median over its recent steps: {typical:.2f}x)"
              if abs(typical - site_value) >= 0.005 else "")
    if band is not None and band.covers(typical):
        return (f"{head}{where} — within {band.describe()}{recent}: this is the kernel, not a "
                f"fault; set rules.backward_forward_ratio.per_impl.{s.impl} (fadiag calibrate "
                "measures it) to judge this job against its own")
    if band is not None:
        known = f" — beyond {band.describe()}{recent}"
    else:
        known = f" — no healthy range measured for {s.impl} at this shape on {device or 'this device'}"
    if s.impl == "efficient":
        why = (f": mem-efficient backend at S={s.shape[2]}; flash and cuDNN are faster in both "
               "passes: use fp16/bf16 and a head dim flash supports, or enable the cuDNN backend")
    elif s.impl == "math":
        why = ": the math path: see the memory flag for why fused kernels were not used"
    elif s.impl == "flex_unfused":
        why = ": flex_attention without torch.compile runs unfused; wrap it with torch.compile"
    elif s.impl not in _FUSED:
        why = (f": {s.impl}'s own backward is slow: check that it recomputes only what it must "
               "and launches fused kernels")
    elif s.device == "cpu" and s.impl == "cpu_flash":
        why = (": on CPU the host clock times both passes, and cpu_flash measured 2.0-2.4x "
               "healthy beside busy neighbours (benchmarks/BENCHMARKS.md section 8): over "
               f"{threshold:g}x in every window is a slower backward, or a neighbour the CPU "
               "wait does not show (memory bandwidth, a hypervisor's steal); fadiag calibrate "
               "measures this machine's own range")
    elif s.shape[2] <= 512:
        why = (f": short sequence (S={s.shape[2]}): the step is launch-bound and backward ≈4x "
               "forward is normal here; raise rules.backward_forward_ratio.min_forward_seconds "
               "to ignore it")
    else:
        why = (": backward does 2.5x forward's FLOPs; beyond its healthy range the backward kernel "
               "is slow for this shape: try another backend (fadiag bench), a newer kernel, or "
               "measure this job's own range (fadiag calibrate)")
    return head + where + known + why


def memory_expected(s: SiteSummary | None) -> bool:
    """Whether a fused kernel's savings are low by the shape alone: at a short sequence with a
    large head dim the output it must keep is a large share of standard attention's memory
    (D / (D + 2S) of the model), so the flag is `info`, not a fault."""
    return s is not None and s.impl != "math" and s.shape[4] * 2 >= s.shape[3]


def memory_advice(m: float, threshold: float, s: SiteSummary | None, reason: str | None,
                  n_under: int | None, n_sites: int) -> str:
    head = f"memory savings {m:.1%} < {threshold:.0%}"
    where = site_text(s, n_under, n_sites)
    if s is None:
        why = ""
    elif s.impl == "math":
        why = (" — SDPA fell back to the math path, which keeps [B,H,Sq,Sk] matrices"
               + (f": {reason}" if reason else "")
               + "; pass a bool mask or is_causal, use fp16/bf16 and a supported head dim, "
                 "or nn.MultiheadAttention(need_weights=False)")
    elif memory_expected(s):
        why = (f" — short sequence (Sk={s.shape[3]}) with head dim {s.shape[4]}: the output itself "
               "is a large share of standard attention's memory; expected, not a fault")
    else:
        why = f" — {s.impl} keeps more than O and logsumexp for backward: check what it saves"
    return head + where + why
