"""`fadiag estimate`: the standard-vs-flash kept-bytes arithmetic and its command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fadiag import cli, memory
from fadiag.cli.estimate.arithmetic import ModelShape, estimate, human_bytes

GiB, MiB = 2**30, 2**20
SEED = ["--seq-len", "4096", "--heads", "32", "--head-dim", "128", "--layers", "32"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert cli.main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def assert_seed_numbers(d: dict) -> None:
    assert d["s_matrix_bytes_per_layer"] == 1 * GiB
    assert d["s_plus_p_bytes_per_layer"] == 2 * GiB
    assert d["output_bytes_per_layer"] == 32 * MiB
    assert d["standard_bytes_per_layer"] == 2 * GiB + 32 * MiB
    assert d["standard_bytes_total"] == 32 * (2 * GiB + 32 * MiB)
    assert d["flash_bytes_per_layer"] == 32 * MiB + 32 * 4096 * 4  # O + fp32 logsumexp
    assert d["flash_bytes_total"] == 32 * d["flash_bytes_per_layer"]
    assert d["memory_savings"] == pytest.approx(1 - (32.5 * MiB) / (2 * GiB + 32 * MiB))
    assert (d["seq_len"], d["heads"], d["kv_heads"], d["head_dim"], d["layers"], d["batch"],
            d["dtype"], d["dropout"]) == (4096, 32, 32, 128, 32, 1, "float16", 0.0)


def test_seed_case_gives_one_gib_s_matrix_per_layer_through_python_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fadiag", "estimate", *SEED, "--json"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_seed_numbers(json.loads(proc.stdout))


def test_seed_case_gives_one_gib_s_matrix_per_layer_through_cli_main(capsys):
    assert_seed_numbers(run_json(capsys, *SEED, "--dtype", "float16", "--batch", "1"))


def test_estimate_numbers_come_from_the_memory_module():
    r = estimate(ModelShape(seq_len=1000, heads=12, head_dim=64, layers=3, batch=2,
                            dtype="bfloat16", dropout=0.1))
    assert r.standard_bytes_per_layer == memory.standard_bytes(2, 12, 1000, 1000, 64, 2, 0.1)
    assert r.flash_bytes_per_layer == memory.flash_bytes(2, 12, 1000, 64, 2, 0.1)
    assert r.standard_bytes_total == 3 * r.standard_bytes_per_layer


def test_gqa_shrinks_k_and_v_inputs_but_not_the_kept_bytes(capsys):
    mha = run_json(capsys, *SEED)
    gqa = run_json(capsys, *SEED, "--kv-heads", "8")
    assert gqa["kv_heads"] == 8
    assert gqa["q_bytes_per_layer"] == mha["q_bytes_per_layer"] == 32 * MiB
    assert gqa["k_bytes_per_layer"] == gqa["v_bytes_per_layer"] == 8 * MiB
    for key in ("s_matrix_bytes_per_layer", "standard_bytes_per_layer", "flash_bytes_per_layer",
                "standard_bytes_total", "flash_bytes_total", "memory_savings"):
        assert gqa[key] == mha[key], key
    assert any("GQA" in n for n in gqa["notes"])


def test_dropout_adds_a_one_byte_mask_per_score_to_standard_only(capsys):
    plain = run_json(capsys, *SEED)
    dropped = run_json(capsys, *SEED, "--dropout", "0.1")
    mask = 32 * 4096 * 4096
    assert dropped["dropout_mask_bytes_per_layer"] == mask
    assert dropped["standard_bytes_per_layer"] == plain["standard_bytes_per_layer"] + mask
    assert dropped["flash_bytes_per_layer"] == plain["flash_bytes_per_layer"] + 16  # RNG state
    assert dropped["memory_savings"] > plain["memory_savings"]


def test_float32_doubles_every_kept_byte_but_not_the_logsumexp(capsys):
    half = run_json(capsys, *SEED)
    full = run_json(capsys, *SEED, "--dtype", "float32")
    assert full["standard_bytes_per_layer"] == 2 * half["standard_bytes_per_layer"]
    assert full["logsumexp_bytes_per_layer"] == half["logsumexp_bytes_per_layer"]


def test_human_output_is_a_table_in_binary_units(capsys):
    assert cli.main(["estimate", *SEED]) == 0
    out = capsys.readouterr().out
    for text in ("S = QKᵀ/√d", "1.00 GiB", "2.00 GiB", "32.00 MiB", "65.00 GiB", "98.44%"):
        assert text in out, text


@pytest.mark.parametrize("value, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (32 * MiB, "32.00 MiB"),
    (GiB, "1.00 GiB"), (65 * GiB, "65.00 GiB"), (3 * 2**40, "3.00 TiB"),
])
def test_human_bytes_uses_binary_units(value, text):
    assert human_bytes(value) == text


@pytest.mark.parametrize("argv, argument", [
    (["--seq-len", "0"], "--seq-len"),
    (["--seq-len", "many"], "--seq-len"),
    (["--heads", "-1"], "--heads"),
    (["--head-dim", "1.5"], "--head-dim"),
    (["--layers", "0"], "--layers"),
    (["--batch", "0"], "--batch"),
    (["--kv-heads", "0"], "--kv-heads"),
    (["--kv-heads", "5"], "--kv-heads"),
    (["--dtype", "float64"], "--dtype"),
    (["--dropout", "1"], "--dropout"),
    (["--dropout", "-0.1"], "--dropout"),
    (["--dropout", "half"], "--dropout"),
])
def test_bad_arguments_exit_2_naming_the_argument(capsys, argv, argument):
    # Later flags override the seed's, so each case changes exactly one argument.
    try:
        code = cli.main(["estimate", *SEED, *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert f"argument {argument}" in capsys.readouterr().err


def test_missing_required_argument_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["estimate", "--seq-len", "4096", "--heads", "32", "--layers", "32"])
    assert e.value.code == 2
    assert "--head-dim" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, name", [
    ({"seq_len": 0}, "seq_len"), ({"kv_heads": 3}, "kv_heads"), ({"dtype": "int8"}, "dtype"),
    ({"dropout": 1.0}, "dropout"),
])
def test_model_shape_rejects_bad_values_by_name(kwargs, name):
    base = {"seq_len": 128, "heads": 4, "head_dim": 16, "layers": 2}
    with pytest.raises(ValueError, match=name):
        ModelShape(**{**base, **kwargs})
