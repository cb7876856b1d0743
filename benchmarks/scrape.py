"""Time a /metrics scrape with many per-site series: 96 sites, per-site histograms on.

    python benchmarks/scrape.py
"""

from __future__ import annotations

import statistics
import time
import urllib.request

from prometheus_client import CollectorRegistry

from fadiag.export.prometheus import Metrics
from fadiag.export.server import Server
from fadiag.steps.records import CallRecord, StepReport


def main(sites: int = 96, scrapes: int = 200) -> None:
    registry = CollectorRegistry(auto_describe=False)
    metrics = Metrics(rank=0, registry=registry, per_site=True, max_sites=128)
    calls = [CallRecord(site=f"model.py:42#{i}", impl="flash", shape=(8, 16, 2048, 2048, 64),
                        dtype="bfloat16", causal=True, forward_seconds=2e-4 * (1 + i % 3),
                        backward_seconds=6e-4) for i in range(sites)]
    for step in range(1, 101):
        metrics.emit(StepReport(step=step, forward_seconds=0.02, backward_seconds=0.06,
                                kept_bytes=1 << 20, standard_bytes=1 << 30, peak_bytes=None,
                                calls=calls))
    server = Server(registry, "127.0.0.1", 0, "next")
    url = f"http://127.0.0.1:{server.port}/metrics"
    times, size = [], 0
    for _ in range(scrapes):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url) as r:
            size = len(r.read())
        times.append(time.perf_counter() - t0)
    server.close()
    q = statistics.quantiles(times, n=100)
    print(f"{sites} sites, per-site series: {size / 1024:.0f} KiB, {size and _lines(url, registry)} "
          f"samples; scrape median {statistics.median(times) * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms")


def _lines(url: str, registry: CollectorRegistry) -> int:
    return sum(len(f.samples) for f in registry.collect())


if __name__ == "__main__":
    main()
