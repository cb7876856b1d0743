"""What fadiag's event windows hold, call by call, against CUPTI, on a CUDA GPU.

fadiag times a call between two device marks; CUPTI (torch.profiler) sums the kernels a fused op
launched. The two agree when the GPU runs ahead of the host; when it waits for the host, the
window also holds the host's time between the marks. For the same profiled steps, this prints
each call's forward and backward as fadiag measured it beside the CUPTI device time of the op
that call ran (in call order), the GPU's busy fraction over those steps (kernel time over wall
time), and for FlexAttention the kernels of one backward in device order with their gaps.

    python benchmarks/windows.py [--out windows.json] [--only checkpointing,compiled,flex,hf,floor,gpu_bound,apart,blocks] [--batches 2,4]

Cases: an 8-layer GPT with and without non-reentrant checkpointing at two sizes (one that keeps
the GPU waiting on the host, one that does not); the Llama-style model of benchmarks/compiled.py
compiled at B=2 and B=4 (`--batches`); `torch.compile(flex_attention)` at S=2048 causal; with `hf` (needs
transformers), benchmarks/hf_checkpointing.py's HF Llama with and without checkpointing; with
`floor`, the least a window holds: two native marks back to back on a busy stream; with
`gpu_bound`, benchmarks/overhead.py's GPU-bound GPT (D=64); with `apart`, that GPT measured by
fadiag and by CUPTI in separate steps (neither disturbs the other); with `blocks`, overhead.py's own
GPU-bound model attached and detached in blocks as overhead.py does, every step's ratio and flags
with its place in its block. `cupti_ratio`: the profiled steps'
backward ops over their forward ops, as CUPTI times their kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from marks_first import marks_first  # noqa: E402

import fadiag  # noqa: E402
from tests.models import GPT, GpuBusy  # noqa: E402

SDPA = "aten::_scaled_dot_product_"


def profiled(step, steps: int) -> tuple[Any, float]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return prof, wall


def sdpa_ops(prof: Any) -> list[dict[str, Any]]:
    """Each top-level fused attention op, in the order the host called it, with its device time."""
    ops = []
    for e in prof.events():
        if not e.name.startswith(SDPA) or "attention" not in e.name:
            continue
        if e.cpu_parent is not None and e.cpu_parent.name.startswith(SDPA):
            continue
        ops.append({"op": e.name[len(SDPA):], "t": e.time_range.start,
                    "device_ms": e.device_time_total * 1e-3,
                    "kernels": sorted({k.name[:60] for k in e.kernels})})
    ops.sort(key=lambda o: o["t"])
    return ops


def busy_fraction(prof: Any, wall: float) -> float:
    kernel_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return kernel_us * 1e-6 / wall


def calls_of(session: fadiag.Session, steps: int) -> list[dict[str, Any]]:
    assert session.flush(60)
    out = []
    for r in session.history()[-steps:]:
        for c in r.calls:
            out.append({"step": r.step, "site": c.site, "recompute": c.recompute, "impl": c.impl,
                        "forward_ms": c.forward_seconds * 1e3, "backward_ms": c.backward_seconds * 1e3})
    return out


def rel(rows: list[dict[str, Any]], a: str, b: str) -> float | None:
    """The median of row[a] / row[b] - 1 over the rows."""
    return statistics.median(r[a] / r[b] - 1.0 for r in rows if r[b] > 0) if rows else None


def measured(session: fadiag.Session, step, warm: int) -> dict[str, Any]:
    """`warm` steps, then two profiled ones; detaches. The calls of the profiled steps side by side
    with CUPTI's ops, the GPU's busy fraction, the step time and each site's median ratio."""
    try:
        for _ in range(warm):
            step()
        prof, wall = profiled(step, 2)
        calls = calls_of(session, 2)
        ratios: dict[str, list[float]] = {}
        for r in session.history()[-2:]:
            for s in r.sites():
                if s.ratio is not None:
                    ratios.setdefault(s.site, []).append(s.ratio)
    finally:
        fadiag.detach()
    out = side_by_side(calls, sdpa_ops(prof))
    out.update({"gpu_busy_fraction": busy_fraction(prof, wall), "step_ms": wall / 2 * 1e3,
                "site_ratios": {k: statistics.median(v) for k, v in ratios.items()}})
    return out


