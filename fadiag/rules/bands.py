"""Healthy backward/forward bands: the ratios fused kernels were measured at, per device and shape.

The ratio rule's flags say whether a ratio over the threshold is what the kernel does when healthy
(severity info) or beyond it (warning). Every band is a measurement, cited in `source`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..steps.records import SiteSummary

_GRID = "torch 2.11, benchmarks/BENCHMARKS.md ratio grid"
"""The H200 grid: benchmarks/ratio_grid.py on 2026-11-30, causal and not, D 64 and 128, fp16 and
bf16 (benchmarks/results/ratio-grid-h200.json)."""
_GRID_H100 = "torch 2.11, benchmarks/BENCHMARKS.md H100 ratio grid"
"""The same grid on an H100 80GB HBM3 (SXM) on 2026-12-05 (benchmarks/results/ratio-grid-h100.json):
every H100 (PCIe, NVL) runs the same sm_90 kernels, so the band is the card's, matched on "H100"."""
_LLAMA = "and a 16-layer HF Llama at B=2-8"
"""A healthy 16-layer HF Llama (GQA, S=2048, bf16) on cuDNN measured 3.25-3.38 per layer at B=2,
and up to 3.47 at B=8, with and without checkpointing (2026-12-01, benchmarks/BENCHMARKS.md;
benchmarks/results/hf-ckpt-b4-run34.json, hf-ckpt-b8-run34.json)."""


REPEAT_SPREAD = 0.025
"""How far apart the same cell measured in two runs on the card (the grid of 2026-11-30 and
benchmarks/ratio_flags.py's run 19 of 2026-12-01: up to 2.3 %, median 0.3 %). A band's edges are
measurements too, so a ratio within this fraction over the high edge is within the band."""


@dataclass(frozen=True)
class Band:
    """The range of backward/forward ratios one impl measured healthy on one device class at one
    sequence length (Sq = Sk within a factor √2 of `seq_len`)."""

    device: str
    """Device class: matched as a word of the device name ("H200" in "NVIDIA H200")."""
    impl: str
    seq_len: int
    low: float
    high: float
    source: str

    def covers(self, value: float) -> bool:
        return value <= self.high * (1.0 + REPEAT_SPREAD)

    def describe(self) -> str:
        """ "the 2.65-3.48x cudnn measures at S≈2048 on an H200 (torch 2.11, …)" """
        return (f"the {self.low:.2f}-{self.high:.2f}x {self.impl} measures at S≈{self.seq_len} "
                f"on an {self.device} ({self.source})")

    def label(self) -> str:
        """Short, for Flag.band: "cudnn S≈2048 H200: 2.65-3.48x"."""
        return f"{self.impl} S≈{self.seq_len} {self.device}: {self.low:.2f}-{self.high:.2f}x"


def _bands(device: str, impl: str, ranges: dict[int, tuple[float, float]], source: str
           ) -> tuple[Band, ...]:
    return tuple(Band(device, impl, s, lo, hi, source) for s, (lo, hi) in ranges.items())


# Min and max over the grid's 8 cells of each (impl, S), rounded outward to 0.01; the grid keeps
# the GPU ahead of the host, as GPU-bound training does, so these are kernel times as fadiag
# reports them. tests/test_bands.py checks them against the committed results file.
BANDS: tuple[Band, ...] = (
    _bands("H200", "flash", {1024: (3.30, 3.62), 2048: (2.99, 3.29), 4096: (2.82, 3.07),
                             8192: (2.73, 2.99)}, _GRID)
    + _bands("H200", "cudnn", {1024: (2.89, 3.41), 4096: (2.57, 2.99), 8192: (2.52, 2.88)}, _GRID)
    + _bands("H200", "cudnn", {2048: (2.65, 3.48)}, f"{_GRID}, {_LLAMA}")
    + _bands("H200", "efficient", {1024: (2.92, 3.31), 2048: (2.92, 3.31), 4096: (2.94, 3.28),
                                   8192: (2.98, 3.25)}, _GRID)
    + _bands("H100", "flash", {1024: (3.41, 3.75), 2048: (3.04, 3.37), 4096: (2.85, 3.12),
                             8192: (2.75, 3.02)}, _GRID_H100)
    + _bands("H100", "cudnn", {1024: (3.07, 3.73), 2048: (2.72, 3.27), 4096: (2.59, 3.03),
                             8192: (2.53, 2.85)}, _GRID_H100)
    + _bands("H100", "efficient", {1024: (3.01, 3.45), 2048: (3.02, 3.38), 4096: (3.05, 3.34),
                                   8192: (3.11, 3.32)}, _GRID_H100)
)
"""Only what was measured: other devices, impls, lengths, fp32 and Sq != Sk have no band."""

_HALF = ("float16", "bfloat16")


def band_for(site: SiteSummary, device_name: str) -> Band | None:
    """The healthy band for a site's impl, shape and device, or None where none was measured."""
    if site.device not in ("cuda", "") or site.dtype not in _HALF:
        return None
    _, _, sq, sk, _ = site.shape
    return _band(site.impl, sq, sk, device_name)


@functools.lru_cache(maxsize=4096)
def _band(impl: str, sq: int, sk: int, device_name: str) -> Band | None:
    # Looked up for every judged site of every step (the resolver's busiest rule): cached.
    words = device_name.upper().replace("-", " ").split()
    for band in BANDS:
        if band.impl != impl or band.device not in words:
            continue
        if all(_near(n, band.seq_len) for n in (sq, sk)):
            return band
    return None


def _near(n: int, seq_len: int) -> bool:
    return seq_len / math.sqrt(2) <= n < seq_len * math.sqrt(2)
