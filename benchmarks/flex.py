"""FlexAttention on a CUDA GPU: fadiag's figures for flex against CUPTI and the memory model.

For `torch.compile(flex_attention)` with a causal and a document mask at each S: forward and
backward seconds against the CUPTI time of the kernels the compiled forward and backward ran
(torch.profiler: everything under the `CompiledFunction` / `CompiledFunctionBackward` ops),
kept bytes against out + logsumexp, and the block mask's sparsity; then eager flex_attention
(impl flex_unfused) and its memory flag; then flex inside a compiled function, counted. Prints
one JSON object. Usage (each S and mask compiles its own kernels, ~1 min each):

    python benchmarks/flex.py [--sizes 2048 4096 8192] [--batch 2] [--heads 16] [--dim 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.attention.flex_attention as fam

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fadiag  # noqa: E402
from tests.models import GpuBusy  # noqa: E402

REPEATS = 5


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_mask(s: int, documents: int = 4):
    """Causal attention within each of `documents` packed documents of uneven lengths."""
    g = torch.Generator().manual_seed(s)
    cuts = torch.sort(torch.randperm(s - 1, generator=g)[: documents - 1] + 1).values
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([s])]))
    doc = torch.repeat_interleave(torch.arange(documents), lengths).cuda()

    def mask(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return mask


def cupti_seconds(fn) -> tuple[float, float, list[str]]:
    """CUPTI device time under the compiled forward and backward ops, and the kernels' names."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fwd = bwd = 0.0
    for e in prof.events():
        if e.name == "CompiledFunction":
            fwd += e.device_time_total * 1e-6
        elif e.name == "CompiledFunctionBackward":
            bwd += e.device_time_total * 1e-6
    kernels = sorted({e.name for e in prof.events() if "flex" in e.name})
    return fwd, bwd, kernels


def compiled_case(s: int, mask_name: str, b: int, h: int, d: int) -> dict:
    mask_mod = causal if mask_name == "causal" else document_mask(s)
    block_mask = fam.create_block_mask(mask_mod, None, None, s, s, device="cuda")
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    session = fadiag.attach(port=0)
    fn = torch.compile(fam.flex_attention)

    def once():
        GpuBusy.apply(q)  # keeps the GPU ahead of the host, as in GPU-bound training
        out = fn(q, k, v, block_mask=block_mask)
        GpuBusy.apply(out).backward(torch.ones_like(out))

    for _ in range(3):  # compiles (counted as `compiling`), learns the signature, warms up
        once()
        fadiag.step()
    ours_f, ours_b, ref_f, ref_b = [], [], [], []
    call = None
    kernels: list[str] = []
    for _ in range(REPEATS):
        f, bw, kernels = cupti_seconds(once)
        fadiag.step()
        assert session.flush(60)
        call = session.last_step().calls[0]
        ours_f.append(call.forward_seconds)
        ours_b.append(call.backward_seconds)
        ref_f.append(f)
        ref_b.append(bw)
    assert call is not None
    expected_kept = b * h * s * d * 2 + b * h * s * 4  # out (bf16) + logsumexp (fp32)
    result = {
        "S": s, "mask": mask_name, "impl": call.impl, "sparsity": call.sparsity,
        "torch_sparsity": block_mask.sparsity() / 100,
        "forward_ms": statistics.median(ours_f) * 1e3, "cupti_forward_ms": statistics.median(ref_f) * 1e3,
        "backward_ms": statistics.median(ours_b) * 1e3, "cupti_backward_ms": statistics.median(ref_b) * 1e3,
        "kept_bytes": call.kept_bytes, "out_plus_lse_bytes": expected_kept,
        "standard_bytes": call.standard_bytes, "memory_savings": call.memory_savings,
        "forward_only": call.forward_only, "unmeasured": dict(session.recorder.unmeasured),
        "flags": [f.rule for r in session.history() for f in r.flags], "kernels": kernels,
    }
    result["forward_vs_cupti"] = result["forward_ms"] / result["cupti_forward_ms"]
    result["backward_vs_cupti"] = result["backward_ms"] / result["cupti_backward_ms"]
    result["within_3_percent"] = (abs(result["forward_vs_cupti"] - 1) <= 0.03
                                  and abs(result["backward_vs_cupti"] - 1) <= 0.03)
    fadiag.detach()
    return result


def eager_case(s: int, b: int, h: int, d: int) -> dict:
    block_mask = fam.create_block_mask(causal, None, None, s, s, device="cuda")
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    session = fadiag.attach(port=0)
    for _ in range(3):
        fam.flex_attention(q, k, v, block_mask=block_mask).sum().backward()
        fadiag.step()
    assert session.flush(60)
    calls = [c for r in session.history() for c in r.calls]
    flags = [f for r in session.history() for f in r.flags if f.rule == "memory_savings"]
    c = calls[-1]
    result = {"S": s, "impl": c.impl, "forward_ms": c.forward_seconds * 1e3,
              "backward_ms": c.backward_seconds * 1e3, "kept_bytes": c.kept_bytes,
              "peak_bytes": c.peak_bytes, "standard_bytes": c.standard_bytes,
              "memory_flag": flags[0].message if flags else None}
    fadiag.detach()
    return result


def inside_compiled_case(s: int, b: int, h: int, d: int) -> dict:
    session = fadiag.attach(port=0)

    @torch.compile
    def attention(q, k, v):
        return fam.flex_attention(q, k, v) * 2

    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    for _ in range(3):
        attention(q, k, v).sum().backward()
        fadiag.step()
    assert session.flush(60)
    result = {"S": s, "unmeasured": dict(session.recorder.unmeasured),
              "measured_calls": sum(len(r.calls) for r in session.history())}
    fadiag.detach()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/flex.py needs a CUDA device")
    out = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "compiled": [compiled_case(s, m, a.batch, a.heads, a.dim)
                     for s in a.sizes for m in ("causal", "document")],
        "eager": eager_case(min(a.sizes), 1, a.heads, a.dim),
        "inside_compiled": inside_compiled_case(min(a.sizes), 1, a.heads, a.dim),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
