"""The bench's own device access: clock, synchronisation, allocator peak, free memory.

The bench owns its process, so unlike the always-on seam in `fadiag.capture.device` it
synchronises freely and resets the allocator's peak counter.
"""

from __future__ import annotations

import contextlib
import platform
import time
from typing import Any

import torch

from ...errors import FadiagError


class DeviceUnavailableError(FadiagError, RuntimeError):
    """The requested device is not usable in this process."""


class Accelerator:
    """The bench's access to one device: clock, synchronisation, allocator peak, free memory.

    The bench owns its process, so unlike the always-on seam in `fadiag.capture.device` it
    synchronises freely and resets the allocator's peak counter.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.device = torch.device(kind)
        self.module: Any = None if kind == "cpu" else getattr(torch, kind)

    @classmethod
    def open(cls, kind: str) -> Accelerator:
        if kind == "npu":
            try:
                import torch_npu  # noqa: F401  (registers torch.npu)
            except ImportError as e:
                raise DeviceUnavailableError(
                    f"torch_npu does not import here ({e}); run on an Ascend machine with "
                    "torch_npu installed, or use --device cpu."
                ) from None
        if kind != "cpu" and not getattr(torch, kind).is_available():
            raise DeviceUnavailableError(
                f"no {kind.upper()} device is available to torch {torch.__version__}; "
                "run on a machine with one, or use --device cpu."
            )
        return cls(kind)

    def name(self) -> str:
        if self.module is not None:
            return str(self.module.get_device_name())
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        return platform.processor() or platform.machine() or "cpu"

    def sync(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def marks(self, n: int) -> Marks:
        return Marks(self.module, n)

    def free_bytes(self) -> int:
        if self.module is None:
            import psutil

            return int(psutil.virtual_memory().available)
        return int(self.module.mem_get_info()[0])

    def start_peak(self) -> int | None:
        """Reset the allocator's peak; returns the bytes allocated now (None on CPU)."""
        if self.module is None:
            return None
        self.sync()
        self.module.reset_peak_memory_stats()
        return int(self.module.memory_allocated())

    def peak_since(self, base: int | None) -> int | None:
        if base is None:
            return None
        self.sync()
        return int(self.module.max_memory_allocated()) - base

    def empty_cache(self) -> None:
        if self.module is not None:
            self.module.empty_cache()


class Marks:
    """Pre-made timing marks: device events on CUDA/NPU, perf_counter_ns on CPU."""

    def __init__(self, module: Any, n: int):
        self._events = module is not None
        self._m: list[Any] = (
            [module.Event(enable_timing=True) for _ in range(n)] if self._events else [0] * n
        )

    def mark(self, i: int) -> None:
        if self._events:
            self._m[i].record()
        else:
            self._m[i] = time.perf_counter_ns()

    def ms(self, i: int, j: int) -> float:
        """Milliseconds from mark i to mark j; call after the device has been synchronised."""
        if self._events:
            return float(self._m[i].elapsed_time(self._m[j]))
        return (self._m[j] - self._m[i]) / 1e6
