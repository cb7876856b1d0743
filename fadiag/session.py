"""The session: attach() wires interceptors, recorder, resolver, rules and sinks; detach() undoes it.

One session per process. `attach()` twice returns the same session; `detach()` restores every
patched function by identity and leaves no hook, thread or port behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .capture.device import Devices, default_device_type
from .capture.host import CpuWait
from .capture.interceptors import HF_REGISTRY_MODULE, Interceptors
from .capture.ops import reader_for_layout
from .config import Config
from .config.loader import load_config
from .errors import FadiagError
from .export.jsonl import JsonlSink
from .export.log import LogSink
from .export.prometheus import Metrics
from .export.server import Server
from .export.sinks import CallbackSink, FanOut, Sink
from .rules import baseline as baseline_mod
from .rules.engine import Rules
from .steps.own_cost import OwnCost, Totals
from .steps.quiet import Handed
from .steps.recorder import Recorder
from .steps.records import Flag, StepReport
from .steps.resolver import Resolver
from .version import __version__

log = logging.getLogger("fadiag")

_lock = threading.RLock()
_session: Session | None = None
_instrumented: list[tuple[Any, str | None, str, int | None, int | str | None]] = []


class Session:
    """A running fadiag: what attach() returns.

    Example::

        session = fadiag.attach(port=0)
        train()
        session.flush()  # steps are resolved asynchronously: wait for the last one
        report = session.last_step()
        print(session.port, report.ratio, report.memory_savings)
    """

    def __init__(self, config: Config, on_flag: Callable[[Flag], object] | None = None):
        self.config = config
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.run_id = os.environ.get("FADIAG_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") \
            or uuid.uuid4().hex[:12]
        self.errors = 0
        self._logged_errors: set[str] = set()
        self._optimizer_hook: Any = None
        self._server: Server | None = None
        self.port: int | None = None
        self._tap_errors = 0
        self.devices = Devices(config.device, config.native)
        device_type = default_device_type() if config.device == "auto" else config.device
        self.device_name = self.devices.name() if config.device == "auto" else config.device

        self.metrics = Metrics(
            rank=self.rank, per_site=config.exporter.per_site, max_sites=config.exporter.max_sites,
            build_info={"version": __version__, "torch": torch.__version__, "device": device_type},
            run_info={"rank": str(self.rank), "run_id": self.run_id,
                      "world_size": str(self.world_size), "hostname": socket.gethostname(),
                      "device_name": self.device_name}, capture_info=lambda: self.capture.labels())
        sinks: list[Sink] = [self.metrics, LogSink(config.log.flag_interval_seconds)]
        if config.jsonl.path:
            try:
                sinks.append(JsonlSink(config.jsonl.path, self.rank, self._meta(),
                                       config.jsonl.max_bytes, config.jsonl.backups))
            except OSError as e:
                self._error("jsonl", e)
        if on_flag is not None:
            sinks.append(CallbackSink(on_flag))
        self.sinks = FanOut(sinks, self._error)

        baseline = None
        if config.rules.regression.baseline_file:
            baseline = baseline_mod.load(config.rules.regression.baseline_file)
            if baseline.device and baseline.device != self.device_name:
                log.warning("fadiag: baseline %s was recorded on %s, this run is on %s; "
                            "entries for other devices will not match",
                            config.rules.regression.baseline_file, baseline.device, self.device_name)
        self.rules = Rules(config.rules, device=self.device_name, baseline=baseline, rank=self.rank)
        self._cpu_wait = CpuWait()
        steps = config.steps
        self.recorder = Recorder(
            self.devices, every_n_steps=config.sampling.every_n_steps,
            record_no_grad=steps.record_no_grad, max_calls_per_step=steps.max_calls_per_step,
            fallback_after=steps.fallback_after, verify_every=steps.verify_every,
            on_error=self._error, on_step=self._on_step)
        self.resolver = Resolver(
            rank=self.rank, history=steps.history, open_calls=self.recorder.open_calls,
            on_report=self._on_report, on_tick=self._on_tick, on_error=self._error,
            native_timers=lambda: self.devices.native_timers, tap=lambda: self.recorder.tap,
            unmeasured=self.recorder.resolved_unmeasured,
            reports_per_second=config.sampling.reports_per_second, counter=self.metrics)
        self.capture = Interceptors(config, self.recorder, self._error)
        self._own_cost = OwnCost(config.sampling.every_n_steps,
                                 config.sampling.reports_per_second)

    # ---- lifecycle -------------------------------------------------------------------------

    def _start(self) -> None:
        cfg = self.config
        if cfg.exporter.enabled:
            from prometheus_client import CollectorRegistry

            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(self.metrics)
            port = cfg.exporter.port + self.local_rank if cfg.exporter.port else 0
            self._server = Server(self.registry, cfg.exporter.addr, port, cfg.exporter.on_port_in_use,
                                  cfg.exporter.certfile, cfg.exporter.keyfile)
            self.port = self._server.port
            if self.port is not None:
                log.info("fadiag: rank %d metrics on http://%s:%d/metrics", self.rank,
                         cfg.exporter.addr, self.port)
        self.resolver.start()
        self._install()
        self.recorder.start()

    def _install(self) -> None:
        self.capture.install(_instrumented)
        self._optimizer_hook = register_optimizer_step_post_hook(self._on_optimizer_step)
        self.capture.start_tap()

    @property
    def tap_status(self) -> str:
        """The dispatcher tap: "installed", "loading", "off", "not loaded" or "unavailable: …"."""
        return self.capture.tap_status

    def _instrument(self, fn: Any, name: str | None, layout: str, heads: int | None,
                    causal_arg: int | str | None = None) -> Any:
        return self.capture.instrument(fn, name, layout, heads, causal_arg)

    def close(self) -> None:
        self.capture.closed = True
        self.recorder.stop()
        self.recorder.pending = None
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        self.capture.restore()
        self.recorder.boundary("detach")
        self.capture.uninstall_tap()
        self.devices.close()
        self.resolver.stop()
        self._cpu_wait.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        self.sinks.close()

    # ---- callbacks -------------------------------------------------------------------------

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.recorder.step_hook()

    def _on_step(self, closed: Handed) -> None:
        # Host-clock timings carry every preemption: read, at the boundary, how long the
        # process waited for a CPU, so the rules can tell a busy machine from slow attention.
        if closed.host_clock:
            try:
                closed.cpu_wait = self._cpu_wait.read()
            except Exception as e:
                self._error("cpu wait", e)
        self.resolver.submit(closed)
        if not self.capture.hf_wrapped and HF_REGISTRY_MODULE in sys.modules:
            try:
                self.capture.wrap_transformers()
            except Exception as e:
                self._error("transformers registry", e)

    def _on_report(self, report: StepReport) -> None:
        for t in self.devices.native_timers:
            failed = t.new_errors()
            if failed:
                self._error("native marks", RuntimeError(f"{failed} mark(s) failed in C++"))
        try:
            flags = self.rules.evaluate(report)
        except Exception as e:
            self._error("rules", e)
            flags = []
        self.metrics.baseline_seconds = self.rules.baseline_seconds
        self.metrics.regression_ratio = self.rules.regression_ratio
        self.metrics.contended_steps = dict(self.rules.contended_steps)
        self.sinks.emit(report)
        self.sinks.flags(flags)

    def _on_tick(self, oldest_inflight: float) -> None:
        self.metrics.oldest_inflight_seconds = oldest_inflight
        self.metrics.resolver_cpu_seconds = self.resolver.cpu_seconds
        rec = self.recorder
        for reason, total in rec.unmeasured_totals().items():
            self.metrics.set_uninstrumented(reason, total)
        tap = rec.tap
        if tap is not None:
            errors = tap.counts()["errors"]
            if errors > self._tap_errors:
                self._error("tap", RuntimeError(f"{errors - self._tap_errors} call(s) failed in "
                                                "the dispatcher tap"))
                self._tap_errors = errors
        self.sinks.flags(self.rules.check_hang(oldest_inflight))
        hint = self._own_cost.update(Totals(time.monotonic(), self.resolver.cpu_seconds,
                                            *self.metrics.counts()))
        if hint:
            log.warning(hint)

    def _error(self, where: str, exc: BaseException) -> None:
        """Count an internal error; log the first one of each place, with its traceback."""
        self.errors += 1
        if hasattr(self, "metrics"):
            self.metrics.errors = self.errors
        if where not in self._logged_errors:
            self._logged_errors.add(where)
            log.warning("fadiag: internal error in %s (training continues; counted in "
                        "fadiag_internal_errors_total): %r", where, exc, exc_info=exc)

    def _meta(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "rank": self.rank, "world_size": self.world_size,
                "hostname": socket.gethostname(), "device": self.device_name,
                "fadiag_version": __version__, "torch_version": torch.__version__,
                "start_time": time.time()}

    # ---- public ----------------------------------------------------------------------------

    def last_step(self) -> StepReport | None:
        """The latest fully resolved step, or None before the first."""
        return self.resolver.history[-1] if self.resolver.history else None

    def history(self) -> list[StepReport]:
        """The resolved steps still in memory (at most steps.history), oldest first."""
        return list(self.resolver.history)

    def flush(self, timeout: float = 10.0) -> bool:
        """Close the current step and wait until every step so far is resolved."""
        self.recorder.boundary("manual")
        done = self.resolver.flush(timeout)
        self.metrics.resolver_cpu_seconds = self.resolver.cpu_seconds
        return done

    def save_baseline(self, path: str | os.PathLike[str], skip: int = 10) -> None:
        """Write this session's history as a baseline file for the regression rule."""
        baseline_mod.save(baseline_mod.build(self.history(), self.device_name, skip), path)

    def __repr__(self) -> str:
        return f"<fadiag.Session rank={self.rank} port={self.port} step={self.recorder.step_index}>"


