"""The device seam: which timer each device kind gets, whether a device is there, its name.

With capture/timers.py (the timers themselves) the only modules that touch `torch.cuda` /
`torch.npu`. Marks are device events from a reusable pool (resolved with `query()`, never a host
sync), C++ slots once the native extension is loaded, or `perf_counter_ns` integers on CPU.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .timers import CpuTimer, EventTimer, NativeTimer, device_name

__all__ = ["CpuTimer", "Devices", "EventTimer", "NativeTimer", "available", "default_device_name",
           "default_device_type"]

log = logging.getLogger("fadiag")


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
    return device_name(torch.cuda if kind == "cuda" else torch.npu, kind)  # type: ignore[attr-defined]

