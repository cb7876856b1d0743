"""`fadiag run`: start a command with fadiag attached in every Python process that trains.

The child's environment carries the hook (`fadiag/cli/run/_launch/sitecustomize.py`, first on
PYTHONPATH) and its settings; this process forwards signals, prints each rank's metrics URL as
the rank attaches, and returns the child's exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

LAUNCH_DIR = Path(__file__).resolve().parent / "_launch"
PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the folder that holds fadiag/

# Signals a terminal sends to its whole foreground process group: the child already has them.
_TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGQUIT)
FORWARDED = (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
             signal.SIGUSR2)


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """What `fadiag run` passes to the attached processes.

    Example::

        launch(["torchrun", "--nproc-per-node", "2", "train.py"], LaunchOptions(port=9500))
    """

    config: str | None = None
    """YAML config file, read by attach() through FADIAG_CONFIG."""
    port: int | None = None
    """Metrics base port; rank r serves on port + LOCAL_RANK; 0 picks free ports. None: config."""
    jsonl: str | None = None
    """Run log directory (one fadiag-rank<R>.jsonl per rank). None: config."""

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")


def python_path(existing: str | None) -> str:
    """The hook's directory first, then fadiag's own root when it is not a site directory,
    then whatever PYTHONPATH was."""
    parts = [str(LAUNCH_DIR)]
    site_dirs = {os.path.abspath(p) for p in site.getsitepackages()}
    if site.ENABLE_USER_SITE:
        site_dirs.add(os.path.abspath(site.getusersitepackages()))
    if str(PACKAGE_ROOT) not in site_dirs:
        parts.append(str(PACKAGE_ROOT))
    if existing:
        parts.append(existing)
    return os.pathsep.join(parts)


def child_env(environ: Mapping[str, str], options: LaunchOptions, run_dir: str) -> dict[str, str]:
    """The child's environment: the parent's, plus the hook and its settings."""
    env = dict(environ)
    env["PYTHONPATH"] = python_path(environ.get("PYTHONPATH"))
    env["FADIAG_AUTOATTACH"] = "1"
    env["FADIAG_RUN_DIR"] = run_dir
    if options.config is not None:
        env["FADIAG_CONFIG"] = os.path.abspath(options.config)
    if options.port is not None:
        env["FADIAG_PORT"] = str(options.port)
    if options.jsonl is not None:
        env["FADIAG_JSONL"] = os.path.abspath(options.jsonl)
    return env


def exit_status(returncode: int) -> int:
    """A child killed by signal N exits 128 + N, as a shell reports it."""
    return 128 - returncode if returncode < 0 else returncode


class _Announcer(threading.Thread):
    """Prints ``rank R: http://ADDR:PORT/metrics`` once per process that attached."""

    def __init__(self, run_dir: str, out: IO[str]):
        super().__init__(name="fadiag-run-announcer", daemon=True)
        self._dir = Path(run_dir)
        self._out = out
        self._seen: set[str] = set()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.1):
            self.poll()

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.poll()

    def poll(self) -> None:
        found = []
        for p in self._dir.glob("*.json"):
            if p.name in self._seen:
                continue
            self._seen.add(p.name)
            try:
                found.append(json.loads(p.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue
        for rec in sorted(found, key=lambda r: (r.get("rank", 0), r.get("pid", 0))):
            where = (f"http://{rec['addr']}:{rec['port']}/metrics" if rec.get("port")
                     else "no metrics endpoint (exporter disabled or no free port)")
            self._out.write(f"fadiag: rank {rec['rank']}: {where} (pid {rec['pid']})\n")
        if found:
            self._out.flush()


def launch(cmd: Sequence[str], options: LaunchOptions, *, out: IO[str] | None = None,
           environ: Mapping[str, str] | None = None) -> int:
    """Run cmd with fadiag attached; returns its exit status (127 when it cannot be started)."""
    out = out or sys.stderr
    run_dir = tempfile.mkdtemp(prefix="fadiag-run-")
    env = child_env(os.environ if environ is None else environ, options, run_dir)
    base = env.get("FADIAG_PORT")
    out.write(f"fadiag: attaching to the training processes of: {' '.join(cmd)}\n")
    if base and base != "0":
        out.write(f"fadiag: metrics on port {base} + LOCAL_RANK; each rank is listed as it attaches\n")
    out.flush()
    announcer = _Announcer(run_dir, out)
    try:
        try:
            proc = subprocess.Popen(list(cmd), env=env)
        except OSError as e:
            out.write(f"fadiag run: cannot start {cmd[0]}: {e.strerror or e}\n")
            return 127 if isinstance(e, FileNotFoundError) else 126
        announcer.start()
        previous = _forward_signals(proc)
        try:
            returncode = proc.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            announcer.stop()
        return exit_status(returncode)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _forward_signals(proc: subprocess.Popen[Any]) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum: int, frame: Any) -> None:
        if signum in _TERMINAL_SIGNALS and _foreground_of_terminal():
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous: dict[int, Any] = {}
    for signum in FORWARDED:
        previous[signum] = signal.signal(signum, forward)
    return previous


def _foreground_of_terminal() -> bool:
    """True when our process group (which the child shares) is the terminal's foreground group,
    i.e. a key press already delivered the signal to the child."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False
