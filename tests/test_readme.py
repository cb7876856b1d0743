"""The README's commands and its Python example run as shown.

Every shell command the README shows (the lines of its ```bash blocks, and inline code that
starts with a program name) is one case below: run exactly as written, or skipped with the
reason. A command the README gains that this file does not know fails until it is classified.
The Python example that prints `last_step()` runs with a short training loop in place of
"... train as usual ..."; the `fadiag.instrument` example is a fragment over the user's own op
(tests/test_session.py instruments real ones) and is not run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PROGRAMS = r"(fadiag|python3?|bash|pip|torchrun|promtool)"

RUN = {"fadiag demo", "fadiag demo --force-math"}
"""Run as written, and stopped with Ctrl-C (SIGINT) after ten steps as the README allows: the
200 steps they train take from 30 s on an idle 2-core machine to minutes on a busy one."""
PLACEHOLDERS = {"fadiag check-config FILE": ("FILE", "exporter:\n  port: 0\n")}
"""Run with the placeholder replaced by a real file of this content."""
NEEDS_A_RUN_LOG = {"fadiag calibrate --from runs/fadiag-rank0.jsonl -o calibrated.yaml"}
"""Run as written, where the run log it reads (what `attach(jsonl="runs/")` writes) exists."""
NAMES = {"fadiag report", "fadiag demo", "fadiag estimate", "fadiag baseline save",
         "fadiag bench", "fadiag run", "fadiag calibrate", "fadiag doctor"}
"""A command named in prose, without its arguments: `--help` shows it exists."""
SKIP = {
    "pip install torch==2.13.0 -e .": "installs into the environment (.ci/run does, before the tests)",
    "bash .ci/run": "installs Debian packages as root, then runs this very suite",
    "python3 -m pytest -q": "this suite itself",
    "python -m pytest -m gpu": "needs a CUDA GPU (run on the GPU machine)",
    "fadiag run -- torchrun --nproc-per-node 8 train.py":
        "eight ranks of a train.py of your own; tests/test_launch.py runs fadiag run over torchrun",
    "promtool check metrics":
        "reads a scrape on stdin; tests/test_exporter.py pipes a real scrape into it",
    "fadiag doctor --build-native":
        "compiles the C++ marks (about 25 s per device kind, minutes on a busy machine, and it "
        "waits for any other build of them); tests/test_doctor.py runs --build-native",
}


def shell_commands(text: str) -> list[str]:
    """The README's shell commands, in order, each once."""
    found: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            found += [part.strip() for part in line.split("&&") if part.strip()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    # a bare program name (`fadiag`, `promtool`) is prose about it, not a command
    found += [span for span in re.findall(r"`([^`\n]+)`", prose)
              if re.match(PROGRAMS + r" ", span)]
    return list(dict.fromkeys(found))


def _case(command: str) -> object:
    return pytest.param(command, id=command, marks=[pytest.mark.slow] if command in RUN else [])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FADIAG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_every_readme_command_is_run_or_skipped_with_a_reason() -> None:
    known = RUN | set(PLACEHOLDERS) | NEEDS_A_RUN_LOG | NAMES | set(SKIP)
    assert [c for c in shell_commands(README) if c not in known] == []


@pytest.mark.parametrize("command", [_case(c) for c in shell_commands(README)])
def test_readme_command_runs_as_shown(command: str, tmp_path: Path) -> None:
    if command in SKIP:
        pytest.skip(SKIP[command])
    if shutil.which(command.split()[0]) is None:
        pytest.fail(f"{command.split()[0]} is not on PATH (install the package: pip install -e .)")
    if command in PLACEHOLDERS:
        name, content = PLACEHOLDERS[command]
        (tmp_path / "fadiag.yaml").write_text(content)
        command = command.replace(name, "fadiag.yaml")
    elif command in NEEDS_A_RUN_LOG:
        _write_run_log(tmp_path / "runs")
    elif command in NAMES:
        command += " --help"
    elif command in RUN:
        _run_demo_for_ten_steps(command, tmp_path)
        return
    else:
        pytest.fail(f"unclassified README command: {command}")
    proc = subprocess.run(command, shell=True, cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr


def _write_run_log(directory: Path, steps: int = 30) -> None:
    from fadiag.export.jsonl import JsonlSink
    from fadiag.steps.records import CallRecord, StepReport

    sink = JsonlSink(directory, rank=0, meta={"rank": 0, "device": "cpu"})
    for n in range(1, steps + 1):
        call = CallRecord(site="model.py:41#0", impl="cpu_flash", shape=(4, 4, 256, 256, 32),
                          dtype="float32", causal=True, forward_seconds=0.002,
                          backward_seconds=0.005 + 0.0001 * (n % 3), kept_bytes=500_000,
                          standard_bytes=8_900_000)
        sink.emit(StepReport(step=n, forward_seconds=call.forward_seconds,
                             backward_seconds=call.backward_seconds, kept_bytes=call.kept_bytes,
                             standard_bytes=call.standard_bytes, peak_bytes=None, calls=[call]))
    sink.close()


def _run_demo_for_ten_steps(command: str, cwd: Path) -> None:
    proc = subprocess.Popen(shlex.split(command), cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step    10 "):
                proc.send_signal(signal.SIGINT)  # the first Ctrl-C: finish the step, summarize
                break
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, f"{command}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in err
    assert "interrupted after" in out and "rank 0:" in out
    if command.endswith("--force-math"):
        assert re.search(r"memory_savings( \[\w+\])? +from step 1", out)


def python_examples(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


TRAINING = """\
import torch
import torch.nn.functional as F
q = torch.randn(2, 2, 64, 16, requires_grad=True)
opt = torch.optim.SGD([q], lr=0.01)
for _ in range(3):
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_the_readme_example_reads_last_step_only_after_flush() -> None:
    (example,) = [e for e in python_examples(README) if "last_step()" in e]
    lines = [line.split("#", 1)[0].strip() for line in example.splitlines()]
    assert "session.flush()" in lines
    assert lines.index("session.flush()") < lines.index("print(session.last_step())")


def test_the_readme_example_prints_the_last_step_trained(tmp_path: Path) -> None:
    (example,) = [e for e in python_examples(README) if "last_step()" in e]
    script = example.replace("... train as usual ...\n", TRAINING)
    # the last line of the example's output is the StepReport of the third and last step
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("StepReport(step=3,")

