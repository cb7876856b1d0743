"""A torch.compile'd Llama-style model on the GPU: what the dispatcher tap reports, against CUPTI.

Builds a Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention through SDPA,
SwiGLU MLP) in bf16, compiles it, trains it with fadiag attached and reports, per step, the calls
fadiag saw and their forward/backward seconds; then runs the same steps under torch.profiler and
sums the device time of the kernels under each fused attention op (CUPTI), for the accuracy
check. With --cuda-graphs it also runs `mode="reduce-overhead"` (CUDA graphs) and reports what
fadiag counts there. Usage:

    python benchmarks/compiled.py --out benchmarks/results/compiled.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from marks_first import marks_first  # noqa: E402

import fadiag  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 2 * 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        gate, up = self.up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, kv_heads: int, seq: int, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(seq).float(), freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def make(args: argparse.Namespace, mode: str | None):
    torch.manual_seed(0)
    model = Llama(args.layers, args.dim, args.heads, args.kv_heads, args.seq, args.vocab)
    model = model.cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    compiled = torch.compile(model, mode=mode)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")

    def step() -> None:
        logits = compiled(tokens)
        F.cross_entropy(logits.view(-1, args.vocab).float(), tokens.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


ATTENTION = ("attention", "attn")


def cupti(step, steps: int) -> dict:
    """Device time of the kernels under each fused attention op, per step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    fwd = bwd = 0.0
    ops: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        name = e.name
        if not name.startswith("aten::_scaled_dot_product_") or "attention" not in name:
            continue
        if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::_scaled_dot_product_"):
            continue  # counted with the op that called it
        ops[name] += 1
        t = e.device_time_total * 1e-6
        if name.endswith("_backward"):
            bwd += t
        else:
            fwd += t
    return {"forward_seconds_per_step": fwd / steps, "backward_seconds_per_step": bwd / steps,
            "ops_per_step": {k: v / steps for k, v in ops.items()}}


def measured(make_step, steps: int, warm: int = 3) -> dict:
    """Attach, then build the step (a CUDA graph must be captured after attach to be counted),
    run `warm` steps, then `steps` reported ones."""
    session = fadiag.attach(port=0, tap="on")
    try:
        step = make_step()
        for _ in range(warm):
            step()
        assert session.flush(30)
        first = session.last_step().step if session.last_step() else 0
        for _ in range(steps):
            step()
        assert session.flush(30)
        reports = [r for r in session.history() if r.step > first]
        calls = reports[-1].calls
        out = {
            "tap": session.tap_status,
            "calls_per_step": statistics.median(len(r.calls) for r in reports),
            "impls": sorted({c.impl for c in calls}),
            "sites": [c.site for c in calls],
            "forward_seconds_per_step": statistics.median(r.forward_seconds for r in reports),
            "backward_seconds_per_step": statistics.median(r.backward_seconds for r in reports),
            "ratio_per_step": statistics.median(r.ratio or 0.0 for r in reports),
            # Calls whose windows may hold host time (the device had nothing queued when the op
            # began): their seconds are an upper bound on the kernels'.
            "host_bound_calls_per_step": statistics.median(r.host_bound_calls for r in reports),
            "kept_bytes": calls[0].kept_bytes if calls else None,
            "standard_bytes": calls[0].standard_bytes if calls else None,
            "unmeasured_last_step": reports[-1].unmeasured,
            "unmeasured_totals": session.recorder.unmeasured_totals(),
            "steps_reported": len(reports),
        }
    finally:
        fadiag.detach()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="compiled.json")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cuda-graphs", action="store_true", help="also run mode='reduce-overhead'")
    args = p.parse_args()
    marks = marks_first()  # before attach(): measured with the native marks from the first step
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "native_marks": marks,
                    "model": {k: getattr(args, k) for k in ("layers", "dim", "heads", "kv_heads",
                                                             "seq", "batch")}}
    step = make(args, None)
    for _ in range(5):  # compile and warm up
        step()
    result["fadiag"] = measured(lambda: step, args.steps)
    result["cupti"] = cupti(step, args.steps)
    for part in ("forward", "backward"):
        f = result["fadiag"][f"{part}_seconds_per_step"]
        c = result["cupti"][f"{part}_seconds_per_step"]
        result[f"{part}_vs_cupti"] = f / c - 1.0 if c else None
    print(json.dumps({k: result[k] for k in ("fadiag", "cupti", "forward_vs_cupti",
                                              "backward_vs_cupti")}, indent=1), flush=True)
    if args.cuda_graphs:
        torch._dynamo.reset()
        result["cuda_graphs"] = measured(lambda: make(args, "reduce-overhead"), args.steps, warm=8)
        print(json.dumps(result["cuda_graphs"], indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
