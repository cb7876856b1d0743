"""fadiag report: summaries, plots and HTML from run logs."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fadiag.cli import main
from fadiag.cli.report.plots import memory_figure, thresholds
from fadiag.cli.report.summary import format_summary, site_table, summarize, summarize_run
from fadiag.export.jsonl import JsonlSink, read_run
from fadiag.steps.records import CallRecord, Flag, StepReport

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


def test_summary_gives_medians_flags_by_rule_and_per_site_medians(tmp_path: Path) -> None:
    s = summarize_run(read_run(write_log(tmp_path)))
    assert s.steps == 6
    assert s.median_forward_seconds == pytest.approx(0.004)
    assert s.flags_by_rule == {"memory_savings": 3, "backward_forward_ratio": 3}
    assert [r.site for r in s.sites] == ["layers.0.attn", "layers.1.attn"]
    slow = s.sites[1]
    assert slow.impl == "cpu_flash+math"
    assert slow.calls == 6 and slow.flags == 6
    assert slow.ratio == pytest.approx((2.0 + 5.0) / 2)  # three steps at 2x, three at 5x
    text = format_summary(s)
    assert "backward_forward_ratio: 3" in text and "layers.1.attn" in text


def _one_site_step(n: int, fwd: float, flags: tuple[Flag, ...] = ()) -> StepReport:
    call = _call("layers.0.attn", "cpu_flash", fwd, 2 * fwd, 50_000)
    return StepReport(step=n, forward_seconds=fwd, backward_seconds=2 * fwd, kept_bytes=50_000,
                      standard_bytes=1_000_000, peak_bytes=None, calls=[call], flags=list(flags))


def test_site_table_gives_medians_so_a_slow_first_step_does_not_inflate_it() -> None:
    steps = [_one_site_step(1, 0.100)] + [_one_site_step(n, 0.002) for n in range(2, 6)]
    s = summarize(steps)
    (row,) = s.sites
    assert row.forward_seconds == pytest.approx(0.002) == s.median_forward_seconds
    header, cells = _table_rows(s)
    assert cells[header.index("fwd ms")] == "2.00"  # the mean would read 21.60


def _checkpointed_step(n: int) -> StepReport:
    """Two sites on a starved device under checkpointing: site 0's first-pass window held the
    host's launches (its recomputation's did not), every window of site 1 did."""
    kw = dict(impl="cudnn", shape=(2, 16, 2048, 2048, 128), dtype="bfloat16", causal=True,
              device="cuda", kept_bytes=50_000, standard_bytes=1_000_000)
    calls = [CallRecord(site="layers.0.attn", forward_seconds=4e-4, forward_host_seconds=3e-4, **kw),
             CallRecord(site="layers.0.attn", forward_seconds=1e-4, backward_seconds=3.3e-4,
                        recompute=True, **kw),
             CallRecord(site="layers.1.attn", forward_seconds=4e-4, forward_host_seconds=3e-4, **kw),
             CallRecord(site="layers.1.attn", forward_seconds=3e-4, backward_seconds=4e-4,
                        recompute=True, forward_host_seconds=2e-4, **kw)]
    return StepReport(step=n, forward_seconds=8e-4, backward_seconds=7.3e-4, kept_bytes=100_000,
                      standard_bytes=2_000_000, peak_bytes=None, recompute_seconds=4e-4,
                      calls=calls, wall_time=1000.0 + n)


def test_a_sites_ratio_is_its_device_bound_windows_and_the_report_names_the_host_bound(
        tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path, rank=0, meta={"rank": 0, "fadiag": "test"})
    for n in range(1, 4):
        sink.emit(_checkpointed_step(n))
    sink.close()
    s = summarize_run(read_run(sink.path))  # through the run log: the host times are kept
    ckpt, starved = s.sites
    assert ckpt.ratio == pytest.approx(3.3)  # the recomputation's windows; all windows: 0.83
    assert starved.ratio is None and starved.host_bound == 6
    assert s.median_ratio == pytest.approx(3.3)
    assert (s.host_bound_calls, s.measured_calls) == (9, 12)
    header, *rows = site_table(s)
    column = header.index("ratio")
    assert [r[column] for r in rows] == ["3.30", "host-bound"]
    assert "host-bound       9 of 12 calls" in format_summary(s)


def _table_rows(s: object) -> tuple[list[str], list[str]]:
    from fadiag.cli.report.summary import site_table

    rows = site_table(s)  # type: ignore[arg-type]
    return rows[0], rows[1]


def _math_step(n: int, sites: int = 4) -> StepReport:
    calls = [_call(f"layers.{i}.attn", "math", 0.002, 0.004, 700_000) for i in range(sites)]
    return StepReport(step=n, forward_seconds=0.002 * sites, backward_seconds=0.004 * sites,
                      kept_bytes=700_000 * sites, standard_bytes=1_000_000 * sites,
                      peak_bytes=None, step_peak_bytes=400 * 2**20, calls=calls, rank=0)


MATH_CAUSE = ("memory savings 30.0% < 80% (4/4 sites; worst layers.0.attn) — SDPA fell back to "
              "the math path, which keeps [B,H,Sq,Sk] matrices: fused backends are disabled")


def _math_log(directory: Path, steps: int = 6) -> Path:
    """A run whose memory flag, judged on step totals, fires once for all four sites."""
    sink = JsonlSink(directory, rank=0, meta={"rank": 0, "device": "cpu"})
    for n in range(1, steps + 1):
        report = _math_step(n)
        if n == 1:
            report.flags = [Flag(rule="memory_savings", value=0.3, threshold=0.8, step=1,
                                 site="*", message=MATH_CAUSE, impl="math")]
        sink.emit(report)
        for f in report.flags:
            sink.flag(f)
    sink.close()
    return sink.path


def test_site_table_counts_a_step_total_flag_for_every_site_past_the_threshold(
        tmp_path: Path) -> None:
    s = summarize_run(read_run(_math_log(tmp_path)))
    assert [r.flags for r in s.sites] == [1, 1, 1, 1]


def test_report_prints_each_flag_episode_with_rule_steps_sites_value_and_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _math_log(tmp_path)
    sink = JsonlSink(tmp_path, rank=0, meta={})
    sink.flag(Flag(rule="memory_savings", value=0.3, threshold=0.8, step=9, site="*",
                   message="cleared: memory_savings at *", cleared=True))
    sink.close()
    assert main(["report", str(log), "--html"]) == 0
    out = capsys.readouterr().out
    episode = out[out.index("flag episodes:"):]
    assert re.search(r"memory_savings( \[\w+\])?  steps 1\.\.9 \(cleared\)", episode)
    assert "4/4 sites (layers.0.attn, layers.1.attn, layers.2.attn, ...)" in episode
    assert "value 0.3, threshold 0.8" in episode
    assert "fused backends are disabled" in " ".join(episode.split())
    page = (tmp_path / "fadiag-report" / "report.html").read_text()
    assert "fused backends are disabled" in page and "steps 1..9 (cleared)" in page
    assert page.index("Flag episodes") < page.index("data:image/png")


def test_an_episode_shows_the_flags_severity_where_the_rules_give_one() -> None:
    from fadiag.cli.report.summary import Episode, episode_lines

    flag = Flag(rule="backward_forward_ratio", value=3.4, threshold=3.0, step=2, site="a.py:1#0",
                message="backward/forward 3.40x > 3x")
    object.__setattr__(flag, "severity", "info")  # the field the rules add for bands
    heading, _ = episode_lines(Episode(flag=flag, sites=["a.py:1#0"], total_sites=1))
    assert heading.startswith("backward_forward_ratio [info]  from step 2")


def test_memory_plot_keeps_attention_bytes_off_the_floor_under_a_large_process_rss(
        tmp_path: Path) -> None:
    fig = memory_figure(read_run(_math_log(tmp_path)))
    attention, step = fig.axes
    standard_mib = 4 * 1_000_000 / 2**20
    assert attention.get_ylim()[1] < 2 * standard_mib  # RSS (400 MiB) is not on this axis
    assert step.get_ylim()[1] >= 400
    assert "process RSS" in step.get_title()


def test_memory_plot_names_the_step_figure_the_allocator_peak_on_a_gpu(tmp_path: Path) -> None:
    run = read_run(_math_log(tmp_path))
    for s in run.steps:
        for c in s.calls:
            c.device = "cuda:0"
    assert "allocator peak" in memory_figure(run).axes[1].get_title()


def _gzipped(log: Path) -> Path:
    packed = log.with_name(log.name + ".gz")
    packed.write_bytes(gzip.compress(log.read_bytes()))
    log.unlink()
    return packed


def _fadiag(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FADIAG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "fadiag", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_report_reads_a_gzipped_run_log(tmp_path: Path) -> None:
    log = _gzipped(write_log(tmp_path))
    proc = _fadiag("report", str(log))
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: 6 steps (1..6)" in proc.stdout
    assert (tmp_path / "fadiag-report" / "times.png").exists()


def test_report_of_a_directory_reads_its_gzipped_logs(tmp_path: Path) -> None:
    write_log(tmp_path, rank=0)
    _gzipped(write_log(tmp_path, rank=1))
    proc = _fadiag("report", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: 6 steps" in proc.stdout and "rank 1: 6 steps" in proc.stdout


def test_baseline_save_reads_a_gzipped_run_log(tmp_path: Path) -> None:
    log = _gzipped(write_log(tmp_path))
    proc = _fadiag("baseline", "save", str(log), "-o", str(tmp_path / "b.json"), "--skip", "1")
    assert proc.returncode == 0, proc.stderr
    assert "2 sites from 5 steps" in proc.stdout


@pytest.mark.parametrize("argv", [["report", "{f}"], ["baseline", "save", "{f}", "-o", "{o}"]])
@pytest.mark.parametrize("content, says", [
    (b"\x00\x8b\xff\xfe binary", "is not a fadiag run log: it is not UTF-8 text"),
    (b"\x1f\x8b\x08\x00 cut short", "is not a readable gzip file"),
])
def test_a_file_that_is_neither_jsonl_nor_gzip_is_named_without_a_traceback(
        tmp_path: Path, argv: list[str], content: bytes, says: str) -> None:
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(content)
    proc = _fadiag(*(a.format(f=bad, o=tmp_path / "b.json") for a in argv))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"{bad} {says}" in proc.stderr
    assert "expected JSON lines (fadiag-rank<R>.jsonl) or gzip-compressed" in proc.stderr


def test_report_piped_into_head_writes_its_files_and_exits_quietly(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    write_log(runs, rank=0)
    write_log(runs, rank=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FADIAG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" -m fadiag report runs --html | head -1; '
                       'echo "status ${PIPESTATUS[0]}" >&2'],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout == "runs/fadiag-rank0.jsonl:\n"
    assert proc.stderr in ("status 0\n", "status 141\n")  # no message besides the status
    report = runs / "fadiag-report"
    assert (report / "report.html").read_text().count("data:image/png;base64,") == 10
    assert len(list(report.glob("rank*-*.png"))) == 10


def test_report_whose_reader_is_gone_still_writes_its_files(tmp_path: Path) -> None:
    log = write_log(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the first line, whatever the timing
    try:
        proc = subprocess.run([sys.executable, "-m", "fadiag", "report", str(log), "--html"],
                              cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, "")
    assert (tmp_path / "fadiag-report" / "report.html").read_text().count("base64,") == 5


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_report_onto_a_full_stdout_says_so_after_writing_its_files(tmp_path: Path) -> None:
    log = write_log(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FADIAG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "fadiag", "report", str(log), "--html"],
                              cwd=ROOT, env=env, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == ("fadiag report: cannot write to standard output: "
                           "No space left on device\n")
    assert (tmp_path / "fadiag-report" / "report.html").exists()


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
    # the memory flag's episode carries its cause, in torch's words
    episodes = " ".join(report.stdout[report.stdout.index("flag episodes:"):].split())
    assert re.search(r"memory_savings( \[\w+\])? from step 1 ", episodes)
    assert "SDPA fell back to the math path" in episodes
    assert "fused backends are disabled" in episodes
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
