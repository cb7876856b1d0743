"""Timing marks: a pool of device events (CUDA, Ascend NPU), C++ slots (the native extension) or
host-clock readings (CPU), and each window's seconds once the device has passed its marks.

Part of the device seam (capture/device.py, which picks a timer per device kind): only these two
modules touch `torch.cuda` / `torch.npu`.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch


def _seconds_each(timer: Any, marks: list[tuple[Any, Any, Any, Any]],
                  give_up_open_backward: bool) -> list[tuple[float, float, int, int]] | None:
    """(forward, backward) seconds per call from marks read one at a time, then the host ns each
    window may hold (`timer.held`); None while a mark the device has not passed is needed. A
    backward that started and has not ended is waited for unless `give_up_open_backward`; an
    unmeasured backward reads 0."""
    done, recorded, elapsed, held = timer.done, timer.recorded, timer.elapsed, timer.held
    for f0, f1, b0, b1 in marks:
        # Both ends are queried: on NPU, elapsed_time synchronises unless both are done.
        if not (done(f0) and done(f1)):
            return None
        if recorded(b0):
            if not recorded(b1):
                if not give_up_open_backward:
                    return None
            elif not (done(b0) and done(b1)):
                return None
    out = []
    for f0, f1, b0, b1 in marks:
        backward = recorded(b0) and recorded(b1)
        out.append((elapsed(f0, f1), elapsed(b0, b1) if backward else 0.0,
                    held(f0, f1), held(b0, b1) if backward else 0))
    return out


class CpuTimer:
    """Host clock: a mark is `perf_counter_ns()`; it is done as soon as it is taken."""

    kind = "cpu"
    name = "cpu"
    native = False

    def mark(self, since: Any = None) -> int:
        return time.perf_counter_ns()

    @staticmethod
    def capturing() -> bool:
        return False

    @staticmethod
    def recorded(mark: Any) -> bool:
        return mark is not None

    @staticmethod
    def held(start: Any, end: Any) -> int:
        """A CPU window is host time: none of it is "held" host time (see EventTimer.held)."""
        return 0

    @staticmethod
    def done(mark: Any) -> bool:
        return True

    @staticmethod
    def elapsed(start: Any, end: Any) -> float:
        return (end - start) * 1e-9

    seconds = _seconds_each

    def release(self, *marks: Any) -> None:
        pass

    def memory_stats(self, device: int | None = None) -> dict[str, int] | None:
        return None

    def current_device(self) -> int | None:
        return None

    def pool_size(self) -> int:
        return 0

    def marks_in_use(self) -> int:
        return 0


class EventTimer:
    """Device events for CUDA and Ascend NPU, which share the event API.

    `elapsed_time` on NPU synchronises, so it is only ever called once `query()` has returned
    True for both events; on CUDA that ordering is what keeps it free of a sync as well.
    """

    native = False

    def __init__(self, kind: str, module: Any):
        self.kind = kind
        self._module = module
        self._event = module.Event
        self._free: deque[Any] = deque()
        self._created = 0
        fast = _fast_cuda_stream() if kind == "cuda" else None
        # Both set, or both None (the plain path).
        self._stream: Any = fast[0] if fast is not None else None
        self._record: Any = fast[1] if fast is not None else None
        capturing = (getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) if kind == "cuda"
                     else getattr(module, "is_current_stream_capturing", None))
        self.capturing: Callable[[], bool] = capturing or (lambda: False)
        """Whether a CUDA (NPU) graph is capturing the current stream: no mark is taken there,
        since an event recorded or a stream queried in a capture would invalidate it."""
        self.current_device = _current_device_reader(module)
        self.name = device_name(module, kind)

    def mark(self, since: Any = None) -> Any:
        """An event recorded now on the current stream; None (no mark) on a stream a graph is
        capturing. A window's end mark names its start (`since`) and first asks whether the
        device has passed it (`held`)."""
        if self.capturing():
            return None
        try:
            ev = self._free.pop()
        except IndexError:
            ev = self._event(enable_timing=True)
            self._created += 1
        passed = since is not None and bool(since.query())
        if self._stream is not None:
            self._record(ev, self._stream())
        else:
            ev.record()
        ev.fadiag_host = (passed, time.perf_counter_ns())
        return ev

    @staticmethod
    def recorded(mark: Any) -> bool:
        return mark is not None

    @staticmethod
    def held(start: Any, end: Any) -> int:
        """The host ns the window between two marks may hold: their host-clock gap when the
        device had passed the start mark before the end mark was taken, else 0 (at least 1 when
        it had). Passed, the device reached the window while the host was still queueing the
        op's work, and may have waited inside it for the host's launches — idle at the start,
        run dry between the marks, or done with the op before the end mark. Not passed, every
        kernel of the window was queued before the device got there: device time only."""
        t0, (passed, t1) = start.fadiag_host[1], end.fadiag_host
        return max(t1 - t0, 1) if passed else 0

    @staticmethod
    def done(mark: Any) -> bool:
        return bool(mark.query())

    @staticmethod
    def elapsed(start: Any, end: Any) -> float:
        return start.elapsed_time(end) * 1e-3

    seconds = _seconds_each

    def release(self, *marks: Any) -> None:
        self._free.extend(m for m in marks if m is not None)

    def memory_stats(self, device: int | None = None) -> dict[str, int] | None:
        return _allocator_stats(self._module, device)

    def pool_size(self) -> int:
        return self._created

    def marks_in_use(self) -> int:
        """Marks handed out and not given back yet (a leak shows here)."""
        return self._created - len(self._free)


class NativeTimer:
    """Marks taken by the native extension (`fadiag/capture/native.py`): a mark is a slot number.

    Besides `mark()`, it ends a forward in C++ (`finish`: the end mark, then hooks on the
    backward), so the two backward marks need neither the GIL nor a Python call. The pool hands
    slots out and takes them back from the resolver; a released slot disarms any hook still
    holding it.
    """

    native = True
    mark: Callable[..., int]
    """Take a slot and mark it now; a window's end mark names its start (`since`, as
    EventTimer.mark)."""
    finish: Callable[[Any, tuple[int, ...], int], tuple[int, int | None, int | None]]
    """The end mark of the forward that `start` opened, then C++ hooks on `out`'s backward (start)
    and on the end node that `path` leads to: (forward end, backward start, backward end), the
    last two None when `out` cannot be hooked."""

    def __init__(self, kind: str, extension: Any, module: Any = None):
        self.kind = kind
        self._module = module
        self._marks = extension.Marks(kind == "cuda")
        self._fast_begin = getattr(extension, "FastBegin", None)  # None before Python 3.11
        # CUDA's allocator figures read in C++ without the GIL (the resolver reads them each step).
        self._allocator_stats = (getattr(extension, "allocator_stats", None)
                                 if kind == "cuda" and module is torch.cuda else None)
        self.current_device = _current_device_reader(module)
        self._errors_seen = 0
        self.backward_starts_seen = 0
        self.name = device_name(module, kind) if module is not None else "cpu"
        # Bound C++ methods: each mark is one call, with no Python frame of fadiag's around it.
        self.mark = self._marks.take
        self.capturing = self._marks.capturing
        self.finish = self._marks.finish
        self.recorded = self._marks.recorded
        self.done = self._marks.done
        self.elapsed = self._marks.elapsed
        self.backward_starts = self._marks.backward_starts
        self.in_backward = self._marks.in_backward
        self.reset_in_backward = self._marks.reset_in_backward
        self.window = self._marks.window
        self.wait_window = self._marks.wait_window
        self.wake_window = self._marks.wake_window
        self._give_back_all = self._marks.give_back_all

    def fast_begin(self, *state: Any) -> Any:
        """The C++ start of a steady-state SDPA call on this timer's device (see `FastBegin` in
        marks.cpp for `state`), or None where the build has none."""
        if self._fast_begin is None:
            return None
        return self._fast_begin(self._marks, self, self.kind, *state)

    def seconds(self, marks: list[tuple[Any, Any, Any, Any]],
                give_up_open_backward: bool) -> list[tuple[float, float, int, int]] | None:
        """All of a step's calls in one C++ call, made without the GIL (as _seconds_each)."""
        flat = [-1 if m is None else m for quad in marks for m in quad]
        out = self._marks.seconds(flat, give_up_open_backward)
        if out is None:
            return None
        return [(out[i], out[i + 1], int(out[i + 2]), int(out[i + 3]))
                for i in range(0, len(out), 4)]

    def release(self, *marks: Any) -> None:
        self._give_back_all([m for m in marks if m is not None])

    def pool(self) -> Any:
        """The C++ pool these marks are slots of (the dispatcher tap takes its marks from it)."""
        return self._marks.pool()

    def new_errors(self) -> int:
        """Marks that failed in C++ since the last call (hooks cannot raise into autograd)."""
        total = self._marks.errors()
        new, self._errors_seen = total - self._errors_seen, total
        return new

    def memory_stats(self, device: int | None = None) -> dict[str, int] | None:
        read = self._allocator_stats
        if read is not None:
            stats = read(-1 if device is None else device)
            if stats is not None:
                current, peak, allocated = stats
                return {"current": current, "peak": peak, "allocated": allocated}
        return _allocator_stats(self._module, device) if self._module is not None else None

    def pool_size(self) -> int:
        return int(self._marks.events_created() if self.kind == "cuda" else self._marks.slots())

    def marks_in_use(self) -> int:
        """Slots handed out and not given back yet (a leak shows here)."""
        return int(self._marks.in_use())


