"""The ratio rule's host-clock estimators beside busy processes: what tells a busy machine from a
slow backward. CPU only.

Trains the demo's model (fadiag demo's defaults) with fadiag attached, beside `--busy` processes
that each spin on a core, and prints per site: the forward and backward ms (fastest, median),
the largest median-of-9-steps ratio (the rule before) and the fastest-backward over fastest-forward
ratio of 9 steps (p50, max), the steps' cpu_wait and the flags raised. Usage:

    python benchmarks/contention.py [--attention sdpa|slow] [--busy 1] [--steps 150]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import fadiag  # noqa: E402
from fadiag.cli.demo.training import (  # noqa: E402
    DemoConfig,
    TinyGPT,
    _instrument_slow_attention,
    _train_step,
    sdpa_attention,
    slow_attention,
)

WINDOW = 9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attention", choices=("sdpa", "slow"), default="sdpa")
    p.add_argument("--busy", type=int, default=1, help="spinning processes beside the run")
    p.add_argument("--steps", type=int, default=150)
    args = p.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
    try:
        reports = _train(args.attention, args.steps)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    _print(reports, args)


def _train(attention: str, steps: int) -> list:
    cfg = DemoConfig(steps=steps)
    torch.manual_seed(0)
    session = fadiag.attach(**{"exporter.enabled": False, "rules.per_site": False,
                               "steps.history": steps + 8})
    if attention == "slow":
        _instrument_slow_attention()
    model = TinyGPT(cfg, slow_attention if attention == "slow" else sdpa_attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(steps):
        _train_step(model, optimizer, cfg, torch.device("cpu"))
    session.flush(60)
    reports = session.history()
    fadiag.detach()
    return reports


def _print(reports: list, args: argparse.Namespace) -> None:
    reports = reports[3:]  # the rule's warm-up
    fwd: dict[str, list[float]] = defaultdict(list)
    bwd: dict[str, list[float]] = defaultdict(list)
    for r in reports:
        for c in r.calls:
            if not c.probe and c.backward_seconds > 0:
                fwd[c.site].append(c.forward_seconds)
                bwd[c.site].append(c.backward_seconds)
    waits = sorted(r.cpu_wait for r in reports if r.cpu_wait is not None)
    q = [round(waits[int(x * (len(waits) - 1))], 2) for x in (0.05, 0.5, 0.95)] if waits else []
    flags = [(f.rule, f.step) for r in reports for f in r.flags if not f.cleared]
    print(f"attention={args.attention} busy={args.busy} steps={len(reports) + 3}: "
          f"cpu_wait p5/p50/p95 {q}; flags raised {flags or 'none'}")
    print("site  fwd ms min/med  bwd ms min/med  median-of-9 max  fastest-of-9 p50/max")
    for site in fwd:
        f, b = fwd[site], bwd[site]
        med = [statistics.median(y / x for x, y in zip(f[i - WINDOW:i], b[i - WINDOW:i],
                                                          strict=True))
               for i in range(WINDOW, len(f) + 1)]
        fast = [min(b[i - WINDOW:i]) / min(f[i - WINDOW:i]) for i in range(WINDOW, len(f) + 1)]
        print(f"{site.rsplit('#', 1)[-1]:>4}  {min(f) * 1e3:6.2f} {statistics.median(f) * 1e3:6.2f}"
              f"  {min(b) * 1e3:7.2f} {statistics.median(b) * 1e3:7.2f}  {max(med):15.2f}"
              f"  {statistics.median(fast):6.2f} {max(fast):6.2f}")


if __name__ == "__main__":
    main()
