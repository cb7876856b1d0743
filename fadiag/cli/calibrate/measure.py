"""Calibration: the backward/forward ratio of a job's shapes on this machine, as fadiag measures it.

Each shape runs under fadiag itself (rules off), so the figures are what the ratio rule will
judge; the thresholds are the healthy maximum per impl plus a margin.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

import fadiag

from ...config.schema import RatioRuleConfig
from ...errors import FadiagError
from ...rules.engine import fastest_ratio, host_judged_ratios, ratio_calls
from ...steps.records import StepReport

WINDOW = RatioRuleConfig().host_window_steps
"""Host-clock steps the ratio rule judges together (its default)."""

SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cpu_flash": "FLASH_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
"""The impls calibration can force (SDPA's backends); others are named as not measured."""
DEVICE_DEFAULT = {"cuda": ("flash", "efficient", "cudnn"), "cpu": ("cpu_flash",)}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One attention call of the job: (B, H, Sq, Sk, D), key/value heads, dtype, causal."""

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    kv_heads: int
    dtype: str
    causal: bool

    def text(self) -> str:
        gqa = f" kv_heads={self.kv_heads}" if self.kv_heads != self.heads else ""
        return (f"B={self.batch} H={self.heads} Sq={self.seq_q} Sk={self.seq_k} D={self.head_dim}"
                f"{gqa} {self.dtype}{' causal' if self.causal else ''}")


@dataclass(kw_only=True)
class Measured:
    """One (impl, shape): the ratio of each measured step, or why it was not measured.

    `seconds` holds each step's (forward, backward) where they were read (the host clock's
    judgement needs both)."""

    impl: str
    shape: Shape
    ratios: list[float] = field(default_factory=list)
    reason: str = ""
    host_clock: bool = False
    seconds: list[tuple[float, float]] = field(default_factory=list)

    @property
    def judged(self) -> float | None:
        """What the rule would judge at worst over the steps: on a device clock the largest step
        (it judges every step); on the host clock the largest of what it judges there (the lowest
        of WINDOW windows' fastest backward over fastest forward of WINDOW steps), or, with fewer
        steps, the fastest ratio over all of them; from ratios alone (no seconds), their
        median."""
        if not self.ratios:
            return None
        if not self.host_clock:
            return max(self.ratios)
        if not self.seconds:
            return statistics.median(self.ratios)
        if len(self.seconds) < 2 * WINDOW - 1:
            return fastest_ratio(self.seconds)
        return max(host_judged_ratios(self.seconds, WINDOW))


def shapes_from_run(steps: Iterable[StepReport]) -> dict[tuple[str, Shape], None]:
    """The (impl, shape) pairs of a run log's steady-state calls, in first-seen order."""
    seen: dict[tuple[str, Shape], None] = {}
    for report in steps:
        for c in report.calls:
            if c.probe or c.recompute:
                continue
            b, h, sq, sk, d = c.shape
            seen[(c.impl, Shape(batch=b, heads=h, seq_q=sq, seq_k=sk, head_dim=d,
                                kv_heads=c.kv_heads or h, dtype=c.dtype, causal=c.causal))] = None
    return seen


class _KeepAhead(torch.autograd.Function):
    """Keeps a GPU ~1 ms ahead of the host in forward and backward, as in GPU-bound training:
    with the device idle, a lone call's events would time the host's launch gaps instead."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(2_000_000)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(2_000_000)
        return g


def measure(impl: str, shape: Shape, device: str, steps: int = 20, warmup: int = 3,
            on_step: Callable[[], None] | None = None) -> Measured:
    """Run `steps` (after `warmup`) forward+backward calls of `shape` on `impl` under fadiag."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = Measured(impl=impl, shape=shape, host_clock=device == "cpu")
    backend = SDPA_BACKENDS.get(impl)
    if backend is None:
        out.reason = "not an SDPA backend: calibration cannot force it"
        return out
    dtype = DTYPES.get(shape.dtype)
    if dtype is None:
        out.reason = f"dtype {shape.dtype} is not one of {', '.join(DTYPES)}"
        return out
    dev = torch.device(device)
    q = torch.randn(shape.batch, shape.heads, shape.seq_q, shape.head_dim, device=dev,
                    dtype=dtype, requires_grad=True)
    k, v = (torch.randn(shape.batch, shape.kv_heads, shape.seq_k, shape.head_dim, device=dev,
                        dtype=dtype, requires_grad=True) for _ in range(2))
    gqa: dict[str, Any] = {"enable_gqa": True} if shape.kv_heads != shape.heads else {}
    keep = _KeepAhead.apply if dev.type == "cuda" else (lambda t: t)
    quiet: dict[str, Any] = {"exporter.enabled": False, "jsonl.path": None,
                             "rules.backward_forward_ratio.enabled": False,
                             "rules.regression.enabled": False, "device": dev.type}
    session = fadiag.attach(**quiet)
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            for _ in range(warmup + steps):
                o = torch.nn.functional.scaled_dot_product_attention(
                    keep(q), k, v, is_causal=shape.causal, **gqa)
                keep(o).backward(torch.ones_like(o))
                fadiag.step()
                if on_step is not None:
                    on_step()
        if not session.flush(60):
            raise FadiagError("calibration: the device did not finish the measured steps in 60 s")
        host_bound = 0
        for report in session.history()[warmup:]:
            calls = [c for c in report.calls if not c.probe]
            if calls and calls[0].impl != impl:
                out.reason = f"{impl} was asked for, {calls[0].impl} ran"
                out.ratios = []
                break
            judged = ratio_calls(calls)  # as the rule: no window that may hold host time
            host_bound += len(calls) - len(judged)
            if judged and judged[0].ratio is not None:
                out.ratios.append(judged[0].ratio)  # type: ignore[arg-type]
                out.seconds.append((judged[0].forward_seconds, judged[0].backward_seconds))
        if not out.ratios and host_bound and not out.reason:
            out.reason = (f"every measured window ({host_bound}) may hold host time: the device "
                          "waited for the host, so no ratio of the kernel was read")
    except RuntimeError as e:  # the backend refuses this shape, or out of memory
        out.reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
    finally:
        fadiag.detach()
    return out


def thresholds(results: Iterable[Measured], margin: float) -> dict[str, float]:
    """Per impl: the largest judged ratio of its shapes times (1 + margin), rounded up to 0.01."""
    worst: dict[str, float] = {}
    for m in results:
        if m.judged is not None:
            worst[m.impl] = max(worst.get(m.impl, 0.0), m.judged)
    return {impl: math.ceil(round(r * (1.0 + margin) * 100, 6)) / 100 for impl, r in worst.items()}


def config_text(limits: dict[str, float], results: list[Measured], header: list[str]) -> str:
    """The YAML file `fadiag.attach()` loads: per-impl thresholds, with what they came from."""
    import yaml

    lines = [f"# {h}" for h in header]
    for m in results:
        if m.judged is None:
            lines.append(f"#   {m.impl:10s} {m.shape.text()}: not measured ({m.reason})")
        else:
            lines.append(f"#   {m.impl:10s} {m.shape.text()}: median {statistics.median(m.ratios):.2f}, "
                         f"max {max(m.ratios):.2f} over {len(m.ratios)} steps, judged "
                         f"{m.judged:.2f}")
    body = yaml.safe_dump({"rules": {"backward_forward_ratio": {"per_impl": limits}}},
                          sort_keys=False)
    return "\n".join(lines) + "\n" + body
