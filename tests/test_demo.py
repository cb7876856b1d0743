"""fadiag demo: it trains, serves /metrics while it runs, and each fault raises its flag."""

from __future__ import annotations

import io
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import fadiag
from fadiag.cli import main
from fadiag.cli.demo.training import DemoConfig, SlowAttention, run_demo
from fadiag.export.jsonl import read_run
from tests.native_marks import NEEDS_TAP

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"seq_len": 128, "batch": 2, "dim": 64, "heads": 2, "layers": 2, "vocab": 128}


def _demo(argv: list[str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FADIAG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.Popen([sys.executable, "-m", "fadiag", "demo", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    q: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            q.put(line)
        q.put(None)

    threading.Thread(target=read, daemon=True).start()
    return q


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_demo_trains_the_steps_asked_and_exits_0() -> None:
    proc = _demo(["--steps", "8", "--port", "0"])
    lines = _lines(proc)
    out: list[str] = []
    try:
        while (line := lines.get(timeout=60)) is not None:
            out.append(line)
    finally:
        status = proc.wait(60)
        proc.stdout.close()  # type: ignore[union-attr]
    assert status == 0, "".join(out)
    assert any(re.match(r"metrics: http://\S+/metrics", line) for line in out)
    steps = [line for line in out if line.startswith("step")]
    assert len(steps) == 8 and "impl cpu_flash" in steps[0]
    assert "trained 8 steps" in "".join(out)


def test_demo_serves_metrics_while_it_trains_and_ctrl_c_prints_the_summary_and_exits_130() -> None:
    # Trains until interrupted: the scrapes cannot race the end of the run.
    proc = _demo(["--steps", "0", "--port", "0"])
    lines = _lines(proc)
    out: list[str] = []
    url = None
    scraped: dict[str, float] = {}
    try:
        while (line := lines.get(timeout=60)) is not None:
            out.append(line)
            m = re.match(r"metrics: (http://\S+/metrics)", line)
            if m:
                url = m.group(1)
                assert "fadiag_build_info" in _scrape(url)
            if url and line.startswith("step"):
                scraped = _scrape(url)
                proc.send_signal(signal.SIGINT)
                break
        while (line := lines.get(timeout=60)) is not None:
            out.append(line)
    except BaseException:
        proc.kill()
        raise
    finally:
        status = proc.wait(60)
        proc.stdout.close()  # type: ignore[union-attr]
    assert status == 130, "".join(out)
    assert scraped.get("fadiag_attention_forward_seconds_count", 0) > 0
    assert scraped.get("fadiag_steps_total", 0) >= 1
    text = "".join(out)
    assert "interrupted after" in text and "median forward" in text


def test_plain_demo_runs_the_fused_cpu_kernel_within_the_memory_rule(tmp_path: Path) -> None:
    out = io.StringIO()
    assert run_demo(DemoConfig(steps=3, port=0, jsonl=str(tmp_path), live=False, **SMALL), out) == 0
    run = read_run(tmp_path / "fadiag-rank0.jsonl")
    assert len(run.steps) == 3
    assert {c.impl for s in run.steps for c in s.calls} == {"cpu_flash"}
    assert all(s.memory_savings is not None and s.memory_savings > 0.8 for s in run.steps)
    assert not any(f.rule == "memory_savings" for f in run.flags)
    assert fadiag.current_session() is None


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=NEEDS_TAP)])
def test_compiled_demo_measures_every_layer_through_the_tap_as_eager_does(
        tmp_path: Path, device: str) -> None:
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    for folder, compile in ((eager, False), (compiled, True)):
        cfg = DemoConfig(steps=3, port=0, device=device, compile=compile, jsonl=str(folder),
                         live=False, **SMALL)
        assert run_demo(cfg, io.StringIO()) == 0
    plain, run = (read_run(f / "fadiag-rank0.jsonl") for f in (eager, compiled))
    assert [s.step for s in run.steps] == [1, 2, 3]
    for s in run.steps:
        assert [c.site for c in s.calls] == [f"compiled#{i}" for i in range(SMALL["layers"])]
        assert {c.impl for c in s.calls} == {"cpu_flash"}
        assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in s.calls)
        assert not s.unmeasured
    # The same shapes, so the same memory figures as the eager demo's, from the first step on.
    assert [(s.kept_bytes, s.standard_bytes) for s in run.steps] == \
        [(s.kept_bytes, s.standard_bytes) for s in plain.steps]


