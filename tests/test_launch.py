"""fadiag run: which processes attach, the child's environment, and real launches with scrapes."""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fadiag.cli import main
from fadiag.cli.run.launch import LAUNCH_DIR, LaunchOptions, child_env, exit_status, python_path

ROOT = Path(__file__).resolve().parents[1]
HOOK = LAUNCH_DIR / "sitecustomize.py"
PY = "/usr/bin/python3"


def _hook() -> Any:
    spec = importlib.util.spec_from_file_location("fadiag_launch_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _hook()
ON = {"FADIAG_AUTOATTACH": "1"}
WORKER = {"FADIAG_AUTOATTACH": "1", "LOCAL_RANK": "1", "RANK": "1"}
SPAWN = "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)"
TORCH = "/venv/lib/python3.11/site-packages/torch"


@pytest.mark.parametrize("argv, env, attaches", [
    ([PY, "train.py"], ON, True),
    ([PY, "-u", "train.py", "--lr", "1"], WORKER, True),
    ([PY, "-W", "ignore", "-m", "mypkg.train"], ON, True),
    ([PY, "-c", "import torch"], ON, True),
    ([PY, "train.py"], {}, False),
    ([PY, "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], ON, False),
    ([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"], ON, False),
    ([PY, "-m", "torch.distributed.launch", "train.py"], ON, False),
    ([PY, "/venv/bin/accelerate", "launch", "train.py"], ON, False),
    ([PY, "/venv/bin/deepspeed", "train.py"], ON, False),
    # a cluster wrapper that exports LOCAL_RANK does not make the launcher a trainer
    ([PY, "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], WORKER, False),
    ([PY, "-m", "torch.distributed.run", "train.py"], WORKER, False),
    ([PY, "-c", SPAWN, "--multiprocessing-fork"], WORKER, False),
    ([PY, f"{TORCH}/_inductor/compile_worker/__main__.py", "--workers=2"], WORKER, False),
    ([PY, "-m", "torch.utils.collect_env"], ON, False),
])
def test_only_processes_that_train_attach(argv: list[str], env: dict[str, str],
                                          attaches: bool) -> None:
    ok, why = hook.should_attach(argv, env)
    assert ok is attaches, why


@pytest.mark.parametrize("argv, expected", [
    ([PY, "train.py", "-m", "x"], ("script", "train.py")),
    ([PY, "-X", "dev", "-mpkg.mod"], ("module", "pkg.mod")),
    ([PY, "-c", "pass"], ("command", "")),
    ([PY], ("interactive", "")),
    ([PY, "-"], ("interactive", "")),
])
def test_the_program_is_read_from_the_interpreter_arguments(argv: list[str],
                                                            expected: tuple[str, str]) -> None:
    assert hook.program(argv) == expected


def test_settings_reach_attach_as_overrides() -> None:
    assert hook.overrides({"FADIAG_PORT": "0", "FADIAG_JSONL": "/runs"}) == {"port": 0,
                                                                            "jsonl": "/runs"}
    assert hook.overrides({}) == {}


def test_the_hook_comes_first_and_the_users_pythonpath_is_kept() -> None:
    parts = python_path("/a:/b").split(os.pathsep)
    assert parts[0] == str(LAUNCH_DIR)
    assert parts[-2:] == ["/a", "/b"]
    assert python_path(None).split(os.pathsep)[0] == str(LAUNCH_DIR)


def test_the_child_environment_carries_the_settings_as_absolute_paths(tmp_path: Path) -> None:
    env = child_env({"PATH": "/bin"}, LaunchOptions(config="c.yaml", port=9500, jsonl="runs"),
                    str(tmp_path))
    assert env["FADIAG_AUTOATTACH"] == "1"
    assert env["FADIAG_PORT"] == "9500"
    assert env["FADIAG_CONFIG"] == os.path.abspath("c.yaml")
    assert env["FADIAG_JSONL"] == os.path.abspath("runs")
    assert env["FADIAG_RUN_DIR"] == str(tmp_path)
    assert env["PATH"] == "/bin"
    assert "FADIAG_PORT" not in child_env({}, LaunchOptions(), str(tmp_path))


def test_a_child_killed_by_a_signal_exits_like_a_shell_reports_it() -> None:
    assert exit_status(-signal.SIGTERM) == 143
    assert exit_status(3) == 3


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FADIAG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def test_the_hook_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("print('other sitecustomize ran')\n")
    proc = subprocess.run([sys.executable, "-c", "import sys; print('program ran')"],
                          env=_env(PYTHONPATH=f"{LAUNCH_DIR}{os.pathsep}{tmp_path}"),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == ["other sitecustomize ran", "program ran"]


def test_an_attach_failure_is_reported_once_and_the_program_runs_on(tmp_path: Path) -> None:
    broken = tmp_path / "fadiag"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('broken install')\n")
    proc = subprocess.run(
        [sys.executable, "-c", "import torch, torch.nn; print('trained')"],
        env=_env(PYTHONPATH=f"{LAUNCH_DIR}{os.pathsep}{tmp_path}", FADIAG_AUTOATTACH="1"),
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.strip() == "trained"
    assert proc.stderr.count("fadiag: could not attach") == 1
    assert "broken install" in proc.stderr


def test_a_process_that_never_imports_torch_is_left_alone(tmp_path: Path) -> None:
    code = "import sys; print('fadiag' in sys.modules, 'torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code],
                          env=_env(PYTHONPATH=f"{LAUNCH_DIR}{os.pathsep}{ROOT}",
                                   FADIAG_AUTOATTACH="1"),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False False"


@pytest.mark.parametrize("argv, named", [
    (["run"], "CMD"),
    (["run", "--"], "CMD"),
    (["run", "--port", "70000", "--", "true"], "--port"),
    (["run", "--config", "/nonexistent.yaml", "--", "true"], "--config"),
])
def test_bad_run_arguments_exit_2_naming_the_argument(argv: list[str], named: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_a_config_with_a_bad_value_is_refused_before_launch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("exporter:\n  port: -1\n")
    with pytest.raises(SystemExit) as exc:
        main(["run", "--config", str(cfg), "--", "true"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --config" in err and "exporter.port" in err


def test_a_bad_FADIAG_CONFIG_is_refused_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("rules:\n  regression:\n    baseline_file: /nonexistent/b.json\n")
    monkeypatch.setenv("FADIAG_CONFIG", str(cfg))
    with pytest.raises(SystemExit) as exc:
        main(["run", "--", "true"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "the configuration named by FADIAG_CONFIG" in err
    assert f"{cfg}:3: rules.regression.baseline_file must name a baseline" in err


def test_a_jsonl_dir_that_cannot_be_made_is_refused_before_launch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["run", "--jsonl", str(tmp_path / "afile"), "--", "true"])
    assert exc.value.code == 2
    assert f"argument --jsonl: {tmp_path / 'afile'} exists and is not a directory" in capsys.readouterr().err


def test_a_command_that_does_not_exist_exits_127(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--", "fadiag-no-such-command"]) == 127
    assert "cannot start fadiag-no-such-command" in capsys.readouterr().err


# ---- real launches ----------------------------------------------------------------------------

SCRIPT = """\
import os, sys, time
import torch
import torch.nn.functional as F

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 64, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

distributed = "LOCAL_RANK" in os.environ
if distributed:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(Attention())
else:
    model = Attention()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(4):
    model(torch.randn(2, 64, 32)).backward()
    opt.step()
    opt.zero_grad()
print("trained", flush=True)
deadline = time.time() + 50
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.05)
if distributed:
    dist.destroy_process_group()
sys.exit(int(sys.argv[2]))
"""

RANK_LINE = re.compile(r"fadiag: rank (\d+): (http://\S+/metrics)")


class Launched:
    """A `fadiag run` child whose stderr lines are read as they come."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "fadiag", *argv], cwd=ROOT, env=_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self.proc.stdout.read, daemon=True)]  # type: ignore[union-attr]
        for t in self._readers:
            t.start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.err.append(line)
            self.lines.put(line)

    def urls(self, n: int, timeout: float = 45.0) -> dict[int, str]:
        found: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(found) < n:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no metrics URLs after {timeout} s:\n{''.join(self.err)}") from None
            m = RANK_LINE.search(line)
            if m:
                found[int(m.group(1))] = m.group(2)
        return found

    def finish(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for t in self._readers:
                t.join(10)
            self.proc.stdout.close()  # type: ignore[union-attr]
            self.proc.stderr.close()  # type: ignore[union-attr]


def steps_total(url: str, timeout: float = 30.0) -> dict[str, float]:
    """fadiag_steps_total by rank label, once at least one step has resolved."""
    deadline = time.monotonic() + timeout
    while True:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        found = {s.labels["rank"]: s.value for f in text_string_to_metric_families(text)
                 for s in f.samples if s.name == "fadiag_steps_total"}
        if any(v >= 1 for v in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_run_attaches_to_an_unmodified_script_and_returns_its_exit_status(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    stop = tmp_path / "stop"
    launched = Launched(["run", "--port", "0", "--", sys.executable, str(script), str(stop), "3"])
    try:
        urls = launched.urls(1)
        assert list(urls) == [0]
        assert steps_total(urls[0])["0"] >= 1
    finally:
        stop.touch()
        status = launched.finish()
    assert status == 3


def test_run_attaches_to_a_script_that_imports_fadiag_before_torch(tmp_path: Path) -> None:
    # fadiag's own __init__ imports torch: the hook finds fadiag half imported and attaches once
    # it is whole, so the script's own fadiag.step() and the metrics are the launched session's.
    script = tmp_path / "train.py"
    script.write_text("import fadiag\n" + SCRIPT)
    stop = tmp_path / "stop"
    launched = Launched(["run", "--port", "0", "--", sys.executable, str(script), str(stop), "0"])
    try:
        urls = launched.urls(1)
        assert steps_total(urls[0])["0"] >= 1
    finally:
        stop.touch()
        status = launched.finish()
    assert status == 0


def test_run_under_torchrun_serves_one_endpoint_per_rank(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    stop = tmp_path / "stop"
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    launched = Launched(["run", "--port", "0", "--", *launcher, "--standalone",
                         "--nproc-per-node", "2", str(script), str(stop), "0"])
    try:
        urls = launched.urls(2, timeout=55)
        assert sorted(urls) == [0, 1]
        assert urls[0] != urls[1]
        for rank, url in urls.items():
            assert steps_total(url)[str(rank)] >= 1
    finally:
        stop.touch()
        status = launched.finish()
    assert status == 0
    # the launcher process itself never attached: exactly one URL line per rank
    assert sum(bool(RANK_LINE.search(line)) for line in launched.err) == 2


def test_signals_reach_the_child_and_its_status_comes_back(tmp_path: Path) -> None:
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
             "print('ready', file=sys.stderr, flush=True)\n"
             "time.sleep(30)\n")
    launched = Launched(["run", "--", sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 30
        while "ready\n" not in launched.err and time.monotonic() < deadline:
            time.sleep(0.05)
        launched.proc.send_signal(signal.SIGTERM)
    finally:
        status = launched.finish()
    assert status == 42
