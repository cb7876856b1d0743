"""fadiag report: summaries, plots and HTML from run logs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fadiag.cli import main
from fadiag.jsonl import JsonlSink, read_run
from fadiag.records import CallRecord, Flag, StepReport
from fadiag.commands.report.summary import format_summary, summarize, summarize_run, thresholds

ROOT = Path(__file__).resolve().parents[1]
PNGS = ("times", "ratio", "savings", "memory", "flags")


def _call(site: str, impl: str, fwd: float, bwd: float, kept: int) -> CallRecord:
    return CallRecord(site=site, impl=impl, shape=(2, 4, 128, 128, 32), dtype="float32",
                      causal=True, forward_seconds=fwd, backward_seconds=bwd, kept_bytes=kept,
                      standard_bytes=1_000_000)


def _step(n: int, rank: int = 0, slow: bool = False) -> StepReport:
    calls = [_call("layers.0.attn", "cpu_flash", 0.002, 0.004, 50_000),
             _call("layers.1.attn", "math" if slow else "cpu_flash", 0.002,
                   0.010 if slow else 0.004, 600_000 if slow else 50_000)]
    flags = []
    if slow:
        flags = [Flag(rule="memory_savings", value=0.4, threshold=0.8, step=n,
                      site="layers.1.attn", message="savings 0.40 < 0.80", impl="math", rank=rank),
                 Flag(rule="backward_forward_ratio", value=5.0, threshold=3.0, step=n,
                      site="layers.1.attn", message="ratio 5.0 > 3.0", impl="math", rank=rank)]
    return StepReport(step=n, forward_seconds=sum(c.forward_seconds for c in calls),
                      backward_seconds=sum(c.backward_seconds for c in calls),
                      kept_bytes=sum(c.kept_bytes or 0 for c in calls),
                      standard_bytes=sum(c.standard_bytes for c in calls), peak_bytes=2_000_000,
                      step_peak_bytes=9_000_000, calls=calls, flags=flags, rank=rank,
                      wall_time=1000.0 + n)


def write_log(directory: Path, rank: int = 0, steps: int = 6) -> Path:
    sink = JsonlSink(directory, rank=rank, meta={"rank": rank, "fadiag": "test"})
    for n in range(1, steps + 1):
        report = _step(n, rank, slow=n > steps // 2)
        sink.emit(report)
        for f in report.flags:
            sink.flag(f)
    sink.close()
    return sink.path


def test_summary_gives_medians_flags_by_rule_and_per_site_totals(tmp_path: Path) -> None:
    s = summarize_run(read_run(write_log(tmp_path)))
    assert s.steps == 6
    assert s.median_forward_seconds == pytest.approx(0.004)
    assert s.flags_by_rule == {"memory_savings": 3, "backward_forward_ratio": 3}
    assert [r.site for r in s.sites] == ["layers.0.attn", "layers.1.attn"]
    slow = s.sites[1]
    assert slow.impl == "cpu_flash+math"
    assert slow.calls == 6 and slow.flags == 6
    assert slow.ratio == pytest.approx((3 * 0.004 + 3 * 0.010) / (6 * 0.002))
    text = format_summary(s)
    assert "backward_forward_ratio: 3" in text and "layers.1.attn" in text


def test_summary_of_steps_alone_counts_the_flags_they_carry() -> None:
    s = summarize([_step(1), _step(2, slow=True)])
    assert s.flags_by_rule["memory_savings"] == 1
    assert format_summary(summarize([])) == "rank 0: no resolved steps"


def test_threshold_lines_follow_the_thresholds_the_run_flagged_with(tmp_path: Path) -> None:
    run = read_run(write_log(tmp_path))
    assert thresholds(run) == {"backward_forward_ratio": 3.0, "memory_savings": 0.8}
    for f in run.flags:
        f.threshold = 2.5 if f.rule == "backward_forward_ratio" else 0.9
    assert thresholds(run) == {"backward_forward_ratio": 2.5, "memory_savings": 0.9}
    assert thresholds(read_run(write_log(tmp_path / "calm", steps=1))) == {
        "backward_forward_ratio": 3.0, "memory_savings": 0.8}


def test_report_writes_the_five_plots_next_to_the_log(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path)
    assert main(["report", str(log)]) == 0
    out = tmp_path / "fadiag-report"
    for name in PNGS:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "median ratio" in printed and "layers.0.attn" in printed


def test_report_on_a_directory_covers_every_rank_and_writes_html(tmp_path: Path) -> None:
    runs = tmp_path / "run"
    write_log(runs, rank=0)
    write_log(runs, rank=1)
    out = tmp_path / "out"
    assert main(["report", str(runs), "--out", str(out), "--html"]) == 0
    for rank in (0, 1):
        for name in PNGS:
            assert (out / f"rank{rank}-{name}.png").exists()
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 10
    assert "<h2>rank 1</h2>" in page and "<td>layers.1.attn</td>" in page


def test_report_of_a_log_without_steps_exits_1(tmp_path: Path) -> None:
    JsonlSink(tmp_path, rank=0, meta={}).close()
    assert main(["report", str(tmp_path / "fadiag-rank0.jsonl")]) == 1


@pytest.mark.parametrize("argv, named", [
    (["report", "/nonexistent/run.jsonl"], "RUN"),
    (["report"], "RUN"),
    (["report", "README.md", "--out", "README.md"], "--out"),
])
def test_bad_report_arguments_exit_2_naming_the_argument(argv: list[str], named: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "fadiag", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert named in proc.stderr


def test_report_plots_a_real_demo_run(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FADIAG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)

    def fadiag(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fadiag", *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    runs = tmp_path / "runs"
    demo = fadiag("demo", "--steps", "6", "--port", "0", "--seq-len", "128", "--force-math",
                  "--jsonl", str(runs))
    assert demo.returncode == 0, demo.stderr
    out = tmp_path / "report"
    report = fadiag("report", str(runs / "fadiag-rank0.jsonl"), "--out", str(out), "--html")
    assert report.returncode == 0, report.stderr
    assert "6 steps" in report.stdout and "memory_savings: 1" in report.stdout
    for name in PNGS:
        assert (out / f"{name}.png").stat().st_size > 1000
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 5


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path: Path) -> None:
    # `fadiag report RUN | head`: the reader closes the pipe; no traceback, the status of a
    # writer killed by SIGPIPE (128 + 13).
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the first write, whatever the timing
    try:
        proc = subprocess.run([sys.executable, "-m", "fadiag", "check-config", "--reference"],
                              cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_verbose_may_follow_the_subcommand(tmp_path: Path) -> None:
    log = tmp_path / "fadiag-rank0.jsonl"
    JsonlSink(tmp_path, rank=0, meta={}).close()
    assert main(["report", str(log), "-v"]) == main(["-v", "report", str(log)]) == 1


def test_verbose_may_follow_a_nested_verb(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["baseline", "show", str(tmp_path / "nope.json"), "-v"])
    assert exc.value.code == 2
    assert "no such file" in capsys.readouterr().err  # -v was taken; the path is what is wrong
