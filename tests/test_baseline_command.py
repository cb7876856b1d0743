"""`fadiag baseline save|show` on a real run's log."""

from __future__ import annotations

import pytest

import fadiag
from fadiag.cli import main
from fadiag.rules import baseline
from tests.models import GPT, train


def test_baseline_save_from_a_run_log_then_show(tmp_path, capsys):
    s = fadiag.attach(port=0, jsonl=str(tmp_path))
    train(GPT(layers=2), steps=6)
    assert s.flush(10)
    fadiag.detach()
    out = tmp_path / "baseline.json"
    assert main(["baseline", "save", str(tmp_path / "fadiag-rank0.jsonl"), "-o", str(out),
                 "--skip", "2"]) == 0
    b = baseline.load(out)
    assert b.steps == 4 and len(b.entries) == 2 and b.device == "cpu"
    assert main(["baseline", "show", str(out)]) == 0
    assert "ratio" in capsys.readouterr().out


def test_baseline_save_with_too_few_steps_says_so(tmp_path, capsys):
    s = fadiag.attach(port=0, jsonl=str(tmp_path))
    train(GPT(layers=1), steps=2)
    s.flush(10)
    fadiag.detach()
    assert main(["baseline", "save", str(tmp_path / "fadiag-rank0.jsonl"), "-o",
                 str(tmp_path / "b.json")]) == 1
    assert "--skip" in capsys.readouterr().err


def test_session_can_save_its_own_baseline(tmp_path):
    s = fadiag.attach(port=0)
    train(GPT(layers=1), steps=4)
    s.flush(10)
    s.save_baseline(tmp_path / "b.json", skip=1)
    assert baseline.load(tmp_path / "b.json").steps == 3


@pytest.mark.parametrize("argv, message", [
    (["save", "{tmp}/nope.jsonl", "-o", "{tmp}/b.json"], "argument run: no such file: {tmp}/nope.jsonl"),
    (["save", "{tmp}", "-o", "{tmp}/b.json"], "argument run: {tmp} is a directory; expected a file"),
    (["save", "{tmp}/run.jsonl", "-o", "{tmp}/no/b.json"], "argument -o/--output: no such directory: {tmp}/no"),
    (["save", "{tmp}/run.jsonl", "-o", "{tmp}"], "argument -o/--output: {tmp} is a directory; expected a file name"),
    (["show", "{tmp}/nope.json"], "argument file: no such file: {tmp}/nope.json"),
])
def test_bad_baseline_paths_exit_2_naming_the_argument(tmp_path, capsys, argv, message):
    (tmp_path / "run.jsonl").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["baseline", *(a.format(tmp=tmp_path) for a in argv)])
    assert exc.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
