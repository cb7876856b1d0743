"""Backward/forward ratio per SDPA backend across the shapes training uses, as fadiag reports it.

The 3x rule's default is the user's; this grid shows where the fused backends sit against it on
the card at hand (causal and not, head dim 64 and 128, fp16 and bf16). The GPU is kept ahead of
the host, as in GPU-bound training, so the figures are kernel time. Usage:

    python benchmarks/ratio_grid.py [--out ratio-grid.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fadiag  # noqa: E402
from tests.models import GpuBusy  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def ratio(backend: str, s: int, d: int, causal: bool, dtype: torch.dtype, tokens: int) -> dict:
    b, h = max(1, tokens // s), 2048 // d  # same tokens and model width in every cell
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    session = fadiag.attach(port=0, **{"rules.backward_forward_ratio.enabled": False})
    try:
        for _ in range(8):
            GpuBusy.apply(q)
            with sdpa_kernel(BACKENDS[backend]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            GpuBusy.apply(out).backward(torch.ones_like(out))
            fadiag.step()
        assert session.flush(30)
        calls = [r.calls[0] for r in session.history()[3:]]
    finally:
        fadiag.detach()
    fwd = statistics.median(c.forward_seconds for c in calls)
    bwd = statistics.median(c.backward_seconds for c in calls)
    return {"backend": backend, "impl": calls[0].impl, "S": s, "B": b, "H": h, "D": d,
            "causal": causal, "dtype": str(dtype).replace("torch.", ""),
            "forward_ms": fwd * 1e3, "backward_ms": bwd * 1e3, "ratio": bwd / fwd}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="ratio-grid.json")
    p.add_argument("--seq-lens", default="1024,2048,4096,8192")
    p.add_argument("--tokens", type=int, default=16384, help="B x S in every cell")
    args = p.parse_args()
    rows: list[dict] = []
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": rows}
    for backend, causal, d, dtype in itertools.product(
            BACKENDS, (True, False), (64, 128), (torch.bfloat16, torch.float16)):
        for s in (int(x) for x in args.seq_lens.split(",")):
            try:
                row = ratio(backend, s, d, causal, dtype, args.tokens)
            except RuntimeError as e:  # a backend that does not take this shape
                print(f"{backend} S={s} D={d} causal={causal} {dtype}: {str(e).splitlines()[0]}")
                continue
            rows.append(row)
            print(f"{backend:9s} {row['dtype']:8s} causal={causal!s:5s} D={d:3d} S={s:5d} "
                  f"B={row['B']:2d}: fwd {row['forward_ms']:.3f} ms, bwd {row['backward_ms']:.3f}"
                  f" ms, ratio {row['ratio']:.2f}", flush=True)
            # Written after every cell: a run cut short keeps what it measured.
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
