"""`fadiag demo`: a small GPT-style model trains with fadiag attached, and every step is shown.

The model, the two fault injections (attention forced onto SDPA's math path; a hand-written
attention whose backward does needless work) and the live table all live here.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import fadiag

from ...config.loader import disabled_by_environment
from ...steps.records import StepReport
from ..report.summary import format_summary, mib, ms, num, summarize

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What the demo trains and how it reports.

    Example::

        run_demo(DemoConfig(steps=20, port=0, force_math=True))
    """

    steps: int = 200
    """Optimizer steps to train; 0 trains until interrupted."""
    port: int | None = None
    """Metrics port (0: a free one); None: fadiag's configured port."""
    device: str = "cpu"
    """cpu, cuda or npu."""
    force_math: bool = False
    """Run SDPA under sdpa_kernel(SDPBackend.MATH): the memory_savings flag fires."""
    slow_backward: bool = False
    """Use SlowAttention, whose backward recomputes needlessly: the ratio flag fires."""
    seq_len: int = 256
    batch: int = 4
    dim: int = 128
    heads: int = 4
    layers: int = 4
    vocab: int = 512
    compile: bool = False
    """Train the model under torch.compile: its attention is measured by the dispatcher tap."""
    jsonl: str | None = None
    """Directory for the run log; None: no log."""
    live: bool | None = None
    """Live table (rich) or plain lines; None: live when stdout is a terminal."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads})")
        if self.force_math + self.slow_backward + self.compile > 1:
            raise ValueError("force_math, slow_backward and compile are separate demonstrations; "
                             "pick one")


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # Looked up on F at call time, as model code does, so fadiag's interceptor sees it.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class SlowAttention(torch.autograd.Function):
    """Causal attention with a flash-style memory footprint (keeps O and logsumexp) whose
    backward recomputes the probabilities several times over — the kind of kernel the
    backward/forward ratio rule exists to catch."""

    REPEATS = 16

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = _causal_scores(q, k, scale)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        out = torch.exp(scores - lse) @ v
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        probs = torch.zeros(())
        for _ in range(SlowAttention.REPEATS):
            probs = torch.exp(_causal_scores(q, k, ctx.scale) - lse)
        grad_v = probs.transpose(-2, -1) @ grad_out
        grad_p = grad_out @ v.transpose(-2, -1)
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        grad_s = probs * (grad_p - delta) * ctx.scale
        return grad_s @ k, grad_s.transpose(-2, -1) @ q, grad_v


def _causal_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu(1)
    return s.masked_fill(mask, float("-inf"))


def _instrument_slow_attention() -> None:
    # instrument() also registers the class for later sessions, which then wrap it on attach:
    # only a class not wrapped yet needs the call.
    if not getattr(SlowAttention.apply, "__wrapped_by_fadiag__", False):
        fadiag.instrument(SlowAttention, name="demo_slow")


def slow_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return SlowAttention.apply(q, k, v)  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attention: Attention):
        super().__init__()
        self.heads = heads
        self.attention = attention
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm blocks with causal attention, a tied head."""

    def __init__(self, cfg: DemoConfig, attention: Attention):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, attention) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.T


class _View:
    """Where step rows go: a rich live table on a terminal, plain lines elsewhere."""

    COLUMNS = ("step", "fwd ms", "bwd ms", "ratio", "savings", "kept / standard MiB", "impl", "flags")

    def __init__(self, live: bool, title: str, out: TextIO, limits: tuple[float, float],
                 rows: int = 20):
        self.rows: deque[tuple[str, ...]] = deque(maxlen=rows)
        self.title = title
        self.out = out
        self.max_ratio, self.min_savings = limits
        self._live: Any = None
        if live:
            from rich.live import Live

            from .._output import Console

            self.console = Console(file=out)
            self._live = Live(self._table(), console=self.console, refresh_per_second=8,
                              transient=False)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        if self._live is None:
            yield
            return
        with self._routed_logging(), self._live:
            yield

    @contextlib.contextmanager
    def _routed_logging(self) -> Iterator[None]:
        # fadiag's flag warnings would tear the live table; print them above it instead.
        from rich.logging import RichHandler

        root = logging.getLogger()
        saved = root.handlers[:]
        root.handlers = [RichHandler(console=self.console, show_path=False)]
        try:
            yield
        finally:
            root.handlers = saved

    def add(self, report: StepReport) -> None:
        row = _row(report)
        if self._live is None:
            step, fwd, bwd, ratio, sav, mem, impl, flags = row
            self.out.write(f"step {step:>5}  fwd {fwd:>8} ms  bwd {bwd:>8} ms  ratio {ratio:>5}  "
                           f"savings {sav:>6}  kept/standard {mem:>14} MiB  impl {impl}  "
                           f"flags {flags}\n")
            self.out.flush()
            return
        # Cells past a rule's threshold are red on every row, not only where the flag was raised.
        step, fwd, bwd, ratio, sav, mem, impl, flags = row
        if report.ratio is not None and report.ratio > self.max_ratio:
            ratio = f"[red]{ratio}[/red]"
        if report.memory_savings is not None and report.memory_savings < self.min_savings:
            sav = f"[red]{sav}[/red]"
        if flags != "-":
            flags = f"[bold red]{flags}[/bold red]"
        self.rows.append((step, fwd, bwd, ratio, sav, mem, impl, flags))
        self._live.update(self._table())

    def _table(self) -> Any:
        from rich.table import Table

        table = Table(title=self.title, title_justify="left", expand=False)
        for i, name in enumerate(self.COLUMNS):
            table.add_column(name, justify="left" if i >= 6 else "right")
        for row in self.rows:
            table.add_row(*row)
        return table


