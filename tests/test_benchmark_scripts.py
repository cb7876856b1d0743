"""The benchmark scripts that run on CPU still run against the package as it is.

They reach into fadiag's internals (the tap, the resolver, the recorder's hooks) to time their
pieces, so an internal API that moves breaks them without any other test noticing; their figures
in benchmarks/BENCHMARKS.md are only reproducible while they run. Each is run here once, as its
docstring shows, shrunk to a few steps: it must exit 0 and print what it exists to print. Timing
figures are not checked (targets are met on a card, in BENCHMARKS.md, never in a timed test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fadiag.capture import native

ROOT = Path(__file__).resolve().parents[1]

SCRIPTS = {
    "tap_cost": (["--device", "cpu", "--calls", "100", "--repeats", "1"], "minus_plain_us"),
    "hot_path": (["--device", "cpu", "--calls", "100", "--repeats", "1"], "Recorder.begin, whole"),
    "where_time_goes": (["--device", "cpu", "--calls", "100", "--repeats", "1"],
                        "with native marks"),
    "in_situ": (["--device", "cpu", "--blocks", "1", "--steps", "5"], "_try_resolve"),
    "threads": (["--device", "cpu", "--pairs", "1", "--steps", "5"], "fadiag: resolves"),
    "threads --variants": (["--device", "cpu", "--pairs", "1", "--steps", "5", "--variants",
                            "fadiag_held,fadiag_no_resolver"], "fadiag_held: resolves"),
    "resolver_cost": (["--device", "cpu", "--steps", "60"], "optimizer's hook"),
    "resolver_cost --replay": (["--device", "cpu", "--steps", "60", "--replay"], "the report"),
    "resolver_cost --inline": (["--device", "cpu", "--steps", "60", "--inline",
                                "--reports-per-second", "10", "--no-cpu-wait"], "the report"),
    "hook_cost": (["--steps", "60"], "QuietSteps.step, from Python"),
    "pool_rounds": (["benchmarks/results/overhead-launch-run130.json",
                     "benchmarks/results/overhead-launch-run131.json"], "2 runs, 144 rounds"),
}
"""Per case: the script's arguments, and a string its output holds when it measured something."""


@pytest.mark.skipif(not all(native.toolchain().values()),
                    reason="no C++ toolchain: the scripts time the native extension")
@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_benchmark_script_runs_on_cpu(case: str) -> None:
    args, expected = SCRIPTS[case]
    script = ROOT / "benchmarks" / f"{case.split()[0]}.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert expected in out, out[-3000:]
    if case == "tap_cost":  # its result is one JSON object: every mechanism measured
        result = json.loads(done.stdout[done.stdout.index("{"):])
        assert set(result["minus_plain_us"]) >= {"floor", "tap", "session"}
