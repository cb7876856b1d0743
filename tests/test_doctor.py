"""fadiag doctor: torch build, devices, SDPA backend verdicts with torch's reasons, packages."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch

from fadiag.cli import main
from fadiag.cli.doctor import checks as doctor
from fadiag.cli.doctor.checks import Query, diagnose, format_text


def test_report_covers_torch_build_devices_sdpa_and_packages() -> None:
    report = diagnose(Query(device="cpu", seq_len=512, heads=4, head_dim=64))
    assert report["torch"]["version"] == torch.__version__
    assert report["devices"]["cpu"]["available"] is True
    assert set(report["packages"]) >= {"flash_attn", "torch_npu", "transformers", "lightning",
                                       "prometheus_client"}
    assert report["packages"]["prometheus_client"]["importable"] is True
    assert report["sdpa"]["chosen"] in ("cpu_flash", "math")
    text = format_text(report)
    assert "prometheus_client" in text and "sdpa on cpu" in text


def test_cpu_flash_is_usable_for_a_plain_causal_call() -> None:
    backends = diagnose(Query(device="cpu"))["sdpa"]["backends"]
    assert backends["cpu_flash"] == {"usable": True, "reasons": []}
    assert backends["math"]["usable"] is True


def test_cpu_flash_refusal_carries_torchs_reason_for_dropout() -> None:
    sdpa = diagnose(Query(device="cpu", dtype="float16", dropout=0.1))["sdpa"]
    assert sdpa["chosen"] == "math"
    flash = sdpa["backends"]["cpu_flash"]
    assert flash["usable"] is False
    assert any("dropout" in r for r in flash["reasons"])
    assert not any("Triggered internally" in r for r in flash["reasons"])


def test_disabled_flash_flag_is_named_as_the_reason() -> None:
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        sdpa = diagnose(Query(device="cpu"))["sdpa"]
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    assert sdpa["backends"]["cpu_flash"]["usable"] is False
    assert sdpa["backends"]["cpu_flash"]["reasons"]
    assert sdpa["enabled"]["flash"] is False


def test_cuda_verdicts_come_from_torchs_checks_with_their_warnings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    b = torch.backends.cuda

    def refuses(params: Any, debug: bool) -> bool:
        assert debug is True
        warnings.warn("Flash attention kernel not used because:", UserWarning, stacklevel=1)
        warnings.warn("Flash attention requires head_dim <= 256 (Triggered internally at x.cpp:1.)",
                      UserWarning, stacklevel=1)
        return False

    on_cpu = doctor._inputs
    monkeypatch.setattr(doctor, "_inputs", lambda q, device: on_cpu(q, "cpu"))
    monkeypatch.setattr(b, "SDPAParams", lambda *args: args)
    monkeypatch.setattr(b, "can_use_flash_attention", refuses)
    monkeypatch.setattr(b, "can_use_efficient_attention", lambda p, debug: True)
    monkeypatch.setattr(b, "can_use_cudnn_attention", lambda p, debug: True)
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *args: 2)
    monkeypatch.setattr(doctor, "_devices", lambda: {"cuda": {"available": True}})
    sdpa = diagnose(Query(device="cuda", head_dim=512, dtype="bfloat16"))["sdpa"]
    assert sdpa["backends"]["flash"] == {"usable": False,
                                         "reasons": ["Flash attention requires head_dim <= 256"]}
    assert sdpa["backends"]["efficient"]["usable"] is True
    assert sdpa["chosen"] == "efficient"


def test_native_marks_are_reported_and_built_on_request(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from fadiag.capture import native

    built = []
    monkeypatch.setattr(native, "load", lambda kind: built.append(kind))
    report = diagnose(Query(device="cpu"))
    assert set(report["native"]["toolchain"]) == {"compiler", "ninja"}
    assert report["native"]["cpu"]["status"] in ("not built", "loaded", "building") \
        or report["native"]["cpu"]["status"].startswith("unavailable")
    assert built == []  # only --build-native builds
    assert main(["doctor", "--device", "cpu", "--build-native"]) == 0
    assert built and built[0] == "cpu"
    assert "native marks (compiler" in capsys.readouterr().out


@pytest.mark.parametrize(("cached", "fresh", "says"), [
    (False, False, "not built yet"), (True, False, "older than its sources"), (True, True, None)])
def test_doctor_says_whether_the_tap_loads_at_attach_or_is_built_first(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        cached: bool, fresh: bool, says: str | None) -> None:
    from fadiag.capture import native
    from fadiag.capture.tap import supported

    if supported() is not None:
        pytest.skip(f"no tap with this torch: {supported()}")
    monkeypatch.setattr(native, "status", lambda kind: "not built")
    monkeypatch.setattr(native, "cached", lambda kind: cached)
    monkeypatch.setattr(native, "fresh", lambda kind: fresh)
    tap = diagnose(Query(device="cpu"))["tap"]
    assert tap["usable"] == fresh
    if says is None:
        assert tap["why_not"] is None
    else:
        assert says in tap["why_not"] and "--build-native" in tap["why_not"]
    assert main(["doctor", "--device", "cpu"]) in (0, 1)
    out = capsys.readouterr().out
    assert ("ready" if fresh else "not ready: the native extension is " + says) in out


def test_json_output_is_the_whole_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--device", "cpu", "--json", "--seq-len", "128"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sdpa"]["query"]["seq_len"] == 128
    assert report["sdpa"]["query"]["dtype"] == "float32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report on a machine without CUDA")
def test_a_device_this_machine_lacks_is_reported_and_exits_1(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--device", "cuda"]) == 1
    assert "device 'cuda' is not available" in capsys.readouterr().out


@pytest.mark.parametrize("argv, named", [
    (["--heads", "0"], "--heads"),
    (["--seq-len", "x"], "--seq-len"),
    (["--dtype", "float8"], "--dtype"),
    (["--dropout", "1.5"], "--dropout"),
    (["--device", "tpu"], "--device"),
])
def test_bad_doctor_arguments_exit_2_naming_the_argument(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["doctor", *argv])
    assert exc.value.code == 2
    assert f"argument {named}" in capsys.readouterr().err