def device_name(module: Any, kind: str) -> str:
    try:
        return str(module.get_device_name())
    except Exception:
        return kind


def _current_device_reader(module: Any) -> Callable[[], int | None]:
    """This thread's current device index for a timer on `module` (None for the host clock): the
    resolver thread's is not the training thread's. On CUDA the C call itself, not
    torch.cuda.current_device(), a Python function around it."""
    if module is None:
        return lambda: None
    if module is torch.cuda and hasattr(torch._C, "_cuda_getDevice"):
        return torch._C._cuda_getDevice  # type: ignore[no-any-return]
    return module.current_device  # type: ignore[no-any-return]


def _allocator_stats(module: Any, device: int | None = None) -> dict[str, int]:
    """The allocator's figures for `device` (default: this thread's current device)."""
    if module is torch.cuda and hasattr(torch._C, "_cuda_memoryStats"):
        # The nested form: `memory_stats()` flattens it in Python, ~10x the cost of reading it.
        nested = torch._C._cuda_memoryStats(torch._C._cuda_getDevice() if device is None else device)
        allocated = nested.get("allocated_bytes", {}).get("all", {})
        return {"current": int(allocated.get("current", 0)), "peak": int(allocated.get("peak", 0)),
                "allocated": int(allocated.get("allocated", 0))}
    stats = module.memory_stats() if device is None else module.memory_stats(device)
    return {
        "current": int(stats.get("allocated_bytes.all.current", 0)),
        "peak": int(stats.get("allocated_bytes.all.peak", 0)),
        "allocated": int(stats.get("allocated_bytes.all.allocated", 0)),
    }