class _DisabledSession(Session):
    tap_status = "off"  # type: ignore[assignment]

    def __init__(self, config: Config):  # noqa: D107 - a session that does nothing
        self.config = config
        self.port = None
        self.errors = 0

    def _start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def last_step(self) -> StepReport | None:
        return None

    def history(self) -> list[StepReport]:
        return []

    def flush(self, timeout: float = 10.0) -> bool:
        return True


def attach(config: str | os.PathLike[str] | dict[str, Any] | Config | None = None, *,
           on_flag: Callable[[Flag], object] | None = None, **overrides: Any) -> Session:
    """Start measuring every attention call; returns the session (the same one if already attached).

    `config` is a YAML path, a dict or a Config; `overrides` are dotted keys or short names
    (``port=0``, ``jsonl="runs/"``, ``"rules.hang.timeout_seconds": 60``). Raises ConfigError
    (a ValueError) on bad configuration, before anything is patched.
    """
    global _session
    with _lock:
        if _session is not None:
            if config is not None or overrides or on_flag is not None:
                log.warning("fadiag: already attached (e.g. by `fadiag run`); this attach()'s "
                            "configuration is ignored — detach() first to change it")
            return _session
        cfg = load_config(config, overrides)
        session: Session = Session(cfg, on_flag) if cfg.enabled else _DisabledSession(cfg)
        try:
            session._start()
        except FadiagError:
            session.close()
            raise
        except Exception as e:
            # An internal fault must not stop training: run without fadiag, say so once.
            log.warning("fadiag: attach failed (%r); training continues without fadiag", e,
                        exc_info=e)
            session.close()
            session = _DisabledSession(cfg)
        _session = session
        return session


