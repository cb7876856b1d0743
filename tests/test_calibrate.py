"""`fadiag calibrate`: per-impl thresholds measured at the job's shapes, written as a config file."""

from __future__ import annotations

import pytest
import yaml

import fadiag
from fadiag.cli import main
from fadiag.cli.calibrate import measure
from tests.models import GPT, train


def test_thresholds_are_the_largest_judged_ratio_of_each_impl_plus_the_margin():
    shape = measure.Shape(batch=1, heads=2, seq_q=256, seq_k=256, head_dim=32, kv_heads=2,
                          dtype="float16", causal=True)
    results = [measure.Measured(impl="flash", shape=shape, ratios=[3.0, 3.4, 3.2]),
               measure.Measured(impl="flash", shape=shape, ratios=[2.9, 3.1]),
               measure.Measured(impl="cpu_flash", shape=shape, ratios=[1.0, 9.0, 2.0],
                                host_clock=True),
               measure.Measured(impl="flash_attn", shape=shape, reason="not an SDPA backend")]
    # A device clock is judged step by step (the largest step); the host clock from ratios
    # alone on their median.
    assert measure.thresholds(results, 0.1) == {"flash": 3.74, "cpu_flash": 2.2}


def test_the_host_clock_is_judged_as_the_rule_judges_it_fastest_backward_over_fastest_forward():
    shape = measure.Shape(batch=1, heads=2, seq_q=256, seq_k=256, head_dim=32, kv_heads=2,
                          dtype="float32", causal=True)
    # Twelve steps of a healthy 2x kernel, three of them preempted (a forward or a backward
    # read long): the rule divides the fastest backward by the fastest forward of each 9 steps.
    seconds = [(1e-3, 2e-3)] * 12
    seconds[2] = (1e-3, 9e-3)      # a preempted backward: not the window's fastest
    seconds[5] = (6e-3, 2e-3)      # a preempted forward
    seconds[10] = (1.1e-3, 2.1e-3)
    m = measure.Measured(impl="cpu_flash", shape=shape, host_clock=True,
                         ratios=[b / f for f, b in seconds], seconds=seconds)
    assert m.judged == pytest.approx(2.0)
    # A run shorter than the window: the same figure over all its steps.
    short = measure.Measured(impl="cpu_flash", shape=shape, host_clock=True, ratios=[9.0, 2.0],
                             seconds=[(1e-3, 9e-3), (2e-3, 2.5e-3)])
    assert short.judged == pytest.approx(2.5)


def test_calibration_reads_no_ratio_from_windows_that_may_hold_host_time(monkeypatch):
    # As the rule judges: a starved device's windows measure the host's launches. Here every
    # window reads as host-bound (on CPU none does), so nothing is measured, and it says why.
    from fadiag.steps.records import CallRecord

    shape = measure.Shape(batch=1, heads=2, seq_q=128, seq_k=128, head_dim=32, kv_heads=2,
                          dtype="float32", causal=True)
    healthy = measure.measure("cpu_flash", shape, "cpu", steps=4, warmup=1)
    assert len(healthy.ratios) == 4 and healthy.reason == ""
    monkeypatch.setattr(CallRecord, "host_bound", property(lambda self: True))
    starved = measure.measure("cpu_flash", shape, "cpu", steps=4, warmup=1)
    assert starved.ratios == [] and starved.judged is None
    assert "every measured window (4) may hold host time" in starved.reason
    assert measure.thresholds([starved], 0.1) == {}


def test_calibrate_writes_per_impl_thresholds_that_attach_loads(tmp_path, capsys):
    out = tmp_path / "calibrated.yaml"
    assert main(["calibrate", "--shape", "1x2x256x32", "--causal", "--steps", "6",
                 "-o", str(out)]) == 0
    data = yaml.safe_load(out.read_text())
    [(impl, limit)] = data["rules"]["backward_forward_ratio"]["per_impl"].items()
    assert impl == "cpu_flash" and limit > 0
    assert "cpu_flash  B=1 H=2 Sq=256 Sk=256 D=32 float32 causal: median" in out.read_text()
    assert ", judged " in out.read_text()
    s = fadiag.attach(str(out), port=0)
    assert s.config.rules.backward_forward_ratio.threshold_for("cpu_flash") == limit
    assert f"wrote {out}: cpu_flash {limit:g}" in capsys.readouterr().out


def test_calibrate_measures_the_shapes_of_a_run_log(tmp_path, capsys):
    s = fadiag.attach(port=0, jsonl=str(tmp_path))
    train(GPT(layers=1, dim=32, heads=2), steps=4, seq=64)
    assert s.flush(10)
    fadiag.detach()
    out = tmp_path / "calibrated.yaml"
    assert main(["calibrate", "--from", str(tmp_path / "fadiag-rank0.jsonl"), "--steps", "4",
                 "-o", str(out)]) == 0
    assert "cpu_flash  B=2 H=2 Sq=64 Sk=64 D=16 float32 causal: median" in capsys.readouterr().out
    assert "cpu_flash" in yaml.safe_load(out.read_text())["rules"]["backward_forward_ratio"]["per_impl"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--shape", "16x32x1024"], "argument --shape: expected BxHxSxD or BxHxSqxSkxD"),
    (["--shape", "1x2x64x16", "--margin", "2"], "argument --margin: expected a number in [0, 1] like 0.1"),
    (["--shape", "1x2x64x16", "--backends", "flashy"], "argument --backends: unknown impl flashy"),
    ([], "argument --from/--shape: give a run log (--from) or at least one --shape"),
])
def test_bad_calibrate_arguments_exit_2_naming_the_argument(tmp_path, capsys, argv, message):
    try:
        code = main(["calibrate", *argv, "-o", str(tmp_path / "c.yaml")])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "c.yaml").exists()
