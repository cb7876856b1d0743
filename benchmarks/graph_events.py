"""Can attention be timed inside a CUDA graph? Timing events recorded during capture, read per replay.

A CUDA graph replays kernels with no op call, so neither the dispatcher tap nor a Python wrapper
runs at replay (fadiag counts such calls as `cuda_graph`). An event recorded during capture with
the external flag (`torch.cuda.Event(enable_timing=True, external=True)`, cudaEventRecordExternal)
becomes an event-record node of the graph, recorded again at every replay. This captures one
training step of SDPA (forward and backward) with such events around each pass, replays it, and
compares the events' elapsed time after each replay with CUPTI's kernel time for the same replays
and with the same events recorded in eager mode; and the replay's wall time with and without the
event nodes (their cost). Prints one JSON object.

    python benchmarks/graph_events.py [--seq 2048] [--replays 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def capture(q, k, v, g_out, events: bool):
    """One graph: forward and backward of causal SDPA, with external timing events if asked."""
    ev = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(4)] if events else []
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch's docs require
        for _ in range(3):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(g_out)
            q.grad = k.grad = v.grad = None
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        if events:
            ev[0].record()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if events:
            ev[1].record()
            ev[2].record()
        out.backward(g_out)
        if events:
            ev[3].record()
    return graph, ev


def replay_times(graph, ev, replays: int) -> tuple[list[float], list[float], float]:
    fwd, bwd = [], []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
        if ev:
            torch.cuda.synchronize()
            fwd.append(ev[0].elapsed_time(ev[1]) * 1e-3)
            bwd.append(ev[2].elapsed_time(ev[3]) * 1e-3)
    torch.cuda.synchronize()
    return fwd, bwd, (time.perf_counter() - t0) / replays


def cupti(graph, replays: int) -> tuple[float, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    fwd = bwd = 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        if "flash" not in name and "fmha" not in name and "attention" not in name:
            continue
        if "bwd" in name or "backward" in name or "dot_do_o" in name or "convert_dq" in name:
            bwd += e.time_range.elapsed_us() * 1e-6
        else:
            fwd += e.time_range.elapsed_us() * 1e-6
    return fwd / replays, bwd / replays


def eager(q, k, v, g_out, n: int) -> tuple[float, float]:
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    fwd, bwd = [], []
    for _ in range(n):
        torch.cuda._sleep(2_000_000)  # the GPU ahead of the host, as in GPU-bound training
        ev[0].record()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ev[1].record()
        ev[2].record()
        out.backward(g_out)
        ev[3].record()
        torch.cuda.synchronize()
        q.grad = k.grad = v.grad = None
        fwd.append(ev[0].elapsed_time(ev[1]) * 1e-3)
        bwd.append(ev[2].elapsed_time(ev[3]) * 1e-3)
    return statistics.median(fwd), statistics.median(bwd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--replays", type=int, default=20)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/graph_events.py needs a CUDA device")
    torch.manual_seed(0)
    q, k, v = (torch.randn(a.batch, 16, a.seq, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    g_out = torch.randn(a.batch, 16, a.seq, 128, device="cuda", dtype=torch.bfloat16)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    try:
        graph, ev = capture(q, k, v, g_out, events=True)
        fwd, bwd, _ = replay_times(graph, ev, a.replays)
        result["in_graph"] = {"forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd),
                              "forward_spread": [min(fwd), max(fwd)], "backward_spread": [min(bwd), max(bwd)]}
        c_fwd, c_bwd = cupti(graph, a.replays)
        result["cupti_in_graph"] = {"forward_s": c_fwd, "backward_s": c_bwd}
        result["in_graph_vs_cupti"] = {"forward": result["in_graph"]["forward_s"] / c_fwd - 1 if c_fwd else None,
                                       "backward": result["in_graph"]["backward_s"] / c_bwd - 1 if c_bwd else None}
        plain, _ = capture(q, k, v, g_out, events=False)
        walls = {"with_events": [], "plain": []}
        for _ in range(10):  # interleaved blocks
            walls["plain"].append(replay_times(plain, [], a.replays)[2])
            walls["with_events"].append(replay_times(graph, [], a.replays)[2])
        result["replay_wall_s"] = {k2: statistics.median(v2) for k2, v2 in walls.items()}
        result["event_nodes_cost"] = result["replay_wall_s"]["with_events"] / result["replay_wall_s"]["plain"] - 1
    except Exception as e:  # the result either way is the finding
        result["error"] = f"{type(e).__name__}: {e}"
    result["eager_events"] = dict(zip(("forward_s", "backward_s"), eager(q, k, v, g_out, 10), strict=True))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # one known kernel family for CUPTI's names
        main()