def side_by_side(calls: list[dict[str, Any]], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Forward calls against forward ops, and backward against backward ops, both in order."""
    fwd_ops = [o for o in ops if not o["op"].endswith("_backward")]
    bwd_ops = [o for o in ops if o["op"].endswith("_backward")]
    rows = [{"site": c["site"], "recompute": c["recompute"], "fadiag_forward_ms": c["forward_ms"],
             "cupti_forward_ms": o["device_ms"]} for c, o in zip(calls, fwd_ops, strict=False)]
    by_step: dict[int, list[dict[str, Any]]] = {}
    for c in calls:
        by_step.setdefault(c["step"], []).append(c)
    bwd_calls = [c for s in sorted(by_step) for c in backward_order(by_step[s])]
    brows = [{"site": c["site"], "fadiag_backward_ms": c["backward_ms"], "cupti_backward_ms": o["device_ms"]}
             for c, o in zip(bwd_calls, bwd_ops, strict=False)]

    return {"forward": rows, "backward": brows,
            "forward_vs_cupti_median": rel(rows, "fadiag_forward_ms", "cupti_forward_ms"),
            "backward_vs_cupti_median": rel(brows, "fadiag_backward_ms", "cupti_backward_ms"),
            "forward_ops": len(fwd_ops), "forward_calls": len(calls), "kernels": fwd_ops[0]["kernels"] if fwd_ops else [],
            "cupti_ratio": (sum(o["device_ms"] for o in bwd_ops) / sum(o["device_ms"] for o in fwd_ops)
                            if fwd_ops and bwd_ops else None)}


def backward_order(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A step's calls that carry a measured backward, in the order their backward ops ran.

    A step's forwards backpropagate last first. Under checkpointing the call that carries the
    backward is the recomputation where the tap timed it (its backward op received the
    recomputation's tensors) and the first pass where the wrapper's hooks did; a recomputation
    runs just before its own backward, so those are in that order already."""
    carriers = [c for c in calls if c["backward_ms"] > 0]
    recomputed = [c for c in carriers if c["recompute"]]
    return recomputed if recomputed else carriers[::-1]


def gpt_step(layers: int, dim: int, heads: int, batch: int, seq: int, mode: str | None = None):
    """tests/models.py's GPT in bf16, AdamW, a batch of random tokens: its training step."""
    torch.manual_seed(0)
    model = GPT(layers=layers, dim=dim, heads=heads, vocab=512, checkpointing=mode).cuda().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 512, (batch, seq), device="cuda")

    def step() -> None:
        logits = model(tokens)
        F.cross_entropy(logits.float().view(-1, 512), tokens.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def checkpointing(layers: int, dim: int, heads: int, batch: int, seq: int, mode: str | None) -> dict[str, Any]:
    step = gpt_step(layers, dim, heads, batch, seq, mode)
    session = fadiag.attach(**{"exporter.enabled": False})
    out = measured(session, step, 4)
    out.update({"mode": mode or "none", "size": {"layers": layers, "dim": dim, "heads": heads, "batch": batch, "seq": seq}})
    return out


def apart(layers: int, dim: int, heads: int, batch: int, seq: int, steps: int = 20) -> dict[str, Any]:
    """fadiag's per-call medians over `steps` unprofiled steps, then CUPTI's over steps profiled
    without fadiag attached, on one GPT: neither measurement disturbs the other (the profiler's
    host cost can make windows host-bound; fadiag's marks are not in CUPTI's steps)."""
    step = gpt_step(layers, dim, heads, batch, seq)
    session = fadiag.attach(**{"exporter.enabled": False})
    try:
        for _ in range(4 + steps):
            step()
        calls = calls_of(session, steps)
        step_ratios = [r.ratio for r in session.history()[-steps:] if r.ratio is not None]
    finally:
        fadiag.detach()
    out = cupti_of(step)
    f_ms = statistics.median(c["forward_ms"] for c in calls)
    b_ms = statistics.median(c["backward_ms"] for c in calls)
    out.update({"size": {"layers": layers, "dim": dim, "heads": heads, "batch": batch, "seq": seq},
                "impl": sorted({c["impl"] for c in calls}), "fadiag_forward_ms": f_ms,
                "fadiag_backward_ms": b_ms, "fadiag_ratio": b_ms / f_ms,
                "fadiag_step_ratios": [min(step_ratios, default=None), max(step_ratios, default=None)]})
    return out


def cupti_of(step) -> dict[str, Any]:
    """CUPTI's medians of the fused ops' device time over three profiled steps (fadiag detached)."""
    for _ in range(3):
        step()
    prof, wall = profiled(step, 3)
    ops = sdpa_ops(prof)
    fwd = [o["device_ms"] for o in ops if not o["op"].endswith("_backward")]
    bwd = [o["device_ms"] for o in ops if o["op"].endswith("_backward")]
    return {"cupti_forward_ms": statistics.median(fwd), "cupti_backward_ms": statistics.median(bwd),
            "cupti_ratio": statistics.median(bwd) / statistics.median(fwd),
            "cupti_ops": sorted({o["op"] for o in ops}), "gpu_busy_fraction": busy_fraction(prof, wall)}


def in_blocks(name: str = "gpu_bound", blocks: int = 12, steps: int = 20) -> dict[str, Any]:
    """overhead.py's own model, attached as overhead.py attaches it: `steps` plain steps, then
    `steps` + 1 with a session attached, `blocks` times. Every attached step's ratio, its calls'
    windows, the flags it raised and its place in the block, the allocator's device allocations
    and frees in each half; then CUPTI's ratio on plain steps."""
    import overhead

    _, step = overhead.make(name)
    for _ in range(10):
        step()
    rows: list[dict[str, Any]] = []
    allocs: list[dict[str, int]] = []

    def device_allocs() -> tuple[int, int]:
        m = torch.cuda.memory_stats()
        return m.get("num_device_alloc", 0), m.get("num_device_free", 0)

    for b in range(blocks):
        a0 = device_allocs()
        for _ in range(steps):
            step()
        a1 = device_allocs()
        session = fadiag.attach(port=0)
        try:
            for _ in range(steps + 1):
                step()
            a2 = device_allocs()
            assert session.flush(60)
            for i, r in enumerate(session.history()):
                rows.append({
                    "block": b, "in_block": i, "ratio": r.ratio,
                    "flags": [[f.rule, f.severity, round(f.value, 3)] for f in r.flags],
                    "calls": [[round(c.forward_seconds * 1e3, 4), round(c.backward_seconds * 1e3, 4),
                               c.host_bound, c.probe, c.impl] for c in r.calls]})
        finally:
            fadiag.detach()
        allocs.append({"plain_alloc": a1[0] - a0[0], "plain_free": a1[1] - a0[1],
                       "fadiag_alloc": a2[0] - a1[0], "fadiag_free": a2[1] - a1[1]})
    out = cupti_of(step)
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    flagged = [r for r in rows if any(f[0] == "ratio" for f in r["flags"])]
    out.update({"model": name, "steps": rows, "allocator": allocs,
                "ratio_min_median_max": [min(ratios), statistics.median(ratios), max(ratios)] if ratios else None,
                "ratio_flagged_steps": [[r["block"], r["in_block"], r["ratio"], r["flags"]] for r in flagged]})
    return out


def compiled(batch: int) -> dict[str, Any]:
    import compiled as cm  # benchmarks/compiled.py

    args = argparse.Namespace(layers=16, dim=2048, heads=16, kv_heads=4, seq=2048, batch=batch, vocab=32000)
    torch._dynamo.reset()
    session = fadiag.attach(**{"exporter.enabled": False, "tap": "on"})
    try:
        step = cm.make(args, None)  # compiled after attach, as benchmarks/compiled.py does
    except BaseException:
        fadiag.detach()
        raise
    out = measured(session, step, 5)
    out["batch"] = batch
    return out


def hf_llama(checkpointing: bool) -> dict[str, Any]:
    """benchmarks/hf_checkpointing.py's 16-layer HF Llama (B=2, S=2048, bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=2048, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    tokens = torch.randint(0, 32000, (2, 2048), device="cuda")
    session = fadiag.attach(**{"exporter.enabled": False})

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = measured(session, step, 4)
    first = [r for r in out["forward"] if not r["recompute"]]
    again = [r for r in out["forward"] if r["recompute"]]
    out.update({"checkpointing": checkpointing,
                "first_forward_vs_cupti_median": rel(first, "fadiag_forward_ms", "cupti_forward_ms"),
                "recompute_forward_vs_cupti_median": rel(again, "fadiag_forward_ms", "cupti_forward_ms")})
    return out


def flex_backward_trace(s: int = 2048) -> dict[str, Any]:
    import torch.nn.attention.flex_attention as fam

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = fam.create_block_mask(causal, None, None, s, s, device="cuda")
    q, k, v = (torch.randn(2, 16, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    session = fadiag.attach(**{"exporter.enabled": False})
    fn = torch.compile(fam.flex_attention)

    def once() -> None:
        GpuBusy.apply(q)
        out = fn(q, k, v, block_mask=block_mask)
        GpuBusy.apply(out).backward(torch.ones_like(out))
        fadiag.step()

    try:
        for _ in range(4):
            once()
        prof, _ = profiled(once, 1)
        calls = calls_of(session, 1)
    finally:
        fadiag.detach()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    spins = [i for i, e in enumerate(kernels) if "spin" in e.name or "sleep" in e.name]
    window = kernels[spins[1] + 1:] if len(spins) >= 2 else kernels
    t0 = window[0].time_range.start if window else 0
    trace = [{"kernel": e.name[:70], "start_us": e.time_range.start - t0,
              "dur_us": e.time_range.elapsed_us()} for e in window]
    busy = sum(r["dur_us"] for r in trace)
    return {"calls": calls, "backward_kernels": trace, "kernel_sum_us": busy,
            "span_us": (trace[-1]["start_us"] + trace[-1]["dur_us"]) if trace else 0}


def window_floor(rounds: int = 20, per_round: int = 20) -> dict[str, Any]:
    """What a window holds with nothing in it: a start mark and an end mark taken back to back
    (the native marks, as the tap and the wrapper take them) while a 2 ms sleep keeps the stream
    busy, so the device passes both with only the two event records between them; and the same
    around one small kernel (a 1 MiB add), beside that kernel's CUPTI time."""
    from torch.profiler import ProfilerActivity, profile

    from fadiag.capture import native

    marks = native.load("cuda").Marks(True)
    x = torch.zeros(256 * 1024, device="cuda")

    def windows(work: Any) -> list[float]:
        out: list[float] = []
        for _ in range(rounds):
            torch.cuda._sleep(2_000_000)
            pairs = []
            for _ in range(per_round):
                a = marks.start()
                work()
                pairs.append((a, marks.take()))
            torch.cuda.synchronize()
            out += [marks.elapsed(a, b) * 1e6 for a, b in pairs]
            marks.give_back_all([m for p in pairs for m in p])
        return out

    def add() -> None:
        x.add_(1.0)

    empty = windows(lambda: None)
    windows(add)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        around = windows(add)
    kernels = [e.device_time for e in prof.events() if e.device_type == DeviceType.CUDA
               and "sleep" not in e.name.lower()]

    def stats(v: list[float]) -> dict[str, float]:
        q = statistics.quantiles(v, n=10)
        return {"n": len(v), "median_us": round(statistics.median(v), 3), "p10_us": round(q[0], 3),
                "p90_us": round(q[-1], 3)}

    return {"empty_window": stats(empty), "window_around_add": stats(around),
            "add_kernel_cupti": stats(kernels) if len(kernels) >= 2 else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="windows.json")
    p.add_argument("--only", default="checkpointing,compiled,flex")
    p.add_argument("--batches", default="2,4", help="batch sizes of the compiled model")
    a = p.parse_args()
    marks = marks_first()  # before attach(): measured with the native marks from the first step
    if not torch.cuda.is_available():
        sys.exit("benchmarks/windows.py needs a CUDA device")
    only = set(a.only.split(","))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "native_marks": marks}

    def save() -> None:
        Path(a.out).write_text(json.dumps(result, indent=1))

    if "checkpointing" in only:
        result["checkpointing"] = []
        for size in ((8, 1024, 8, 4, 2048), (8, 2048, 16, 8, 2048)):
            for mode in (None, "non_reentrant"):
                result["checkpointing"].append(checkpointing(*size, mode))
                r = result["checkpointing"][-1]
                print(json.dumps({k: r[k] for k in ("mode", "size", "gpu_busy_fraction", "step_ms",
                                                    "forward_vs_cupti_median", "backward_vs_cupti_median",
                                                    "site_ratios")}), flush=True)
                save()
    if "apart" in only:
        result["apart"] = apart(12, 1024, 16, 8, 2048)
        print(json.dumps(result["apart"]), flush=True)
        save()
    if "blocks" in only:
        r = result["blocks"] = in_blocks()
        print(json.dumps({k: r[k] for k in ("model", "cupti_forward_ms", "cupti_backward_ms", "cupti_ratio",
                                            "gpu_busy_fraction", "ratio_min_median_max", "ratio_flagged_steps",
                                            "allocator")}), flush=True)
        save()
    if "gpu_bound" in only:
        # overhead.py's GPU-bound GPT (12 layers, D=64 on cuDNN): its kernels' own ratio.
        result["gpu_bound"] = checkpointing(12, 1024, 16, 8, 2048, None)
        r = result["gpu_bound"]
        print(json.dumps({k: r[k] for k in ("size", "gpu_busy_fraction", "step_ms", "forward_vs_cupti_median",
                                            "backward_vs_cupti_median", "cupti_ratio", "site_ratios", "kernels")}),
              flush=True)
        save()
    if "hf" in only:
        result["hf"] = []
        for ck in (False, True):
            result["hf"].append(hf_llama(ck))
            torch.cuda.empty_cache()  # the first model's blocks, before the second one's
            r = result["hf"][-1]
            print(json.dumps({k: r[k] for k in ("checkpointing", "gpu_busy_fraction", "step_ms",
                                                "first_forward_vs_cupti_median", "recompute_forward_vs_cupti_median",
                                                "backward_vs_cupti_median", "forward_ops", "forward_calls")}), flush=True)
            save()
    if "flex" in only:
        result["flex"] = flex_backward_trace()
        print(json.dumps({k: result["flex"][k] for k in ("calls", "kernel_sum_us", "span_us")}), flush=True)
        save()
    if "floor" in only:
        result["floor"] = window_floor()
        print(json.dumps(result["floor"]), flush=True)
        save()
    if "compiled" in only:
        result["compiled"] = []
        for b in map(int, a.batches.split(",")):
            result["compiled"].append(compiled(b))
            r = result["compiled"][-1]
            print(json.dumps({k: r[k] for k in ("batch", "gpu_busy_fraction", "step_ms", "forward_vs_cupti_median",
                                                "backward_vs_cupti_median", "forward_ops", "forward_calls", "kernels")}), flush=True)
            save()


if __name__ == "__main__":
    main()
