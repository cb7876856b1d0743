"""Pools the rounds of `overhead.py --rotate` runs of one model and reads them as one run.

Each rotated run keeps every block's wall (`blocks_ms`), round by round, so runs made on one
machine with one tree can be read together: every variant against the same round's plain block,
and each variant's gap to the floor round by round, in points of the plain step and in µs, with
the distribution-free 95 % interval of the median (`overhead.median_ci95`). The rounds are also
split at plain's median: a fixed host cost reads the same µs in the faster and the slower half.
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
    blocks: dict[str, list[float]] = {}
    for path in args.runs:
        run = json.loads(Path(path).read_text(encoding="utf-8"))[args.model]
        for variant, walls in run["blocks_ms"].items():
            blocks.setdefault(variant, []).extend(walls)
    plain = blocks.pop("plain")
    floor = next((v for v in blocks if v.startswith("floor")), None)
    print(f"{len(args.runs)} runs, {len(plain)} rounds; plain {statistics.median(plain):.2f} ms a "
          f"step (blocks {min(plain):.1f} to {max(plain):.1f} ms)")
    for variant, walls in blocks.items():
        ratios = [b / a - 1.0 for a, b in zip(plain, walls, strict=True)]
        lo, hi = median_ci95(ratios)
        line = (f"  {variant:22s} {statistics.median(ratios) * 100:+6.2f} % "
                f"({lo * 100:+.2f} .. {hi * 100:+.2f})")
        if floor is not None and variant not in (floor, "plain_again"):
            gaps = [(b - f) / a for a, b, f in zip(plain, walls, blocks[floor], strict=True)]
            us = [(b - f) * 1e3 for b, f in zip(walls, blocks[floor], strict=True)]
            (glo, ghi), (ulo, uhi) = median_ci95(gaps), median_ci95(us)
            line += (f"; over the floor {statistics.median(gaps) * 100:+.2f} points ({glo * 100:+.2f}"
                     f" .. {ghi * 100:+.2f}), {statistics.median(us):+.0f} µs a step ({ulo:+.0f} .. "
                     f"{uhi:+.0f})")
            order = sorted(range(len(plain)), key=plain.__getitem__)
            for half, rounds in (("faster", order[:len(order) // 2]),
                                 ("slower", order[len(order) // 2:])):
                ms = statistics.median(plain[i] for i in rounds)
                line += (f"; {half} half (plain {ms:.2f} ms) "
                         f"{statistics.median(us[i] for i in rounds):+.0f} µs")
        print(line)


if __name__ == "__main__":
    main()
