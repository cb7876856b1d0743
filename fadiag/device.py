"""The device seam: timing marks and memory figures for CUDA, Ascend NPU and CPU.

The only module that touches `torch.cuda` / `torch.npu`. Marks are device events from a reusable
pool (resolved with `query()`, never a host sync) or `perf_counter_ns` integers on CPU.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch


class CpuTimer:
    """Host clock: a mark is `perf_counter_ns()`; it is done as soon as it is taken."""

    kind = "cpu"
    name = "cpu"

    def mark(self) -> int:
        return time.perf_counter_ns()

    @staticmethod
    def done(mark: Any) -> bool:
        return True

    @staticmethod
    def elapsed(start: Any, end: Any) -> float:
        return (end - start) * 1e-9

    def release(self, *marks: Any) -> None:
        pass

    def memory_stats(self) -> dict[str, int] | None:
        return None

    def pool_size(self) -> int:
        return 0


class EventTimer:
    """Device events for CUDA and Ascend NPU, which share the event API.

    `elapsed_time` on NPU synchronises, so it is only ever called once `query()` has returned
    True for both events; on CUDA that ordering is what keeps it free of a sync as well.
    """

    def __init__(self, kind: str, module: Any):
        self.kind = kind
        self._module = module
        self._event = module.Event
        self._free: deque[Any] = deque()
        self._created = 0
        self._record = _fast_cuda_record() if kind == "cuda" else None
        try:
            self.name = str(module.get_device_name())
        except Exception:
            self.name = kind

    def mark(self) -> Any:
        try:
            ev = self._free.pop()
        except IndexError:
            ev = self._event(enable_timing=True)
            self._created += 1
        if self._record is not None:
            self._record(ev)
        else:
            ev.record()
        return ev

    @staticmethod
    def done(mark: Any) -> bool:
        return bool(mark.query())

    @staticmethod
    def elapsed(start: Any, end: Any) -> float:
        return start.elapsed_time(end) * 1e-3

    def release(self, *marks: Any) -> None:
        self._free.extend(m for m in marks if m is not None)

    def memory_stats(self) -> dict[str, int] | None:
        stats = self._module.memory_stats()
        return {
            "current": int(stats.get("allocated_bytes.all.current", 0)),
            "peak": int(stats.get("allocated_bytes.all.peak", 0)),
            "allocated": int(stats.get("allocated_bytes.all.allocated", 0)),
        }

    def pool_size(self) -> int:
        return self._created


def _fast_cuda_record() -> Any:
    """`Event.record()` on the current stream without building a Stream object per call.

    `torch.cuda.Event.record()` calls `torch.cuda.current_stream()`, which constructs a Python
    Stream each time — most of a record's host cost. The current stream is looked up the same
    way (per thread, so hooks on the autograd thread see the forward's stream) and its Stream
    object is cached. Falls back to the plain path if this torch build lacks the pieces.
    """
    try:
        get_stream = torch._C._cuda_getCurrentStream
        get_device = torch._C._cuda_getDevice
        base_record = torch._C._CudaEventBase.record
    except AttributeError:
        return None
    streams: dict[Any, Any] = {}

    def record(ev: Any) -> None:
        data = get_stream(get_device())
        stream = streams.get(data)
        if stream is None:
            stream = streams[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1],
                                                       device_type=data[2])
        base_record(ev, stream)

    return record


def window_peak(before: dict[str, int], after: dict[str, int]) -> int:
    """Peak bytes above `before["current"]` in the window, without resetting the user's peak.

    If the allocator's all-time peak rose in the window, the window peak is exactly the new peak;
    otherwise it lies in [max(A0, A1), A0 + (C1 - C0)] and the upper bound is returned.
    """
    a0 = before["current"]
    if after["peak"] > before["peak"]:
        return after["peak"] - a0
    upper = a0 + (after["allocated"] - before["allocated"])
    return max(0, min(upper, before["peak"]) - a0)


class Devices:
    """One timer per device kind, created on first use."""

    def __init__(self, override: str = "auto"):
        self._override = override
        self._timers: dict[str, Any] = {}

    def timer(self, device_type: str) -> Any:
        kind = device_type if self._override == "auto" else self._override
        t = self._timers.get(kind)
        if t is None:
            t = self._timers[kind] = _make_timer(kind)
        return t

    def name(self) -> str:
        for t in self._timers.values():
            if t.kind != "cpu":
                return str(t.name)
        return default_device_name()


def _make_timer(kind: str) -> Any:
    if kind == "cuda":
        return EventTimer("cuda", torch.cuda)
    if kind == "npu":
        return EventTimer("npu", torch.npu)  # type: ignore[attr-defined]
    return CpuTimer()


def default_device_type() -> str:
    """The accelerator this process would train on: npu, cuda or cpu."""
    npu = getattr(torch, "npu", None)
    if npu is not None:
        try:
            if npu.is_available():
                return "npu"
        except Exception:
            pass
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def default_device_name() -> str:
    kind = default_device_type()
    if kind == "cpu":
        return "cpu"
    module = torch.cuda if kind == "cuda" else torch.npu  # type: ignore[attr-defined]
    try:
        return str(module.get_device_name())
    except Exception:
        return kind

