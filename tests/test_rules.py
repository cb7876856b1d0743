"""The rules on real CPU runs and on synthetic step reports: one flag per episode, with evidence."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadiag
from fadiag import baseline
from fadiag.config import RulesConfig
from fadiag.config_loader import load_config
from fadiag.records import CallRecord, StepReport
from fadiag.rules import Rules
from tests.models import GPT, SeedFlashAttention, train


def attach(**kw):
    kw.setdefault("exporter.enabled", False)
    return fadiag.attach(**kw)


def flags_of(session, rule):
    return [f for r in session.history() for f in r.flags if f.rule == rule]


def attention_step(backend=None, n=256, d=32):
    q, k, v = (torch.randn(1, 2, n, d, requires_grad=True) for _ in range(3))
    if backend is None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    else:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    fadiag.step()


def test_cpu_flash_kernel_raises_no_memory_flag():
    s = attach()
    for _ in range(3):
        attention_step()
    s.flush(10)
    assert s.last_step().memory_savings > 0.8
    assert flags_of(s, "memory_savings") == []


def test_memory_flag_fires_when_sdpa_falls_back_to_math():
    s = attach()
    attention_step(SDPBackend.MATH)
    s.flush(10)
    [flag] = flags_of(s, "memory_savings")
    assert flag.impl == "math" and flag.value < 0.8 and flag.threshold == 0.8
    assert "math path" in flag.message and flag.shape == (1, 2, 256, 256, 32)


def test_ratio_flag_fires_for_an_instrumented_op_with_a_slow_backward(monkeypatch):
    monkeypatch.setattr(SeedFlashAttention, "slow_backward", 6)
    fadiag.instrument(SeedFlashAttention, name="seed_flash")
    s = attach()
    q, k, v = (torch.randn(1, 2, 256, 32, requires_grad=True) for _ in range(3))
    SeedFlashAttention.apply(q, k, v, 0.2).sum().backward()
    fadiag.step()
    s.flush(10)
    [flag] = flags_of(s, "backward_forward_ratio")
    assert flag.impl == "seed_flash" and flag.value > 3.0
    assert "own backward is slow" in flag.message


def test_one_flag_per_episode_and_cleared_when_it_ends():
    seen = []
    s = attach(on_flag=seen.append)
    for _ in range(3):
        attention_step(SDPBackend.MATH)
    for _ in range(3):
        attention_step()
    s.flush(10)
    assert [f.rule for f in seen if f.rule == "memory_savings"] == ["memory_savings"]
    # (the ratio rule may flag these short CPU calls too; this test is about one rule's episodes)
    assert [r.step for r in s.history() if any(f.rule == "memory_savings" for f in r.flags)] == [1]
    assert not s.rules.active.get(("memory_savings", "*"))


def _report(step, seconds, impl="cpu_flash", n=256):
    """A one-call step at sequence length `n`, `seconds` of attention (backward 2x forward)."""
    call = CallRecord(site="m.py:1#0", impl=impl, shape=(1, 2, n, n, 32), dtype="float32",
                      causal=True, forward_seconds=seconds / 3, backward_seconds=2 * seconds / 3,
                      kept_bytes=100, standard_bytes=10_000)
    return StepReport(step=step, forward_seconds=seconds / 3, backward_seconds=2 * seconds / 3,
                      kept_bytes=100, standard_bytes=10_000, peak_bytes=None, calls=[call])


def test_regression_fires_within_n_plus_one_steps_of_a_slowdown_and_not_before():
    cfg = load_config({"rules": {"regression": {"warmup_steps": 5, "window": 20, "consecutive": 5}}})
    rules = Rules(cfg.rules)
    rng = torch.Generator().manual_seed(0)
    fired = []
    for step in range(1, 101):
        noise = 1.0 + 0.05 * (torch.rand(1, generator=rng).item() - 0.5)
        slow = 1.5 if step > 60 else 1.0
        for f in rules.evaluate(_report(step, 0.010 * noise * slow)):
            if not f.cleared:
                fired.append(f)
    assert [f.rule for f in fired] == ["regression"]
    assert 61 <= fired[0].step <= 66
    assert fired[0].value > 1.2 and "baseline" in fired[0].message


def test_thousand_clean_steps_raise_no_memory_or_regression_flag():
    s = attach()
    train(GPT(layers=2, dim=32, heads=2), steps=1000, seq=128, batch=1)
    s.flush(30)
    assert s.last_step().step == 1000
    regressions = flags_of(s, "regression")
    around = [round(r.attention_seconds * 1e3, 3) for r in s.history()
              if regressions and abs(r.step - regressions[0].step) <= 12]
    assert flags_of(s, "memory_savings") == []
    assert regressions == [], (regressions[0].message, s.rules.baseline_seconds, around)
    assert s.rules.baseline_seconds is not None


def test_baseline_file_round_trips(tmp_path):
    reports = [_report(i, 0.01) for i in range(1, 21)]
    b = baseline.build(reports, device="cpu", skip=5)
    path = tmp_path / "baseline.json"
    baseline.save(b, path)
    loaded = baseline.load(path)
    assert loaded == b and loaded.steps == 15
    assert loaded.expected(reports[0].sites(), "cpu") == pytest.approx((0.01, 0.01))


def test_regression_against_a_baseline_file(tmp_path):
    path = tmp_path / "baseline.json"
    baseline.save(baseline.build([_report(i, 0.01) for i in range(20)], "cpu", skip=0), path)
    cfg = load_config({"rules": {"regression": {"baseline_file": str(path), "consecutive": 2}}})
    rules = Rules(cfg.rules, device="cpu", baseline=baseline.load(path))
    assert rules.evaluate(_report(1, 0.0101)) == []
    assert rules.evaluate(_report(2, 0.02)) == []
    [flag] = rules.evaluate(_report(3, 0.02))
    assert flag.rule == "regression" and flag.value == pytest.approx(2.0)


def test_mismatched_baseline_is_a_warning_not_a_crash(tmp_path, caplog):
    path = tmp_path / "baseline.json"
    baseline.save(baseline.build([_report(i, 0.01) for i in range(20)], "NVIDIA H200", 0), path)
    rules = Rules(RulesConfig(), device="cpu", baseline=baseline.load(path))
    with caplog.at_level(logging.WARNING, logger="fadiag"):
        for i in range(3):
            rules.evaluate(_report(i, 0.01))
    assert sum("matches no site" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("content", ["not json", '{"version": 99}', '{"version": 1, "entries": 3}'])
def test_a_broken_baseline_file_names_the_problem(tmp_path, content):
    path = tmp_path / "b.json"
    path.write_text(content)
    with pytest.raises(fadiag.FadiagError, match="b.json"):
        baseline.load(path)


def test_hang_flag_fires_while_an_attention_call_is_stuck():
    release = threading.Event()

    def stuck_attention(q, k, v):
        release.wait(5)
        return q * 1.0

    seen = []
    fadiag.instrument(stuck_attention, name="stuck")
    s = attach(on_flag=seen.append, **{"rules.hang.timeout_seconds": 0.3})
    wrapped = s._instrument(stuck_attention, "stuck", "BHSD", None)
    q = torch.randn(1, 1, 4, 4, requires_grad=True)
    worker = threading.Thread(target=lambda: wrapped(q, q, q))
    worker.start()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.resolver.oldest_inflight_seconds > 0.3
    release.set()
    worker.join()
    assert seen and seen[0].rule == "hang" and seen[0].value > 0.3


def test_a_flag_callback_that_raises_is_counted_and_training_continues():
    def bad(flag):
        raise RuntimeError("user callback bug")

    s = attach(on_flag=bad)
    attention_step(SDPBackend.MATH)
    s.flush(10)
    raised = [f for r in s.history() for f in r.flags]
    assert raised and s.errors == len(raised)  # each failed delivery counted
    assert s.last_step() is not None


@pytest.mark.parametrize(("impl", "s", "expected"), [
    ("flash", 1024, "3.0-3.6x measured on an H200"),
    ("cudnn", 2048, "3.0-3.6x measured on an H200"),
    ("flash", 4096, "the backward kernel is inefficient for this shape"),
    ("efficient", 4096, "mem-efficient backend at S=4096"),
    ("cpu_flash", 256, "short sequence (S=256)"),
])
def test_ratio_message_says_what_is_normal_for_the_backend_and_length(impl, s, expected):
    from fadiag.records import SiteSummary
    from fadiag.rules import _ratio_advice

    site = SiteSummary(site="m.py:1#0", impl=impl, shape=(4, 16, s, s, 128), dtype="float16",
                       calls=1, forward_seconds=1e-3, backward_seconds=3.4e-3, kept_bytes=None,
                       standard_bytes=1)
    message = _ratio_advice(3.4, 3.0, site, 1, 1)
    assert message.startswith("backward/forward 3.40x > 3x") and expected in message


def test_regression_compares_each_step_with_its_own_shapes_baseline():
    # Two sequence lengths, 2 ms and 20 ms a step, in the pattern short, short, long: each step
    # is judged against its own shape's baseline, so a clean run stays at ratio 1 and a 1.5x
    # slowdown of both shapes fires (a median over the raw seconds of mixed shapes would compare
    # a long step with short ones and miss it).
    cfg = load_config({"rules": {"regression": {"warmup_steps": 3, "window": 10, "consecutive": 5}}})
    rules = Rules(cfg.rules)
    fired, ratios = [], []
    for step in range(1, 151):
        n, seconds = (1024, 0.020) if step % 3 == 0 else (256, 0.002)
        slow = 1.5 if step > 120 else 1.0
        fired += [f for f in rules.evaluate(_report(step, seconds * slow, n=n)) if not f.cleared]
        if 60 < step <= 120:
            ratios.append(rules.regression_ratio)
    assert ratios == [pytest.approx(1.0)] * 60
    assert [f.rule for f in fired] == ["regression"]
    assert 121 <= fired[0].step <= 127 and fired[0].value == pytest.approx(1.5)


def test_regression_ratio_covers_the_sites_a_baseline_file_matches(tmp_path):
    # The file knows one of the run's two sites: the ratio is that site's time over its
    # baseline, not the whole step's time over one site's baseline.
    path = tmp_path / "baseline.json"
    baseline.save(baseline.build([_report(i, 0.01) for i in range(20)], "cpu", skip=0), path)
    rules = Rules(RulesConfig(), device="cpu", baseline=baseline.load(path))
    step = _report(1, 0.01)
    other = CallRecord(site="m.py:9#0", impl="cpu_flash", shape=(1, 2, 256, 256, 32), dtype="float32",
                       causal=True, forward_seconds=0.01, backward_seconds=0.02)
    step.calls.append(other)
    step.forward_seconds += other.forward_seconds
    step.backward_seconds += other.backward_seconds
    assert rules.evaluate(step) == []
    assert rules.regression_ratio == pytest.approx(1.0)
    assert rules.baseline_seconds == pytest.approx(0.01)


def test_a_site_flag_names_its_site_and_not_a_count():
    # The step total is under the line and one of two sites is over it: the flag is that site's.
    def call(site, fwd, bwd):
        return CallRecord(site=site, impl="cpu_flash", shape=(1, 2, 4096, 4096, 64), dtype="float32",
                          causal=True, forward_seconds=fwd, backward_seconds=bwd, kept_bytes=100,
                          standard_bytes=10_000)

    calls = [call("m.py:1#0", 0.001, 0.005), call("m.py:2#0", 0.010, 0.010)]
    report = StepReport(step=1, forward_seconds=0.011, backward_seconds=0.015, kept_bytes=200,
                        standard_bytes=20_000, peak_bytes=None, calls=calls)
    [flag] = Rules(RulesConfig()).evaluate(report)
    assert flag.site == "m.py:1#0" and flag.value == pytest.approx(5.0)
    assert "(site m.py:1#0: impl=cpu_flash B=1 H=2 Sq=4096" in flag.message and "sites;" not in flag.message
