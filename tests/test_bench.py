"""`fadiag bench` on CPU: measurements, outputs, the formula check and argument errors."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fadiag import cli, memory
from fadiag.cli.bench import measure as bench

B, H, D = 1, 4, 32
SMALL = ["--heads", str(H), "--head-dim", str(D)]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "fadiag", "bench", "--device", "cpu", "--seq-lens", "128,256",
         "--iters", "2", "--warmup", "1", *SMALL, "--mha", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    return proc, out


@pytest.fixture(scope="module")
def doc(cli_run) -> dict:
    return json.loads((cli_run[1] / "bench.json").read_text())


def row(doc: dict, backend: str, seq_len: int) -> dict:
    return next(r for r in doc["rows"] if r["backend"] == backend and r["seq_len"] == seq_len)


def test_cpu_bench_exits_0_and_prints_the_tables(cli_run):
    proc, _ = cli_run
    assert proc.returncode == 0, proc.stderr
    for text in ("cpu_flash", "math", "bwd/fwd", "savings", "kept/formula",
                 "nn.MultiheadAttention", "flash/standard"):
        assert text in proc.stdout, text


def test_csv_has_one_row_per_backend_and_length_with_named_columns(cli_run):
    with (cli_run[1] / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["backend"], r["seq_len"]) for r in rows] == [
        ("cpu_flash", "128"), ("math", "128"), ("cpu_flash", "256"), ("math", "256")]
    for column in ("device", "forward_ms", "backward_ms", "ratio", "kept_bytes",
                   "standard_bytes", "memory_savings", "peak_bytes", "forward_tflops",
                   "backward_tflops", "forward_pct_of_matmul_peak", "status", "reason"):
        assert column in rows[0], column
    assert all(r["status"] == "ok" and float(r["forward_ms"]) > 0 for r in rows)
    assert all(r["peak_bytes"] == "" for r in rows)  # no allocator peak on CPU


def test_json_records_the_environment_and_every_row(doc):
    env = doc["environment"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert env["date"] and env["device_name"]
    assert env["command"].startswith("fadiag bench --device cpu --seq-lens 128,256 ")
    assert "--mha" in env["command"]
    assert len(doc["rows"]) == 4 and doc["matmul_tflops"] > 0
    assert doc["config"]["head_dim"] == D


def test_png_is_written(cli_run):
    data = (cli_run[1] / "bench.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cpu_flash_keeps_exactly_output_and_logsumexp(doc):
    r = row(doc, "cpu_flash", 256)
    assert r["kept_bytes"] == memory.flash_bytes(B, H, 256, D, 4)  # no q, k, v
    assert r["memory_savings"] > 0.8
    assert r["grad_fn"] == "ScaledDotProductFlashAttentionForCpuBackward0"


def test_math_keeps_at_least_one_score_matrix(doc):
    for s in (128, 256):
        assert row(doc, "math", s)["kept_bytes"] >= B * H * s * s * 4


def test_formula_check_compares_math_with_the_standard_formula_per_length(doc):
    checks = {c["seq_len"]: c for c in doc["formula_check"]}
    assert set(checks) == {128, 256}
    c = checks[256]
    assert c["math_kept_bytes"] == row(doc, "math", 256)["kept_bytes"]
    assert c["standard_bytes"] == memory.standard_bytes(B, H, 256, 256, D, 4)
    assert c["ratio"] == pytest.approx(c["math_kept_bytes"] / c["standard_bytes"])


def test_mha_rows_time_flash_against_standard(cli_run, doc):
    assert [m["seq_len"] for m in doc["mha"]] == [128, 256]
    for m in doc["mha"]:
        assert m["embed_dim"] == H * D and m["status"] == "ok"
        assert m["flash_over_standard"] == pytest.approx(m["flash_ms"] / m["standard_ms"])
    with (cli_run[1] / "mha.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2


def small_config(**overrides) -> bench.BenchConfig:
    base = dict(device="cpu", seq_lens=(64,), heads=2, head_dim=16, iters=1, warmup=0)
    return bench.BenchConfig(**{**base, **overrides})


def test_memory_guard_skips_math_and_says_why():
    report = bench.run_bench(small_config(memory_fraction=1e-12))
    math_row = next(r for r in report.rows if r.backend == "math")
    assert math_row.status == "skipped" and "free" in math_row.reason
    assert math_row.kept_bytes is None and not report.formula_checks
    assert report.skipped() == [f"math S=64: {math_row.reason}"]
    assert next(r for r in report.rows if r.backend == "cpu_flash").status == "ok"


def test_a_backend_that_refuses_the_shape_is_reported_with_torchs_reason(monkeypatch):
    def refusing(backend, causal, device):
        def fn(q, k, v):
            warnings.warn("Flash attention kernel not used because: head_dim 16 is odd",
                          UserWarning, stacklevel=1)
            raise RuntimeError("No available kernel.  Aborting execution.")
        return fn, torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)

    monkeypatch.setattr(bench, "attention_callable", refusing)
    report = bench.run_bench(small_config(backends=("cpu_flash",)))
    (r,) = report.rows
    assert r.status == "unsupported"
    assert "No available kernel" in r.reason and "head_dim 16 is odd" in r.reason
    assert r.forward_ms is None and r.kept_bytes is None


def test_progress_is_reported_once_per_step():
    cfg = small_config(seq_lens=(32, 64), mha=True)
    seen: list[str] = []
    report = bench.run_bench(cfg, progress=seen.append)
    assert len(seen) == bench.total_steps(cfg) == 1 + 2 * 2 + 2
    assert len(report.mha_rows) == 2


def test_kept_bytes_counts_each_storage_once_and_skips_the_inputs():
    q, k, v = (torch.randn(2, 8, requires_grad=True) for _ in range(3))
    kept, _ = bench.kept_bytes(lambda q, k, v: torch.exp(q) * v + k, q, k, v)
    assert kept == 2 * 8 * 4  # exp's output, saved by exp and by mul; v is an input


@pytest.mark.parametrize("causal, factor", [(False, 1.0), (True, 0.5)])
def test_attention_flops_are_four_bhssd_halved_when_causal(causal, factor):
    assert bench.attention_flops(1, 32, 4096, 4096, 128, causal) == factor * 4 * 32 * 4096**2 * 128


@pytest.mark.parametrize("argv, argument", [
    (["--backends", "fastest"], "--backends"),
    (["--backends", "flash"], "--backends"),  # a CUDA backend on the CPU
    (["--seq-lens", "128,abc"], "--seq-lens"),
    (["--seq-lens", "0"], "--seq-lens"),
    (["--seq-lens", ","], "--seq-lens"),
    (["--iters", "0"], "--iters"),
    (["--warmup", "-1"], "--warmup"),
    (["--dtype", "float8_e4m3fn"], "--dtype"),
    (["--memory-fraction", "2"], "--memory-fraction"),
    (["--out", __file__], "--out"),  # a file: checked before the benchmark runs, not after
])
def test_bad_arguments_exit_2_naming_the_argument(capsys, argv, argument):
    try:
        code = cli.main(["bench", "--device", "cpu", *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert f"argument {argument}" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_cpu_only_machine_is_a_clear_error_not_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "fadiag", "bench", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "argument --device" in proc.stderr and "CUDA" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_npu_without_torch_npu_is_a_clear_error(capsys):
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch_npu is installed")
    assert cli.main(["bench", "--device", "npu"]) == 2
    assert "torch_npu" in capsys.readouterr().err


def test_config_rejects_bad_values_by_dotted_name():
    with pytest.raises(ValueError, match=r"bench\.backends"):
        bench.BenchConfig(device="cpu", backends=("cudnn",))
    with pytest.raises(ValueError, match=r"bench\.iters"):
        bench.BenchConfig(iters=0)


def test_bench_whose_reader_is_gone_writes_its_files_and_exits_141_quietly(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the first table, whatever the timing (as `| head` can be)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fadiag", "bench", "--device", "cpu", "--seq-lens", "64",
             "--backends", "cpu_flash", "--heads", "1", "--head-dim", "16", "--iters", "1",
             "--warmup", "0", "--out", str(out)],
            cwd=root, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(root)})
    finally:
        os.close(write_end)
    assert proc.returncode == 141  # rich's own handler exited with 1
    assert "Traceback" not in proc.stderr and "wrote" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.json", "bench.png"]
