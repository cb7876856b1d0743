"""The code's static checks, configured in pyproject.toml: ruff over the tree, mypy over the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def test_ruff_finds_nothing_in_the_package_its_tests_and_benchmarks():
    done = _run("ruff", "check", "fadiag", "tests", "benchmarks")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_no_type_error_in_the_package():
    done = _run("mypy", "fadiag")
    assert done.returncode == 0, done.stdout + done.stderr
