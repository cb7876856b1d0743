"""Small models the tests train: a GPT-style causal transformer and a seed-style attention Function."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(x)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int = 2, dim: int = 64, heads: int = 2, vocab: int = 64,
                 checkpointing: str | None = None):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.checkpointing = checkpointing

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            if self.checkpointing is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return self.head(x)


def train(model: nn.Module, steps: int, seq: int = 64, batch: int = 2, vocab: int = 64,
          micro_batches: int = 1, seed: int = 0) -> list[float]:
    """Train with AdamW on random tokens; returns the losses."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        for _ in range(micro_batches):
            tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
            logits = model(tokens)
            loss = F.cross_entropy(logits.view(-1, vocab), tokens.view(-1))
            (loss / micro_batches).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


class SeedFlashAttention(torch.autograd.Function):
    """Shaped like the seed's FlashAttentionFunction: its own forward and backward, saves q, k, v, O.

    `slow_backward` repeats the backward's work to make the backward/forward ratio rule fire.
    """

    slow_backward = 0

    @staticmethod
    def forward(ctx, q, k, v, scale, is_causal=True):  # type: ignore[no-untyped-def]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, out)
        ctx.scale, ctx.is_causal = scale, is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[no-untyped-def]
        q, k, v, _ = ctx.saved_tensors
        for _ in range(1 + SeedFlashAttention.slow_backward):
            with torch.enable_grad():
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=ctx.is_causal,
                                                   scale=ctx.scale)
                dq, dk, dv = torch.autograd.grad(o, (qq, kk, vv), grad_out)
        return dq, dk, dv, None, None


class GpuBusy(torch.autograd.Function):
    """Keeps the GPU ~1 ms ahead of the host in forward and in backward, as in GPU-bound training.

    Without it a lone attention call starves the GPU and events measure the host's launch gaps.
    """

    @staticmethod
    def forward(ctx, x):
        torch.cuda._sleep(2_000_000)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(2_000_000)
        return g


def capture_behind_a_pending_step(session, replays: int = 2):
    """Eager SDPA captured into a CUDA graph (torch.cuda.graph, its default "global" mode) while
    the resolver polls a step the device has not passed: three measured warm-up steps, one whose
    marks wait behind a ~0.5 s sleep, then the capture, with a 1 s host sleep inside it (the
    resolver's deferral is 0.5 s). Returns (captured output, static input) after `replays`
    replays; raises what the capture raises. Used by tests/test_gpu.py and
    benchmarks/graph_capture.py."""
    import time

    import torch.nn.functional as F

    import fadiag

    q = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    static = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.float16)
    for _ in range(3):
        out = F.scaled_dot_product_attention(GpuBusy.apply(q), q, q)
        GpuBusy.apply(out).backward(torch.ones_like(out))
        fadiag.step()
    session.flush(30)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph's documentation asks
        for _ in range(3):
            F.scaled_dot_product_attention(static, static, static)
    torch.cuda.current_stream().wait_stream(side)
    out = F.scaled_dot_product_attention(GpuBusy.apply(q), q, q)
    torch.cuda._sleep(1_000_000_000)  # the step's end marks wait ~0.5 s behind the sleep
    out.backward(torch.ones_like(out))
    fadiag.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = F.scaled_dot_product_attention(static, static, static)
        time.sleep(1.0)  # the resolver polls meanwhile
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return captured, static