def test_force_math_raises_the_memory_savings_flag(tmp_path: Path) -> None:
    out = io.StringIO()
    cfg = DemoConfig(steps=3, port=0, force_math=True, jsonl=str(tmp_path), live=False, **SMALL)
    assert run_demo(cfg, out) == 0
    run = read_run(tmp_path / "fadiag-rank0.jsonl")
    assert {c.impl for s in run.steps for c in s.calls} == {"math"}
    assert any(f.rule == "memory_savings" for f in run.flags)
    assert "memory_savings: 1" in out.getvalue()


def test_slow_backward_raises_the_ratio_flag_for_the_instrumented_function(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The ratio rule judges steady state: not the first warmup_steps (3) steps, and on the host
    # clock the lowest of a site's last host_window_steps (9) windows of 9 steps' fastest
    # ratio (17 steps at the least; a window whose every forward was preempted reads low and
    # holds it back up to 9 more); 40 steps leave it room.
    # Every step is judged (max_cpu_wait 1): this is about the demo's fault, and a machine
    # busier than one neighbour would leave it no step to judge (tests/test_host.py has those).
    config = tmp_path / "fadiag.yaml"
    config.write_text("rules:\n  backward_forward_ratio:\n    max_cpu_wait: 1.0\n")
    monkeypatch.setenv("FADIAG_CONFIG", str(config))
    out = io.StringIO()
    cfg = DemoConfig(steps=40, port=0, slow_backward=True, live=False, **SMALL)
    assert run_demo(cfg, out) == 0
    text = out.getvalue()
    assert "impl demo_slow" in text
    assert "backward_forward_ratio: " in text
    assert not getattr(SlowAttention.apply, "__wrapped_by_fadiag__", False)


@pytest.mark.parametrize("argv, named", [
    (["--steps", "-1"], "--steps"),
    (["--seq-len", "0"], "--seq-len"),
    (["--port", "70000"], "--port"),
    (["--device", "tpu"], "--device"),
    (["--force-math", "--slow-backward"], "--slow-backward"),
    (["--compile", "--force-math"], "--force-math"),
])
def test_bad_demo_arguments_exit_2_naming_the_argument(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    assert f"argument {named}" in capsys.readouterr().err


def test_a_bad_FADIAG_CONFIG_is_refused_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("exporter:\n  port: -1\n")
    monkeypatch.setenv("FADIAG_CONFIG", str(cfg))
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--steps", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{cfg}:2: exporter.port must be an integer 0..65535, got -1" in err
    assert "Traceback" not in err


def test_a_jsonl_dir_that_cannot_be_made_is_refused_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--jsonl", str(tmp_path / "afile" / "runs")])
    assert exc.value.code == 2
    assert "argument --jsonl: cannot create directory" in capsys.readouterr().err


def test_a_device_this_machine_lacks_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "cuda"])
    assert exc.value.code == 2
    assert "argument --device: cuda is not available" in capsys.readouterr().err


def _demo_run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FADIAG_")}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "fadiag", "demo", *argv], cwd=ROOT,
                          env={**base, **env}, capture_output=True, text=True, timeout=120)


def test_a_taken_port_under_on_port_in_use_fail_is_a_message_not_a_traceback(
        tmp_path: Path) -> None:
    config = tmp_path / "fadiag.yaml"
    config.write_text("exporter:\n  on_port_in_use: fail\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = _demo_run(["--steps", "1", "--port", str(port)], FADIAG_CONFIG=str(config))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fadiag demo: cannot serve metrics on 127.0.0.1:{port} ([Errno 98] Address already in "
        "use); set exporter.port or exporter.on_port_in_use")


def test_FADIAG_DISABLE_is_named_as_the_reason_there_are_no_metrics() -> None:
    proc = _demo_run(["--steps", "1", "--seq-len", "32"], FADIAG_DISABLE="1")
    assert proc.returncode == 0, proc.stderr
    assert "metrics: none: fadiag disabled by FADIAG_DISABLE\n" in proc.stdout
    assert "see fadiag's log" not in proc.stdout