def detach() -> None:
    """Stop measuring and restore everything attach() changed; safe to call at any time."""
    global _session
    with _lock:
        session, _session = _session, None
        if session is not None:
            session.close()


def current_session() -> Session | None:
    """The attached session, or None."""
    return _session


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a fork pool) inherits the session but not its threads:
    its attention calls pass through unmeasured, and it lets go of the metrics socket, so the
    port stays the parent's alone and a detach() in the child returns at once."""
    s = _session
    if s is None or isinstance(s, _DisabledSession):
        return
    try:
        s.recorder.stop()
        s.recorder.calls = []
        if s._server is not None:
            s._server.forget_in_child()
    except Exception as e:
        s._error("fork", e)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _detach_at_exit() -> None:
    """At interpreter exit, detach before Python finalizes: the last steps are resolved and
    reported, and no thread of fadiag's is inside C++ with the GIL released when finalization
    starts. (A thread that takes the GIL back then is ended by pthread_exit, whose unwinding
    through a C++ frame aborts the process: "terminate called without an active exception",
    exit status 134, after training that otherwise succeeded.)"""
    try:
        detach()
    except Exception as e:
        log.warning("fadiag: detach at exit failed (%r)", e)


atexit.register(_detach_at_exit)


def step() -> None:
    """Mark a step boundary by hand (for loops without a torch optimizer, or to split steps)."""
    s = _session
    if s is not None and not isinstance(s, _DisabledSession):
        s.recorder.boundary("manual")


def instrument(fn: Any, name: str | None = None, *, layout: str = "BHSD",
               heads: int | None = None, causal_arg: int | str | None = None) -> Any:
    """Measure the user's own attention op: an autograd.Function class or a function.

    For a Function class, existing ``Cls.apply(...)`` call sites are measured and the class is
    returned; for a function, module globals bound to it are rebound and the wrapper is returned.
    `layout` says how its first three tensor arguments (q, k, v) are laid out. Causal is read
    from the parameter named ``is_causal`` or ``causal`` (Function: of its ``forward``), by
    position or keyword, with its default when a call leaves it out; `causal_arg` names another
    parameter, or gives its position in the call (``Fn.apply(q, k, v, True)``: 3).
    """
    reader_for_layout(layout, heads, fn, causal_arg)  # validate now, with a clear error
    with _lock:
        if any(entry[0] is fn for entry in _instrumented):
            return fn
        _instrumented.append((fn, name, layout, heads, causal_arg))
        s = _session
        if s is not None and not isinstance(s, _DisabledSession):
            return s._instrument(fn, name, layout, heads, causal_arg)
    return fn
