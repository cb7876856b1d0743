"""Baselines for the regression rule: per-site medians keyed by site, shape, dtype and device.

Each entry also records the impl that ran, so a switch at the same shapes (flash to math, the
fallback) is reported as what it is. Written by `fadiag baseline save` (from a live session's
history or a run's JSONL) and read by the regression rule; a file that matches nothing in the
run is a warning, never a crash.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import BaselineError
from ..steps.records import SiteSummary, StepReport, summarize

FORMAT_VERSION = 2
"""2: keys without the impl, which each entry holds. Version 1 files (impl in the key) load."""


def site_key(s: SiteSummary, device: str) -> str:
    """The baseline key of a site: where, what shape and dtype, on what device."""
    b, h, sq, sk, d = s.shape
    return f"{s.site}|{b}x{h}x{sq}x{sk}x{d}|{s.dtype}|{device}"


@dataclass
class Match:
    """A step's sites against a baseline: attention seconds over the sites it knows, and the
    sites whose impl is not the one the baseline ran, as (site, baseline impl, impl now)."""

    observed: float
    expected: float
    changes: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass
class Baseline:
    """Median forward/backward seconds (and the impl) per site key."""

    device: str
    entries: dict[str, dict[str, Any]]
    steps: int = 0

    def expected(self, sites: Iterable[SiteSummary], device: str) -> Match | None:
        """The sites this baseline knows, against it; None when it knows none of them."""
        match = Match(0.0, 0.0)
        matched = False
        for s in sites:
            e = self.entries.get(site_key(s, device))
            if e is None:
                continue
            matched = True
            match.observed += s.forward_seconds + s.backward_seconds
            match.expected += e["forward_seconds"] + e["backward_seconds"]
            if e.get("impl") and e["impl"] != s.impl:
                match.changes.append((s.site, e["impl"], s.impl))
        return match if matched and match.expected > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "device": self.device, "steps": self.steps,
                "entries": self.entries}


def build(reports: Iterable[StepReport], device: str, skip: int = 10) -> Baseline:
    """Median per-site times over `reports`, skipping the first `skip` (warm-up) steps and the
    calls that learned a signature; each entry keeps the impl most of its steps ran."""
    fwd: dict[str, list[float]] = defaultdict(list)
    bwd: dict[str, list[float]] = defaultdict(list)
    impls: dict[str, Counter[str]] = defaultdict(Counter)
    n = 0
    for i, r in enumerate(reports):
        if i < skip:
            continue
        n += 1
        for s in summarize([c for c in r.calls if not c.probe]):
            k = site_key(s, device)
            fwd[k].append(s.forward_seconds)
            bwd[k].append(s.backward_seconds)
            impls[k][s.impl] += 1
    if n == 0:
        raise BaselineError(f"no steps left after skipping the first {skip}; run longer or lower --skip")
    entries = {k: {"forward_seconds": statistics.median(fwd[k]),
                   "backward_seconds": statistics.median(bwd[k]),
                   "impl": impls[k].most_common(1)[0][0]} for k in fwd}
    return Baseline(device=device, entries=entries, steps=n)


def save(baseline: Baseline, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(baseline.to_dict(), f, indent=1, sort_keys=True)


def load(path: str | os.PathLike[str]) -> Baseline:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise BaselineError(f"cannot read baseline file {path}: {e.strerror}") from e
    except ValueError as e:
        raise BaselineError(f"baseline file {path} is not JSON: {e}") from e
    if not isinstance(data, dict) or data.get("version") not in (1, FORMAT_VERSION):
        raise BaselineError(f"baseline file {path}: expected an object with version {FORMAT_VERSION}")
    entries = data.get("entries")
    if not isinstance(entries, dict) or not all(
        isinstance(v, dict) and {"forward_seconds", "backward_seconds"} <= v.keys()
        and all(_is_seconds(v[k]) for k in ("forward_seconds", "backward_seconds"))
        and isinstance(v.get("impl", ""), str)
        for v in entries.values()
    ):
        raise BaselineError(f"baseline file {path}: entries must map keys to forward/backward seconds (and an impl name)")
    steps = data.get("steps", 0)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise BaselineError(f"baseline file {path}: steps must be a count, got {steps!r}")
    if data["version"] == 1:  # site|shape|dtype|device|impl: the impl moves into the entry
        entries = {k.rpartition("|")[0]: {**v, "impl": k.rpartition("|")[2]}
                   for k, v in entries.items()}
    return Baseline(device=str(data.get("device", "")), entries=entries, steps=steps)


def _is_seconds(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
