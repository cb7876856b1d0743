"""How the ratio rule's host-clock judgment reads a healthy CPU kernel beside neighbours.

Trains the demo's model (the shapes tests/test_host.py uses: 2 layers, B=2 H=2 S=128 D=32,
cpu_flash) under fadiag for `--steps` steps, `--runs` times beside each kind of neighbour:

  none   nothing else running
  spin   one process spinning on a core (what the CI machine's busy tests start)
  mem    one process copying 64 MiB buffers (a neighbour that takes memory bandwidth and cache)
  spin,mem  both

and reads, per site and for the step's total, what the rule would judge over the run: one
window's fastest backward over fastest forward (`window`), and the lowest of the last n windows
(`judged`, what Rules._judged_ratio returns). Steps whose threads waited for a CPU past
rules.backward_forward_ratio.max_cpu_wait are left out, as the rule leaves them out. A slower
backward is modelled by scaling each measured backward by `--slow` (the same interference on a
kernel that does that much more work): the share of judgments over the threshold says how soon
the rule would see it.

    python benchmarks/host_ratio.py --runs 6 --out host-ratio.json
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import fadiag
from fadiag.cli.demo.training import DemoConfig, run_demo
from fadiag.config.schema import RatioRuleConfig
from fadiag.export.jsonl import read_run
from fadiag.rules.engine import fastest_ratio, host_judged_ratios

SHAPES = {"seq_len": 128, "batch": 2, "dim": 64, "heads": 2, "layers": 2, "vocab": 128}
NEIGHBOURS = {
    "spin": "while True: pass",
    "mem": ("import torch\ntorch.set_num_threads(1)\na = torch.ones(2**24)\nb = torch.empty_like(a)\n"
            "while True: b.copy_(a)"),
}
RULE = RatioRuleConfig()


def series(kind: str, steps: int) -> list[list[tuple[float, float]]]:
    """(forward, backward) seconds per judged step, for each site and (last) the step's total."""
    procs = [subprocess.Popen([sys.executable, "-c", NEIGHBOURS[k]]) for k in kind.split(",")
             if k in NEIGHBOURS]
    try:
        time.sleep(0.2 if procs else 0.0)
        with tempfile.TemporaryDirectory() as d:
            run_demo(DemoConfig(steps=steps, port=0, live=False, jsonl=d, **SHAPES), io.StringIO())
            run = read_run(Path(d) / "fadiag-rank0.jsonl")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    kept = [r for r in run.steps[RULE.warmup_steps:]
            if r.cpu_wait is None or r.cpu_wait <= RULE.max_cpu_wait]
    sites = sorted({s.site for r in kept for s in r.sites()})
    by_site = {site: [] for site in sites}
    total = []
    for r in kept:
        summaries = {s.site: s for s in r.sites()}
        if set(summaries) != set(sites):
            continue
        for site, s in summaries.items():
            by_site[site].append((s.ratio_forward_seconds, s.backward_seconds))
        total.append((sum(s.ratio_forward_seconds for s in summaries.values()),
                      sum(s.backward_seconds for s in summaries.values())))
    return [*by_site.values(), total]


def readings(seconds: list[tuple[float, float]], slow: float = 1.0) -> dict[str, list[float]]:
    n = RULE.host_window_steps
    scaled = [(f, b * slow) for f, b in seconds]
    return {"window": [fastest_ratio(scaled[i - n:i]) for i in range(n, len(scaled) + 1)],
            "judged": host_judged_ratios(scaled, n)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kinds", default="none;spin;mem;spin,mem")
    ap.add_argument("--slow", type=float, nargs="*", default=[1.5, 1.8])
    ap.add_argument("--out", default="host-ratio.json")
    args = ap.parse_args()
    threshold = RULE.threshold
    result: dict = {"torch": torch.__version__, "fadiag": fadiag.__version__,
                    "cpu": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "steps": args.steps,
                    "threshold": threshold, "window": RULE.host_window_steps, "kinds": {}}
    for kind in args.kinds.split(";"):
        runs = [series(kind, args.steps) for _ in range(args.runs)]
        entry: dict = {"healthy_median": [], "healthy_max": {"window": 0.0, "judged": 0.0},
                       "false_flag_runs": {"window": 0, "judged": 0}, "judged_steps": [],
                       "slow": {}}
        for run in runs:
            entry["judged_steps"].append(len(run[-1]))
            worst = {"window": 0.0, "judged": 0.0}
            for seconds in run:
                for name, values in readings(seconds).items():
                    worst[name] = max(worst[name], max(values, default=0.0))
            for name, value in worst.items():
                entry["healthy_max"][name] = round(max(entry["healthy_max"][name], value), 3)
                entry["false_flag_runs"][name] += value > threshold
            entry["healthy_median"].append(round(statistics.median(readings(run[-1])["window"]),
                                                 3))
        for k in args.slow:
            shares = {"window": [], "judged": []}
            for run in runs:
                for name, values in readings(run[-1], k).items():
                    shares[name].append(round(sum(v > threshold for v in values) / len(values), 3))
            entry["slow"][str(k)] = {name: min(v) for name, v in shares.items()}
        result["kinds"][kind] = entry
        print(kind, json.dumps(entry), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
