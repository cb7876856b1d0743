"""Host CPU contention: how much of the time this process's threads wanted a CPU they waited.

Read at step boundaries from Linux's per-thread scheduler statistics (/proc/self/task/*/schedstat:
time on a CPU, time runnable on a run queue); where they are missing nothing is known (None).
"""

from __future__ import annotations

import contextlib
import os
import time

_TASKS = "/proc/self/task"
_MIN_INTERVAL_NS = 20_000_000
"""Runnable time (all threads) an interval needs before its share is taken: the kernel brings a
running thread's figures up to date at scheduler ticks (1-10 ms), so a sub-millisecond step
alone often reads no change at all."""
_READ_EVERY_NS = _MIN_INTERVAL_NS
"""Wall time between two readings of the files, at most: a reading costs 60-90 µs on a two-core
machine (a listing and one file per thread: half the step boundary's time there), and an
interval needs _MIN_INTERVAL_NS of runnable time, which a busy thread gathers in as much wall
time; the steps between two readings share the latest interval's figure."""


class CpuWait:
    """The share of its runnable time the process spent waiting for a CPU, between two reads.

    On the host clock a preempted thread's wait lands in whatever it was timing; a share near 0
    means the process had its CPUs, 0.3 that another process held a core a third of the time.

    Example::

        wait = CpuWait()
        wait.read()          # None: the first read starts the interval
        train_step()
        wait.read()          # e.g. 0.004 on an idle machine, 0.34 beside a busy process
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._fds: dict[str, int] = {}
        self._last: dict[str, tuple[int, int]] = {}
        self._started = False
        self._share: float | None = None
        self._read_ns = 0
        self.available = os.path.isdir(_TASKS)

    def read(self) -> float | None:
        """wait / (on CPU + wait) of the process's threads over the latest interval that held at
        least 20 ms of their runnable time (a short step reads the share of the interval it is
        part of, or of the previous one); None on the first read and where schedstat is
        missing."""
        if not self.available:
            return None
        now_ns = time.monotonic_ns()
        if self._started and now_ns - self._read_ns < _READ_EVERY_NS:
            return self._share
        self._read_ns = now_ns
        if os.getpid() != self._pid:  # a forked child: the cached files are the parent's threads
            self.close()
            self._pid, self._started, self._share = os.getpid(), False, None
        try:
            tids = os.listdir(_TASKS)
        except OSError:
            self.available = False
            return None
        now: dict[str, tuple[int, int]] = {}
        for tid in tids:
            fd = self._fds.get(tid)
            try:
                if fd is None:
                    fd = self._fds[tid] = os.open(f"{_TASKS}/{tid}/schedstat", os.O_RDONLY)
                run, wait = os.pread(fd, 96, 0).split()[:2]
            except (OSError, ValueError):
                continue  # the thread ended between the listing and the read
            now[tid] = (int(run), int(wait))
        for tid in set(self._fds) - set(now):
            os.close(self._fds.pop(tid))
        if not now and not self._last:
            self.available = False  # schedstat is not provided by this kernel
            return None
        if not self._started:
            self._last, self._started = now, True
            return None
        # Per-thread differences: a thread that ended takes its totals with it, and one that
        # started in the interval ran all of its time in it.
        ran = waited = 0
        for tid, (run_ns, wait_ns) in now.items():
            run0, wait0 = self._last.get(tid, (0, 0))
            ran += run_ns - run0
            waited += wait_ns - wait0
        if ran + waited >= _MIN_INTERVAL_NS:
            self._last, self._share = now, waited / (ran + waited)
        return self._share

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._last = {}
        self._started, self._share = False, None
