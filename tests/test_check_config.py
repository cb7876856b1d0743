"""Tests for `fadiag check-config`: resolved output, error lines, exit codes, the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fadiag.cli import main
from fadiag.cli.check_config import reference_markdown
from fadiag.config import Config
from fadiag.config.keys import config_keys

REPO = Path(__file__).resolve().parents[1]
BAD = "# fadiag\nexporter:\n  prot: 1\n  port: -1\nrules:\n  hang:\n    timeout_seconds: 0\n"


@pytest.fixture(autouse=True)
def no_fadiag_environment(monkeypatch):
    monkeypatch.delenv("FADIAG_CONFIG", raising=False)
    monkeypatch.delenv("FADIAG_DISABLE", raising=False)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fadiag.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_valid_file_prints_every_key_resolved_and_exits_0(tmp_path, capsys):
    path = write(tmp_path, "exporter:\n  port: 0\n")
    assert main(["check-config", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = Config().to_dict()
    expected["exporter"]["port"] = 0
    assert printed == expected


def test_invalid_file_prints_every_problem_with_its_line_and_exits_1(tmp_path, capsys):
    path = write(tmp_path, BAD)
    assert main(["check-config", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"{path}:3: exporter.prot: unknown key; did you mean exporter.port?",
        f"{path}:4: exporter.port: must be an integer 0..65535, got -1",
        f"{path}:7: rules.hang.timeout_seconds: must be a number > 0, got 0",
    ]


def test_invalid_file_prints_nothing_on_stdout(tmp_path, capsys):
    main(["check-config", str(write(tmp_path, BAD))])
    assert capsys.readouterr().out == ""


def test_syntax_error_is_reported_with_its_line(tmp_path, capsys):
    path = write(tmp_path, "exporter:\n  port: 1\n bad: [\n")
    assert main(["check-config", str(path)]) == 1
    assert capsys.readouterr().err.startswith(f"{path}:3: invalid YAML at column 2: ")


def test_a_missing_file_is_an_argument_error_that_exits_2_naming_it(tmp_path):
    path = tmp_path / "nope.yaml"
    result = run_module(str(path))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"fadiag check-config: error: argument FILE: no such file: {path}")


def test_a_missing_FADIAG_CONFIG_file_is_reported_by_its_path(tmp_path, capsys, monkeypatch):
    path = tmp_path / "nope.yaml"
    monkeypatch.setenv("FADIAG_CONFIG", str(path))
    assert main(["check-config"]) == 1
    assert capsys.readouterr().err == f"{path}: configuration file not found (named by FADIAG_CONFIG)\n"


def test_without_a_file_the_FADIAG_CONFIG_file_is_checked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FADIAG_CONFIG", str(write(tmp_path, "device: gpu\n")))
    assert main(["check-config"]) == 1
    assert ":1: device: must be one of auto|cpu|cuda|npu, got 'gpu'" in capsys.readouterr().err


def test_without_a_file_or_FADIAG_CONFIG_the_defaults_are_printed(capsys):
    assert main(["check-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == Config().to_dict()


def test_FADIAG_DISABLE_shows_in_the_resolved_configuration(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FADIAG_DISABLE", "1")
    assert main(["check-config", str(write(tmp_path, "enabled: true\n"))]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["enabled"] is False


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FADIAG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "fadiag", "check-config", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )


def test_python_m_fadiag_check_config_exits_0_for_a_valid_file(tmp_path):
    result = run_module(str(write(tmp_path, "jsonl:\n  path: /tmp/run\n")))
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["jsonl"]["path"] == "/tmp/run"


def test_python_m_fadiag_check_config_exits_1_with_line_numbers(tmp_path):
    path = write(tmp_path, BAD)
    result = run_module(str(path))
    assert result.returncode == 1
    assert (
        f"{path}:4: exporter.port: must be an integer 0..65535, got -1"
        in result.stderr.splitlines()
    )


def test_committed_reference_matches_the_schema():
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == reference_markdown(), (
        "docs/configuration.md is stale: fadiag check-config --reference > docs/configuration.md"
    )


def test_reference_flag_prints_the_reference(capsys):
    assert main(["check-config", "--reference"]) == 0
    assert capsys.readouterr().out == reference_markdown()


def test_reference_gives_every_key_a_meaning():
    rows = {
        line.split(" | ")[0].strip("| `"): line
        for line in reference_markdown().splitlines()
        if line.startswith("| `")
    }
    undocumented = [
        k.key for k in config_keys() if k.key not in rows or rows[k.key].endswith("|  |")
    ]
    assert undocumented == []
