"""The resolver thread: waits for the device to pass each closed step's marks, then reports.

It turns marks into seconds without a host sync (Python marks: `query()` first, `elapsed_time`
after; native CUDA marks: the elapsed time alone, which answers not-ready until then), builds
the StepReport, runs the rules, feeds the sinks, and keeps the hang signal current. With a report
rate, a steady step is only counted, in C++ where it can be (steps/steady.py).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..capture.calls import Call
from ..capture.timers import relax_capture_mode
from .boundary import ClosedStep
from .counting import Counter, ReportRate, rows, step_report
from .peaks import StepPeaks
from .quiet import Handed, QuietRun
from .records import StepReport
from .steady import SteadySteps

GRAPH_BACKWARD = "graph_capture_backward"
"""The reason for a call whose forward was measured and whose backward ran while a CUDA (NPU)
graph captured the stream: no mark can be taken there, and the work runs at each replay."""

_POLL_S = 0.02
"""How often the thread looks again while flush() waits for marks the device has not passed."""
_BATCH_S = 0.5
"""How often it looks otherwise: closed steps are resolved in batches, back to back while the
caches their work shares are warm (139 µs of CPU a launch-bound step, against 177 with a wake
every 0.1 s: BENCHMARKS.md, run 86); a report reaches the sinks up to a second after its step."""
_DEFER_S = 0.5
"""With native marks a pass waits, at most this long, for a backward window."""
_TICK_S = 0.5
Pending = Handed | threading.Event
_BACKWARD_GRACE_S = 5.0


class Resolver:
    """Owns the queue of closed steps and the thread that resolves them in order."""

    def __init__(self, *, rank: int, history: int,
                 open_calls: Callable[[], list[Call]],
                 on_report: Callable[[StepReport], None],
                 on_tick: Callable[[float], None],
                 on_error: Callable[[str, BaseException], None],
                 native_timers: Callable[[], list[Any]] = list,
                 tap: Callable[[], Any] = lambda: None,
                 unmeasured: dict[str, int] | None = None,
                 reports_per_second: float = 0.0, counter: Counter | None = None):
        self.rank = rank
        self.history: collections.deque[StepReport] = collections.deque(maxlen=history)
        self.oldest_inflight_seconds = 0.0
        self.cpu_seconds = 0.0
        """This thread's CPU time so far: fadiag's own cost beside training, read at each tick and
        before each flush() is answered (the training thread's share, µs a call, is not in it)."""
        self.step_peak_bytes: int | None = None
        self._open_calls = open_calls
        self._on_report = on_report
        self._on_tick = on_tick
        self._on_error = on_error
        self._native_timers = native_timers
        self.rate = ReportRate(reports_per_second if counter is not None else 0.0)
        """sampling.reports_per_second: which steps are counted (`counter`), not reported."""
        self._counter = counter
        self._steady: SteadySteps | None = None  # steady steps counted in C++, for the tap now in
        self._tap = tap
        """The dispatcher tap now installed, or None (its uncut records, for the hang check)."""
        self.unmeasured = {} if unmeasured is None else unmeasured
        """Calls found unmeasured here, by reason, cumulative (the recorder's
        `resolved_unmeasured`, which its totals read)."""
        self._queue: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        """Closed steps in order (one at a time, or a run of them closed in C++: steps/quiet.py),
        and flush()'s markers among them: a marker is set once every step submitted before it is
        resolved or dropped (so submit() takes no lock)."""
        self._pending: collections.deque[Pending] = collections.deque()
        self._stop = threading.Event()
        self._hurry = threading.Event()
        """Set by flush(): someone waits for the results, so nothing is deferred."""
        self._wake = threading.Event()
        self._peaks = StepPeaks()
        self._next_tick = 0.0
        self._thread = threading.Thread(target=self._run, name="fadiag-resolver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, step: Handed) -> None:
        """Hand over a closed step, or a run of them; it wakes nothing (the thread looks every
        _BATCH_S)."""
        self._queue.put(step)

    def stop(self, timeout: float = 5.0) -> None:
        """Resolve what is pending (up to `timeout`), then end the thread."""
        self.flush(timeout)
        self._stop.set()
        self._wake.set()
        self._wake_window()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every step submitted so far is resolved; True if it happened in time."""
        if not self._thread.is_alive():
            return self._queue.empty() and not any(
                isinstance(s, (ClosedStep, QuietRun)) for s in self._pending)
        done = threading.Event()
        self._queue.put(done)
        self._hurry.set()
        self._wake.set()
        self._wake_window()
        try:
            return done.wait(timeout)
        finally:
            self._hurry.clear()

    def _wake_window(self) -> None:
        """End a wait for a backward window (_await_window) now, not at its timeout (_BATCH_S)."""
        for t in self._native_timers():
            t.wake_window()

    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        relaxed: bool | None = None  # this thread's CUDA graph capture mode (relax_capture_mode)
        while not self._stop.is_set():
            # Woken only by the clock, flush() and stop(): every wake has to take the GIL from
            # the training thread, and on a busy host each one costs it far more than the work.
            self._wake.wait(_POLL_S if self._hurry.is_set() else _BATCH_S)
            self._wake.clear()
            try:
                if relaxed is None:  # before this thread's first event query on CUDA
                    relaxed = relax_capture_mode()
                while True:
                    self._pending.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            try:
                self._resolve_pending()
                now = time.monotonic()
                if now >= self._next_tick:
                    self._next_tick = now + _TICK_S
                    self._tick()
            except Exception as e:
                self._on_error("resolver", e)
                if self._pending:
                    self._drop_head()

    def _drop_head(self) -> None:
        """A step that cannot be resolved is dropped, once, and its marks given back (of a run of
        steps closed in C++, its first); a flush() marker is set."""
        head = self._pending[0]
        dropped: Pending = (head.split() if isinstance(head, QuietRun) and len(head) > 1
                            else self._pending.popleft())
        if isinstance(dropped, threading.Event):
            dropped.set()
            return
        try:
            dropped.drop_tap()
        except Exception as e:
            self._on_error("resolver.tap", e)
        self._release(list(dropped.calls))

    def _resolve_pending(self) -> None:
        """One pass: resolve pending steps in order until one the device has not passed."""
        windowed = True  # until a wait for a backward window gives up, in this pass
        while self._pending:
            head = self._pending[0]
            if isinstance(head, threading.Event):  # a flush() waiting for the steps before
                self._merge()
                self.cpu_seconds = time.thread_time()
                head.set()
                self._pending.popleft()
                continue
            if windowed:
                windowed = self._await_window()
            if isinstance(head, QuietRun):
                if not self._quiet_head(head):
                    break
                continue
            counted, why = self._count_run()
            if why == 0:  # a mark the device has not passed
                break
            if counted:
                continue
            if not self._try_resolve(head):
                break
            self._pending.popleft()
        self._merge()

    def _count_run(self) -> tuple[int, int]:
        """The steady steps at the head of the pending ones counted together in C++, one call
        and one release of the GIL for the run, where `_try_resolve` takes a step at a time
        (SteadySteps.count_head): (counted, why the next was not), (0, -1) with no run."""
        steady = self._steady_for(self._pending[0])  # type: ignore[arg-type]
        if steady is None:
            return 0, -1
        newest = self._last_pending() if self._queue.empty() else None  # always reported
        counted, why = steady.count_head(self._pending, newest, self.rate.due, _BACKWARD_GRACE_S)
        self.rate.counted += counted  # closed before a report was due: as counted_only counts
        return counted, why

    def _quiet_head(self, run: QuietRun) -> bool:
        """Steps closed in C++ at the head: those before one due for a report (and before the
        newest) counted in one C++ call where steady steps are counted; the first that is not,
        made the ClosedStep the Python boundary would have made of it and put before the rest,
        to be resolved as one. False: a mark the device has not passed (nothing changed)."""
        steady = self._steady_for(run)
        if steady is not None:
            closed = run.closed()  # the newest run's last step: always reported
            n = self.rate.due_from(closed[:-1] if self._newest(run) else closed)
            if n:
                counted, why = steady.count_quiet(run, n, _BACKWARD_GRACE_S)
                self.rate.counted += counted  # closed before a report was due, as _count_run's
                if why == 0:
                    return False
        step = run.split() if run else None
        if not run:
            self._pending.popleft()
        if step is not None:
            self._pending.appendleft(step)
        return True

    def _await_window(self) -> bool:
        """With native marks, wait for a backward window before resolving a step; False when the
        wait gave up (or there is no window to wait for).

        While a hooked backward runs, the training thread is blocked in backward() with the GIL
        released, so a step resolved then takes the least from training (the autograd engine
        still takes the GIL to free tensors Python held: on a launch-bound step the resolver's
        Python costs about its own time wherever it runs, BENCHMARKS.md runs 67-79). One step at
        a time, each in an open window (all pending at each wake read +11.1 % against +9.0 %,
        run 74). The wait holds no GIL; it gives up after _DEFER_S without a window, and the
        pass then resolves the rest without waiting again; flush() and stop() end it at once.
        """
        t = self._window_timer()
        if t is None:
            return False
        deadline = time.monotonic() + _DEFER_S
        while not (self._stop.is_set() or self._hurry.is_set()):
            if t.window():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            t.wait_window(min(left, _BATCH_S))
        return False

    def _window_timer(self) -> Any:
        """The native timer whose backward window to wait for: the accelerator's where it takes
        marks (`native: on` on CUDA also adopts a CPU timer, whose window never opens there)."""
        timers = [t for t in self._native_timers() if t.pool_size()]
        return next((t for t in timers if t.kind != "cpu"), timers[0] if timers else None)

    def _try_resolve(self, step: ClosedStep) -> bool:
        """Report `step` if the device has passed every mark it needs; False to look again."""
        give_up = time.monotonic() - step.closed >= _BACKWARD_GRACE_S
        steady = self._steady_for(step)
        seen = None
        if steady is not None:
            if not (self.rate.due(step.closed) or self._newest(step)):
                done = steady.count(step, give_up)
                if done >= 0:  # 1: counted in C++ (True); 0: a mark the device has not passed
                    return done == 1 and self.rate.counted_only(step.closed, steady=True)
            seen = steady.before(step)
        tap = step.tap
        if tap is not None:
            try:
                step.take_tap()
            except Exception as e:  # its linked calls stay unmarked: not timed
                self._on_error("resolver.tap", e)
                step.lose_linked(tap)
        calls: list[Call] = []
        untimed: list[Call] = []  # calls that raised or were never learned
        in_graph = 0  # a backward captured into a CUDA graph: not measured (graph_backward)
        learned = False  # a call that learned its signature (probe): always reported
        for c in step.calls:
            if c.graph_backward and not c.aborted:
                in_graph += 1
                untimed.append(c)
            elif c.aborted or c.sig is None:
                untimed.append(c)
            else:
                calls.append(c)
                learned = learned or c.probe
        if steady is not None and not (untimed or learned or step.unmeasured):
            steady.learn(seen, step.calls)
        if untimed:
            self._release(untimed)
        by_timer: dict[Any, list[Call]] = {}
        for c in calls:
            by_timer.setdefault(c.timer, []).append(c)
        seconds: dict[Call, tuple[float, float, int, int]] = {}
        for t, group in by_timer.items():  # one group per device kind; native: one C++ call
            s = t.seconds([(c.fwd0, c.fwd1, c.bwd0, c.bwd1) for c in group], give_up)
            if s is None:
                return False
            seconds.update(zip(group, s, strict=True))
        for t, group in by_timer.items():  # every group read before any mark is given back
            t.release(*(m for c in group for m in (c.fwd0, c.fwd1, c.bwd0, c.bwd1)))
            for c in group:
                c.fwd0 = c.fwd1 = c.bwd0 = c.bwd1 = None
        timed = [(c, *seconds[c]) for c in calls]
        kept = [t for t in timed if not t[2] < 0]  # backward -1: native marks refused in a capture
        in_graph += len(timed) - len(kept)
        if in_graph:
            step.count(GRAPH_BACKWARD, in_graph)
            self.unmeasured[GRAPH_BACKWARD] = self.unmeasured.get(GRAPH_BACKWARD, 0) + in_graph
        # The newest step handed over is always reported: every counted step is then followed by
        # a report that counts it (`counted_before`), and after a flush last_step() is the newest.
        counter = self._counter
        if counter is not None and self.rate.per_second > 0 and self.rate.counted_only(
                step.closed, steady=not (untimed or learned or step.unmeasured
                                         or self._newest(step))):
            counter.count(rows(kept))
        else:
            self._report(step, kept)
        return True

    def _steady_for(self, step: Handed) -> SteadySteps | None:
        """The C++ counting of steady steps for `step`'s tap, where steps are counted at all."""
        if self._counter is None or self.rate.per_second <= 0 or step.tap is None:
            return None
        if self._steady is None or self._steady.tap is not step.tap:
            self._merge()
            self._steady = SteadySteps(step.tap, self._counter.bounds)
        return self._steady

    def _merge(self) -> None:
        """What the C++ tally counted since the last look, into the metrics."""
        summed = self._steady.take() if self._steady is not None else None
        if summed is not None and self._counter is not None:
            self._counter.merge(*summed)

    def _newest(self, step: Handed) -> bool:
        """Whether `step` is the newest closed step (or run) handed over (none after it pending),
        looked for from the end (flush markers are all that can follow it)."""
        if not self._queue.empty():
            return False
        last = self._last_pending()
        return last is None or last is step

    def _last_pending(self) -> Handed | None:
        """The last closed step (or run of them) among the pending ones (flush markers may follow
        it), or None."""
        return next((s for s in reversed(self._pending)
                     if isinstance(s, (ClosedStep, QuietRun))), None)

    def _release(self, calls: list[Call]) -> None:
        """Give back the marks of calls that will not be timed (a hook that fires later takes a
        fresh mark, which the call never uses)."""
        for c in calls:
            try:
                c.timer.release(c.fwd0, c.fwd1, c.bwd0, c.bwd1)
            except Exception as e:
                self._on_error("resolver.release", e)
            c.fwd0 = c.fwd1 = c.bwd0 = c.bwd1 = None

    def _report(self, step: ClosedStep, timed: list[tuple[Call, float, float, int, int]]) -> None:
        report = step_report(step, timed, self.rank, self._step_peak(step), self.rate.reported())
        self._merge()  # the steps it counts before it are in the metrics first
        self._on_report(report)
        self.history.append(report)

    def _step_peak(self, step: ClosedStep) -> int | None:
        """Allocator peak since the previous step, or the process RSS on CPU (StepPeaks)."""
        return self._peaks.of({c.timer.kind: c.timer for c in step.calls if c.sig is not None},
                              step.device)

    def _tick(self) -> None:
        self.cpu_seconds = time.thread_time()
        now_ns = time.monotonic_ns()
        oldest = 0
        calls = self._open_calls()
        for step in list(self._pending):
            if isinstance(step, ClosedStep):
                calls.extend(step.calls)
        for c in calls:
            if c.aborted or (c.link and c.fwd0 is None):  # the tap's until resolved: below
                continue
            t = c.timer
            host_busy = c.fwd1 is None or (t.recorded(c.bwd0) and not t.recorded(c.bwd1))
            if host_busy or not t.done(c.fwd1) or (t.recorded(c.bwd1) and not t.done(c.bwd1)):
                oldest = max(oldest, now_ns - c.host_ns)
        tap = self._tap()
        if tap is not None:
            since = tap.oldest_open_ns()
            if since >= 0:
                oldest = max(oldest, now_ns - since)
        self.oldest_inflight_seconds = oldest * 1e-9
        self._on_tick(self.oldest_inflight_seconds)

