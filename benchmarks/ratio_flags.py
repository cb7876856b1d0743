"""The ratio rule on the card: where its flags fire, what they claim, and what calibration changes.

Four parts, one JSON result on stdout (and in --out):

- defaults: each cell of the ratio grid (flash, cuDNN, efficient; S=1024..8192; D 64 and 128;
  causal and not; bf16) trained for a few steps under fadiag's default configuration: whether a
  ratio flag fired, whether a judged step exceeded 3.0 (`exact`: the two agree), and the flag's
  band and severity;
- calibrated: `fadiag calibrate`'s measurement of the same cells, its per-impl thresholds, and
  the same cells run again with them (`flags` must be 0);
- injected: with the calibrated thresholds, a flash call whose backward runs the fused backward
  and then half of it again (1.5x) replaces the clean call mid-run; `steps_to_flag` <= 5;
- checkpointing: an 8-layer GPT with and without non-reentrant checkpointing, per-site ratios
  (`max_rel_diff` <= 0.10).

    python benchmarks/ratio_flags.py [--out ratio-flags.json] [--steps 12]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from marks_first import marks_first  # noqa: E402

import fadiag  # noqa: E402
from fadiag.cli.calibrate import measure  # noqa: E402
from fadiag.config import Config  # noqa: E402
from tests.models import GPT  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
TOKENS, WIDTH = 16384, 2048  # B x S and H x D in every cell, as benchmarks/ratio_grid.py
# The dispatcher tap (where present) would also see the fused op inside the injected Function.
BASE: dict[str, Any] = {"exporter.enabled": False,
                        **({"tap": "off"} if "tap" in Config.__dataclass_fields__ else {})}


def cells(seq_lens: list[int]) -> list[tuple[str, int, int, bool]]:
    return [(b, s, d, c) for b, c, d in itertools.product(BACKENDS, (True, False), (64, 128))
            for s in seq_lens]


def qkv(s: int, d: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(max(1, TOKENS // s), WIDTH // d, s, d, device="cuda",
                             dtype=torch.bfloat16, requires_grad=True) for _ in range(3))


def sdpa_step(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool) -> None:
    keep = measure._KeepAhead.apply
    with sdpa_kernel(BACKENDS[backend]):
        o = F.scaled_dot_product_attention(keep(q), k, v, is_causal=causal)
    keep(o).backward(torch.ones_like(o))
    fadiag.step()


def run_cell(backend: str, s: int, d: int, causal: bool, steps: int,
             config: dict[str, Any]) -> dict[str, Any]:
    q, k, v = qkv(s, d)
    flags: list[Any] = []
    session = fadiag.attach(**BASE, **config, on_flag=flags.append)
    try:
        for _ in range(steps):
            sdpa_step(backend, q, k, v, causal)
        assert session.flush(60)
        cfg = session.config.rules.backward_forward_ratio
        judged = [c.ratio for r in session.history()[cfg.warmup_steps:] for c in r.calls
                  if not c.probe and c.ratio is not None]
        impl = session.history()[-1].calls[0].impl
        threshold = cfg.threshold_for(impl)
    finally:
        fadiag.detach()
    ratio_flags = [f for f in flags if f.rule == "backward_forward_ratio"]
    over = any(r > threshold for r in judged)
    return {"backend": backend, "impl": impl, "S": s, "D": d, "causal": causal,
            "median_ratio": round(statistics.median(judged), 3),
            "max_ratio": round(max(judged), 3), "threshold": threshold,
            "flagged": bool(ratio_flags), "over_threshold": over,
            "exact": bool(ratio_flags) == over,
            "flags": [{"step": f.step, "value": round(f.value, 3), "severity": f.severity,
                       "band": f.band, "message": f.message} for f in ratio_flags]}


class SlowFlash(torch.autograd.Function):
    """The flash kernel, with a backward that runs the fused backward and then half of it again
    (the first half of the batch): 1.5x the healthy backward, the forward untouched."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                is_causal: bool) -> torch.Tensor:
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal)
        ctx.save_for_backward(q, k, v, out, lse, cq, ck, seed, offset)
        ctx.meta = (mq, mk, is_causal)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, cq, ck, seed, offset = ctx.saved_tensors
        mq, mk, causal = ctx.meta
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_backward
        dq, dk, dv = bwd(g.contiguous(), q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed,
                         offset)
        h = max(1, q.shape[0] // 2)
        bwd(g[:h].contiguous(), q[:h], k[:h], v[:h], out[:h], lse[:h], cq, ck, mq, mk, 0.0,
            causal, seed, offset)
        return dq, dk, dv, None


def injected(s: int, d: int, causal: bool, per_impl: dict[str, float], clean: int = 8,
             slow: int = 8) -> dict[str, Any]:
    fadiag.instrument(SlowFlash, name="flash")  # judged against the flash threshold and band
    q, k, v = qkv(s, d)
    flags: list[Any] = []
    session = fadiag.attach(**BASE, on_flag=flags.append,
                            **{"rules.backward_forward_ratio.per_impl": per_impl})
    keep = measure._KeepAhead.apply
    try:
        for _ in range(clean):
            sdpa_step("flash", q, k, v, causal)
        for _ in range(slow):
            o = SlowFlash.apply(keep(q), k, v, causal)
            keep(o).backward(torch.ones_like(o))
            fadiag.step()
        assert session.flush(60)
        slow_ratios = [c.ratio for r in session.history()[clean:] for c in r.calls if not c.probe]
    finally:
        fadiag.detach()
    first = next((f.step for f in flags if f.rule == "backward_forward_ratio"), None)
    return {"S": s, "D": d, "causal": causal, "threshold": per_impl.get("flash"),
            "slow_median_ratio": round(statistics.median(slow_ratios), 3) if slow_ratios else None,
            "steps_to_flag": None if first is None else first - clean,
            "flags": [{"step": f.step, "value": round(f.value, 3), "severity": f.severity,
                       "band": f.band} for f in flags if f.rule == "backward_forward_ratio"]}


def checkpointing(steps: int = 8, dim: int = 1024, heads: int = 8, batch: int = 4) -> dict[str, Any]:
    """At dim 1024, B=4 the GPU waits for the host about half of each step (benchmarks/windows.py:
    busy fraction 0.4-0.5), so every event window also holds host time, more with checkpointing's
    Python; at dim 2048, B=8 the GPU stays ahead."""
    def ratios(mode: str | None) -> dict[str, Any]:
        torch.manual_seed(0)
        model = GPT(layers=8, dim=dim, heads=heads, vocab=512, checkpointing=mode).cuda().bfloat16()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        session = fadiag.attach(**BASE)
        try:
            for _ in range(steps):
                tokens = torch.randint(0, 512, (batch, 2048), device="cuda")
                logits = model(tokens)
                F.cross_entropy(logits.float().view(-1, 512), tokens.view(-1)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            assert session.flush(60)
            per_site: dict[str, list[float]] = {}
            read = session.history()[3:]
            for r in read:
                for site in r.sites():
                    if site.ratio is not None:
                        per_site.setdefault(site.site, []).append(site.ratio)
            flags = [(f.rule, f.severity, round(f.value, 2), f.step, f.site)
                     for r in session.history() for f in r.flags]
            host_bound = sum(r.host_bound_calls for r in read) / max(1, len(read))
            marks = session.devices.marks()
        finally:
            fadiag.detach()
        return {"per_site": {k: statistics.median(v) for k, v in per_site.items()}, "flags": flags,
                "host_bound_per_step": host_bound, "marks": marks}

    plain, ckpt = ratios(None), ratios("non_reentrant")
    p, c = plain["per_site"], ckpt["per_site"]
    diffs = {k: abs(c[k] - p[k]) / p[k] for k in p if k in c}
    # None: no site had a device-bound window in both runs (the ratios leave host-bound ones out).
    return {"size": {"layers": 8, "dim": dim, "heads": heads, "batch": batch, "seq": 2048},
            "plain": plain, "non_reentrant": ckpt, "max_rel_diff": max(diffs.values(), default=None),
            "sites_missing": sorted(set(p) ^ set(c))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="ratio-flags.json")
    p.add_argument("--seq-lens", default="1024,2048,4096,8192")
    p.add_argument("--steps", type=int, default=12, help="steps per cell (3 are warm-up)")
    p.add_argument("--checkpointing-only", action="store_true",
                   help="only the checkpointing comparison, at both sizes")
    args = p.parse_args()
    marks = marks_first()  # before attach(): measured with the native marks from the first step
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "native_marks": marks}
    if args.checkpointing_only:
        result["checkpointing"] = [checkpointing(), checkpointing(dim=2048, heads=16, batch=8)]
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return
    grid = cells(seq_lens)
    defaults = [run_cell(b, s, d, c, args.steps, {}) for b, s, d, c in grid]
    result["defaults"] = {"cells": defaults, "all_exact": all(r["exact"] for r in defaults),
                          "flagged": sum(r["flagged"] for r in defaults)}
    print(f"defaults: {result['defaults']['flagged']} of {len(defaults)} cells flagged, exact: "
          f"{result['defaults']['all_exact']}", file=sys.stderr)
    measured = []
    for b, s, d, c in grid:
        shape = measure.Shape(batch=max(1, TOKENS // s), heads=WIDTH // d, seq_q=s, seq_k=s,
                              head_dim=d, kv_heads=WIDTH // d, dtype="bfloat16", causal=c)
        measured.append(measure.measure(b, shape, "cuda", steps=args.steps))
    per_impl = measure.thresholds(measured, 0.1)
    calibrated = [run_cell(b, s, d, c, args.steps,
                           {"rules.backward_forward_ratio.per_impl": per_impl})
                  for b, s, d, c in grid]
    result["calibrated"] = {
        "per_impl": per_impl, "flags": sum(r["flagged"] for r in calibrated),
        "measured": [{"impl": m.impl, **dataclasses.asdict(m.shape), "max": max(m.ratios)
                      if m.ratios else None, "reason": m.reason} for m in measured],
        "cells": calibrated}
    print(f"calibrated {per_impl}: {result['calibrated']['flags']} cells flagged", file=sys.stderr)
    inj = [injected(s, 128, True, per_impl) for s in seq_lens]
    result["injected"] = {"runs": inj, "all_within_5_steps": all(
        r["steps_to_flag"] is not None and r["steps_to_flag"] <= 5 for r in inj)}
    result["checkpointing"] = [checkpointing(), checkpointing(dim=2048, heads=16, batch=8)]
    text = json.dumps(result, indent=1)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