def _row(report: StepReport) -> tuple[str, ...]:
    impls = Counter(c.impl for c in report.calls if not c.recompute)
    flags = sorted({f.rule for f in report.flags if not f.cleared})
    kept = mib(report.kept_bytes)
    return (str(report.step), ms(report.forward_seconds), ms(report.backward_seconds),
            num(report.ratio), num(report.memory_savings, 3),
            f"{kept} / {mib(report.standard_bytes)}", ",".join(sorted(impls)) or "-",
            " ".join(flags) or "-")


class _StopOnInterrupt:
    """First Ctrl-C: finish the current step, then stop. Second: stop at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> _StopOnInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


def run_demo(cfg: DemoConfig, out: TextIO | None = None) -> int:
    """Train, show each resolved step, print a summary; 0 when done, 130 when interrupted."""
    out = out or sys.stdout
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    # The table shows step totals, so the rules judge step totals too: the flags column then
    # agrees with the figures beside it (per-site figures are in the summary's table).
    overrides: dict[str, Any] = {"device": cfg.device, "rules.per_site": False}
    if cfg.port is not None:
        overrides["port"] = cfg.port
    if cfg.jsonl is not None:
        overrides["jsonl"] = cfg.jsonl
    session = fadiag.attach(**overrides)
    attention: Attention = sdpa_attention
    if cfg.slow_backward:
        _instrument_slow_attention()
        attention = slow_attention
    kind = "demo_slow (autograd.Function)" if cfg.slow_backward else (
        "sdpa forced to the math backend" if cfg.force_math else "sdpa")
    model = TinyGPT(cfg, attention).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if cfg.compile:
        kind += ", torch.compile'd"
        model = torch.compile(model)  # type: ignore[assignment]
    url = _metrics_line(session)
    out.write(f"fadiag demo: {cfg.layers}-layer GPT, dim {cfg.dim}, {cfg.heads} heads, "
              f"seq {cfg.seq_len}, batch {cfg.batch} on {cfg.device}; attention: {kind}\n"
              f"metrics: {url}\n")
    out.flush()
    live = out.isatty() if cfg.live is None else cfg.live
    rules = session.config.rules
    view = _View(live, f"fadiag demo — {url}", out,
                 (rules.backward_forward_ratio.threshold, rules.memory_savings.threshold))
    seen: deque[StepReport] = deque(maxlen=10_000)
    last = -1

    def show() -> None:
        nonlocal last
        for report in session.history():
            if report.step <= last:
                continue
            last = report.step
            seen.append(report)
            view.add(report)

    interrupted = False
    started = time.perf_counter()
    done = 0
    try:
        with _StopOnInterrupt() as stop, view.running():
            while cfg.steps == 0 or done < cfg.steps:
                _train_step(model, optimizer, cfg, device)
                done += 1
                show()
                if stop.requested:
                    interrupted = True
                    break
            session.flush(timeout=10.0)
            show()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        fadiag.detach()
    elapsed = time.perf_counter() - started
    out.write(f"\n{'interrupted after' if interrupted else 'trained'} {done} steps "
              f"in {elapsed:.1f} s ({elapsed / max(done, 1) * 1e3:.0f} ms per step)\n")
    out.write(format_summary(summarize(list(seen))) + "\n")
    out.flush()
    return 130 if interrupted else 0


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: DemoConfig,
                device: torch.device) -> None:
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), device=device)
    with _attention_context(cfg), _autocast(device):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _attention_context(cfg: DemoConfig) -> contextlib.AbstractContextManager[Any]:
    if not cfg.force_math:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    # Fused kernels on accelerators want half precision; CPU trains in float32.
    if device.type == "cpu":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _metrics_line(session: Any) -> str:
    """Where the metrics are served, or why they are not."""
    if session.port:
        return f"http://{_host(session)}:{session.port}/metrics"
    if not session.config.enabled:
        return ("none: fadiag disabled by FADIAG_DISABLE" if disabled_by_environment()
                else "none: fadiag disabled by the configuration (enabled: false)")
    exporter = session.config.exporter
    if not exporter.enabled:
        return "none: exporter off (exporter.enabled: false)"
    return (f"none: port {exporter.port} was taken (exporter.on_port_in_use: "
            f"{exporter.on_port_in_use}; see the warning above)")


def _host(session: Any) -> str:
    addr = str(session.config.exporter.addr)
    return "127.0.0.1" if addr in ("", "0.0.0.0", "::") else addr
