"""Pools the rounds of `overhead.py --rotate` runs of one model and reads them as one run.

Each rotated run keeps every block's wall (`blocks_ms`), round by round, so runs made on one
machine with one tree can be read together: every variant against the same round's plain block,
and each variant's gap to the floor round by round, in points of the plain step and in µs, with
the distribution-free 95 % interval of the median (`overhead.median_ci95`), and the training
thread's own CPU a step over the floor's where the runs kept it. A variant is read in the rounds
of the runs that have it. The rounds are also split at plain's median: a fixed host cost reads
the same µs in the faster and the slower half.
Usage:

    python benchmarks/pool_rounds.py benchmarks/results/overhead-launch-run119.json \
        benchmarks/results/overhead-launch-run121.json [--model launch_bound]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import median_ci95  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", help="overhead.py --rotate --out files")
    p.add_argument("--model", default="launch_bound")
    args = p.parse_args()
    # Per variant, its rounds from every run that has it: (plain, floor, variant) walls, and the
    # training thread's CPU a step of the variant's and the floor's blocks where the run kept it.
    rounds: dict[str, list[tuple[float, float | None, float, float | None, float | None]]] = {}
    plain_all: list[float] = []
    for path in args.runs:
        run = json.loads(Path(path).read_text(encoding="utf-8"))[args.model]
        walls = run["blocks_ms"]
        cpu = run.get("blocks_thread_cpu_us", {})
        plain = walls["plain"]
        plain_all.extend(plain)
        floor = next((v for v in walls if v.startswith("floor")), None)
        for variant, ws in walls.items():
            if variant == "plain":
                continue
            for i, w in enumerate(ws):
                f = walls[floor][i] if floor is not None and variant != floor else None
                fc = cpu[floor][i] if f is not None and floor in cpu else None
                vc = cpu[variant][i] if variant in cpu else None
                rounds.setdefault(variant, []).append((plain[i], f, w, vc, fc))
    print(f"{len(args.runs)} runs, {len(plain_all)} rounds; plain {statistics.median(plain_all):.2f}"
          f" ms a step (blocks {min(plain_all):.1f} to {max(plain_all):.1f} ms)")
    for variant, rows in rounds.items():
        ratios = [b / a - 1.0 for a, _, b, _, _ in rows]
        lo, hi = median_ci95(ratios)
        line = (f"  {variant:22s} {statistics.median(ratios) * 100:+6.2f} % "
                f"({lo * 100:+.2f} .. {hi * 100:+.2f}), {len(rows)} rounds")
        floored = [r for r in rows if r[1] is not None and variant != "plain_again"]
        if len(floored) == len(rows):
            gaps = [(b - f) / a for a, f, b, _, _ in floored]  # type: ignore[operator]
            us = [(b - f) * 1e3 for _, f, b, _, _ in floored]  # type: ignore[operator]
            (glo, ghi), (ulo, uhi) = median_ci95(gaps), median_ci95(us)
            line += (f"; over the floor {statistics.median(gaps) * 100:+.2f} points ({glo * 100:+.2f}"
                     f" .. {ghi * 100:+.2f}), {statistics.median(us):+.0f} µs a step ({ulo:+.0f} .. "
                     f"{uhi:+.0f})")
            order = sorted(range(len(floored)), key=lambda i: floored[i][0])
            for half, idx in (("faster", order[:len(order) // 2]),
                              ("slower", order[len(order) // 2:])):
                ms = statistics.median(floored[i][0] for i in idx)
                line += (f"; {half} half (plain {ms:.2f} ms) "
                         f"{statistics.median(us[i] for i in idx):+.0f} µs")
            cpu_us = [vc - fc for _, _, _, vc, fc in floored if vc is not None and fc is not None]
            if cpu_us:
                clo, chi = median_ci95(cpu_us)
                line += (f"; training thread CPU over the floor {statistics.median(cpu_us):+.0f} µs"
                         f" a step ({clo:+.0f} .. {chi:+.0f})")
        print(line)

if __name__ == "__main__":
    main()
