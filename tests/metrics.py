"""What a session reports, read as the tests compare it: its metrics as a scrape reads them, and
a report's calls as rows."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

import fadiag


def sample(session: fadiag.Session, name: str, **labels: str) -> float | None:
    """The value of metric sample `name` of rank 0 with `labels` (None: no such sample)."""
    registry = CollectorRegistry()
    registry.register(session.metrics)
    return registry.get_sample_value(name, {"rank": "0", **labels})


def call_rows(report: Any) -> list[tuple]:
    """A step report's calls, sorted: site, impl, recomputation, kept and standard bytes."""
    return sorted((c.site, c.impl, c.recompute, c.kept_bytes, c.standard_bytes)
                  for c in report.calls)
