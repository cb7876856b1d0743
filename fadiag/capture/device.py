"""The device seam: timing marks and memory figures for CUDA, Ascend NPU and CPU.

The only module that touches `torch.cuda` / `torch.npu`. Marks are device events from a reusable
pool (resolved with `query()`, never a host sync) or `perf_counter_ns` integers on CPU.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("fadiag")


def _seconds_each(timer: Any, marks: list[tuple[Any, Any, Any, Any]],
                  give_up_open_backward: bool) -> list[tuple[float, float]] | None:
    """(forward, backward) seconds per call from marks read one at a time; None while a mark the
    device has not passed is needed. A backward that started and has not ended is waited for
    unless `give_up_open_backward`; an unmeasured backward reads 0."""
    done, recorded, elapsed = timer.done, timer.recorded, timer.elapsed
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
    return [(elapsed(f0, f1), elapsed(b0, b1) if recorded(b0) and recorded(b1) else 0.0)
            for f0, f1, b0, b1 in marks]


class CpuTimer:
    """Host clock: a mark is `perf_counter_ns()`; it is done as soon as it is taken."""

    kind = "cpu"
    name = "cpu"
    native = False

    def mark(self) -> int:
        return time.perf_counter_ns()

    @staticmethod
    def recorded(mark: Any) -> bool:
        return mark is not None

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
        self._record = _fast_cuda_record() if kind == "cuda" else None
        self.current_device = _current_device_reader(module)
        self.name = _device_name(module, kind)

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
    def recorded(mark: Any) -> bool:
        return mark is not None

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
    mark: Callable[[], int]
    """Take a slot and mark it now."""
    finish: Callable[[Any, tuple[int, ...]], tuple[int, int | None, int | None]]
    """The forward's end mark, then C++ hooks on `out`'s backward (start) and on the end node that
    `path` leads to: (forward end, backward start, backward end), the last two None when `out`
    cannot be hooked."""

    def __init__(self, kind: str, extension: Any, module: Any = None):
        self.kind = kind
        self._module = module
        self._marks = extension.Marks(kind == "cuda")
        self._fast_begin = getattr(extension, "FastBegin", None)  # None before Python 3.11
        self.current_device = _current_device_reader(module)
        self._errors_seen = 0
        self.backward_starts_seen = 0
        self.name = _device_name(module, kind) if module is not None else "cpu"
        # Bound C++ methods: each mark is one call, with no Python frame of fadiag's around it.
        self.mark = self._marks.take
        self.finish = self._marks.finish
        self.recorded = self._marks.recorded
        self.done = self._marks.done
        self.elapsed = self._marks.elapsed
        self.backward_starts = self._marks.backward_starts
        self.in_backward = self._marks.in_backward
        self.reset_in_backward = self._marks.reset_in_backward
        self.window = self._marks.window
        self.wait_window = self._marks.wait_window
        self._give_back_all = self._marks.give_back_all

    def fast_begin(self, *state: Any) -> Any:
        """The C++ start of a steady-state SDPA call on this timer's device (see `FastBegin` in
        marks.cpp for `state`), or None where the build has none."""
        if self._fast_begin is None:
            return None
        return self._fast_begin(self._marks, self, self.kind, *state)

    def seconds(self, marks: list[tuple[Any, Any, Any, Any]],
                give_up_open_backward: bool) -> list[tuple[float, float]] | None:
        """All of a step's calls in one C++ call, made without the GIL."""
        flat = [-1 if m is None else m for quad in marks for m in quad]
        out = self._marks.seconds(flat, give_up_open_backward)
        return None if out is None else list(zip(out[::2], out[1::2], strict=True))

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
        return _allocator_stats(self._module, device) if self._module is not None else None

    def pool_size(self) -> int:
        return int(self._marks.events_created() if self.kind == "cuda" else self._marks.slots())

    def marks_in_use(self) -> int:
        """Slots handed out and not given back yet (a leak shows here)."""
        return int(self._marks.in_use())


def _device_name(module: Any, kind: str) -> str:
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


class Devices:
    """One timer per device kind, created on first use.

    `native` chooses the marks: "auto" uses the native extension on CUDA once a background build
    (or load of the cached build) is done, with Python events until then; "on" builds it at first
    use, for CUDA and CPU, and waits; "off" keeps Python marks. NPU always uses Python marks.
    """

    def __init__(self, override: str = "auto", native: str = "off"):
        self._override = override
        self._native = native
        self._timers: dict[str, Any] = {}
        self.native_timers: list[NativeTimer] = []
        self._closed = False

    def timer(self, device_type: str) -> Any:
        kind = device_type if self._override == "auto" else self._override
        t = self._timers.get(kind)
        if t is None:
            # setdefault: a native timer adopted while _make ran (the extension was already
            # loaded, or its background load finished first) is kept, not overwritten.
            t = self._timers.setdefault(kind, self._make(kind))
        return t

    def close(self) -> None:
        """No timer is swapped in after this (a background build finishing late is ignored)."""
        self._closed = True

    def _make(self, kind: str) -> Any:
        timer = _make_timer(kind)
        if kind not in ("cuda", "cpu") or self._native == "off":
            return timer
        from . import native

        if self._native == "on":
            ext = native.load(kind)
            return self._adopt(kind, ext) if ext is not None else timer
        if kind == "cuda":

            def ready(ext: Any) -> None:
                if not self._closed:
                    self._timers[kind] = self._adopt(kind, ext)

            native.load_in_background(kind, ready)
        return timer

    def native_timer(self, kind: str, ext: Any) -> NativeTimer | None:
        """The native timer for `kind`, adopted now if `native` allows it there (the dispatcher tap
        takes its marks from it, so that the calls it times and the recorder's share one pool)."""
        if self._closed or self._native == "off" or (kind, self._native) == ("cpu", "auto"):
            return None
        if kind not in ("cuda", "cpu") or (kind == "cuda" and not getattr(ext, "cuda", False)):
            return None
        t = self._timers[kind] = self._adopt(kind, ext)
        return t

    def _adopt(self, kind: str, ext: Any) -> NativeTimer:
        for t in self.native_timers:  # once per kind, whoever asks first
            if t.kind == kind:
                return t
        t = NativeTimer(kind, ext, torch.cuda if kind == "cuda" else None)
        self.native_timers.append(t)
        log.info("fadiag: native marks in use on %s", kind)
        return t

    def marks(self) -> dict[str, str]:
        """Which marks each device kind in use has now: "native" or "python"."""
        return {k: "native" if isinstance(t, NativeTimer) else "python" for k, t in self._timers.items()}

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


def available(kind: str) -> bool:
    """Whether torch sees a `kind` device ("cpu", "cuda", "npu") here. For "npu", torch_npu is
    imported first: importing it is what registers `torch.npu`."""
    if kind == "cpu":
        return True
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return False
    module = getattr(torch, kind, None)
    try:
        return bool(module is not None and module.is_available())
    except Exception:
        return False


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
    return _device_name(torch.cuda if kind == "cuda" else torch.npu, kind)  # type: ignore[attr-defined]