def _fast_cuda_stream() -> tuple[Callable[[], Any], Callable[..., None]] | None:
    """(current stream, record an event on a stream) without building a Stream object per call.

    `torch.cuda.Event.record()` and `torch.cuda.current_stream()` construct a Python Stream each
    time — most of a record's host cost. The current stream is looked up the same way (per
    thread, so hooks on the autograd thread see the forward's stream) and its Stream object is
    cached. None if this torch build lacks the pieces (the plain path is used then).
    """
    try:
        get_stream = torch._C._cuda_getCurrentStream
        get_device = torch._C._cuda_getDevice
        record = torch._C._CudaEventBase.record
    except AttributeError:
        return None
    streams: dict[Any, Any] = {}

    def current() -> Any:
        data = get_stream(get_device())
        stream = streams.get(data)
        if stream is None:
            stream = streams[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1],
                                                       device_type=data[2])
        return stream

    return current, record


_CU_STREAM_CAPTURE_MODE_RELAXED = 2  # CUstreamCaptureMode (cuda.h)


def relax_capture_mode() -> bool | None:
    """Let the calling thread query events while another thread captures a CUDA graph.

    A capture begun in torch's default mode ("global") forbids every thread the calls that may
    touch a capturing stream, cudaEventQuery among them, and one such call invalidates the
    capture: the resolver's queries of earlier steps' marks would break the user's
    `torch.cuda.graph`. The driver's per-thread mode, made relaxed on the calling thread only,
    lifts that for it; the capturing thread keeps its own. True: set; False: not possible here
    (no CUDA driver, or it refused); None: not yet (CUDA is not initialized in this process).
    """
    if not torch.cuda.is_initialized():
        return None
    try:
        driver = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        exchange = driver.cuThreadExchangeStreamCaptureMode
    except (OSError, AttributeError):
        return False
    mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_RELAXED)
    return exchange(ctypes.byref(mode)) == 0
