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
from fadiag.config.loader import load_config
from fadiag.export.jsonl import read_run
from fadiag.rules import baseline
from fadiag.rules.engine import Rules, fastest_ratio, host_judged_ratios
from fadiag.rules.episodes import CLEAR_AFTER
from fadiag.steps.records import CallRecord, Flag, StepReport
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
    # Judged after the warm-up (3 steps) on the lowest of 9 host-clock windows of 9 steps'
    # fastest ratio (17 steps at the least): flagged once, on a machine that lets it run.
    monkeypatch.setattr(SeedFlashAttention, "slow_backward", 6)
    fadiag.instrument(SeedFlashAttention, name="seed_flash")
    # Every step judged, however busy the machine (the contended-step gate: tests/test_host.py).
    s = attach(**{"rules.backward_forward_ratio.max_cpu_wait": 1.0})
    for _ in range(40):
        q, k, v = (torch.randn(1, 2, 256, 32, requires_grad=True) for _ in range(3))
        SeedFlashAttention.apply(q, k, v, 0.2).sum().backward()
        fadiag.step()
    s.flush(10)
    flags = flags_of(s, "backward_forward_ratio")
    # The windows hold the steps after the warm-up with a timed, non-probe call (a signature
    # still being learned, a backward left untimed, is not in one). A busy machine can stretch
    # every forward of a window by a scheduler slice (0.2 ms to 3 ms) and that window reads
    # low: the flag comes at the first step whose last 9 windows all read over 3x, recomputed
    # here from the seconds the steps report.
    judged = [(r.step, sum(c.forward_seconds for c in r.calls if not c.probe),
               sum(c.backward_seconds for c in r.calls if not c.probe))
              for r in s.history() if r.step > 3]
    judged = [(step, f, b) for step, f, b in judged if f > 0 and b > 0]
    readings = host_judged_ratios([(f, b) for _, f, b in judged], 9)
    first = next(i for i, r in enumerate(readings) if r > 3.0)
    assert flags[0].step == judged[first + 16][0] >= 3 + 17, judged
    assert flags[0].value == pytest.approx(readings[first])
    # One episode, unless the readings left 3x for CLEAR_AFTER steps in a row and came back:
    # with the gate off, a neighbour that takes both CPUs for a while stretches every forward
    # of 9 steps in a row (seen while a compiler ran beside it, forwards 40x longer), and the
    # rule then clears the episode and raises it again. Exactly the flags the readings make:
    over = {judged[i + 16][0]: r > 3.0 for i, r in enumerate(readings)}
    raised, open_, calm = [], False, 0
    for r in s.history():
        if over.get(r.step, False):
            raised += [] if open_ else [r.step]
            open_, calm = True, 0
        elif open_:
            calm += 1
            open_ = calm < CLEAR_AFTER
    assert [f.step for f in flags] == raised
    for flag in flags:
        assert flag.impl == "seed_flash" and flag.severity == "warning" and flag.band == "unknown"
        assert "own backward is slow" in flag.message
        assert "the lowest of the last 9 windows" in flag.message


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


def _report(step, seconds, impl="cpu_flash", n=256, ratio=2.0, device="cpu", probe=False,
            dtype="float32", site="m.py:1#0", step_seconds=1.0):
    """A one-call step at sequence length `n`, `seconds` of attention (backward `ratio`x forward),
    closed `step_seconds` after the previous one."""
    fwd, bwd = seconds / (1 + ratio), seconds * ratio / (1 + ratio)
    call = CallRecord(site=site, impl=impl, shape=(1, 2, n, n, 32), dtype=dtype, causal=True,
                      device=device, forward_seconds=fwd, backward_seconds=bwd, kept_bytes=100,
                      standard_bytes=10_000, probe=probe)
    return StepReport(step=step, forward_seconds=fwd, backward_seconds=bwd, kept_bytes=100,
                      standard_bytes=10_000, peak_bytes=None, calls=[call],
                      wall_time=step * step_seconds)


def _rules(device="cpu", baseline_file=None, **rules):
    cfg = load_config({"rules": rules})
    return Rules(cfg.rules, device=device,
                 baseline=baseline.load(baseline_file) if baseline_file else None)


def _raised(rules, reports):
    return [f for r in reports for f in rules.evaluate(r) if not f.cleared]


def test_a_held_episode_keeps_its_flag_and_formats_no_advice_again(monkeypatch):
    """Episodes read only the severity of the flags after the one that opened an episode: while
    the condition holds at that severity the rule hands back the open flag (a healthy cuDNN job
    holds an info episode every step, and formatting its advice each time was the resolver's
    work for nothing); a graver condition still raises at once."""
    from fadiag.rules import engine

    made = []
    advice = engine.ratio_advice
    monkeypatch.setattr(engine, "ratio_advice", lambda *a: (made.append(a[0]), advice(*a))[1])
    rules = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0},
                   regression={"enabled": False})

    def cudnn(step, ratio):
        return _report(step, 0.01, impl="cudnn", n=2048, ratio=ratio, device="cuda",
                       dtype="bfloat16")

    raised = [_raised(rules, [cudnn(step, 3.3)]) for step in range(1, 6)]
    assert [len(r) for r in raised] == [1, 0, 0, 0, 0] and raised[0][0].severity == "info"
    assert len(made) == 1 and rules.active[("backward_forward_ratio", "*")] is raised[0][0]
    # A graver condition raises as soon as the site's recent steps hold it (Rules._typical).
    assert _raised(rules, [cudnn(6, 5.0)]) == [] and len(made) == 1
    [graver] = _raised(rules, [cudnn(7, 5.0)])
    assert graver.severity == "warning" and graver.step == 7 and len(made) == 2
    assert rules.active[("backward_forward_ratio", "*")] is graver


def test_one_steps_outlier_beyond_the_band_is_info_and_a_backward_that_stays_slow_a_warning():
    """A healthy GPT's sites read 2.8-3.5x step to step on the H200 (cuDNN, S=2048), and one
    step's site once read 3.57x, past the band's edge: judged alone, a healthy job was told its
    kernel was slow. A site's severity is judged on the median of its last three steps; a
    backward that turned slow is a warning from its second step."""
    rules = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0})

    def step(i, ratios):
        return rules.evaluate(_sites_report(i, ratios, n=2048))

    [opened] = step(1, [3.2, 3.3])
    assert opened.severity == "info"
    assert [f.severity for f in step(2, [3.25, 3.3]) if not f.cleared] == []
    # Site 0 reads 3.60x once (beyond 2.65-3.48x with its spread): still the kernel.
    spike = [f for f in step(3, [3.6, 3.3]) if not f.cleared]
    assert spike == []
    assert rules.active[("backward_forward_ratio", "*")] is opened
    # It stays at 3.9x: a warning on the second slow step, whose message gives the median.
    for i in (4, 5, 6):
        assert [f for f in step(i, [3.3 if i < 6 else 3.9, 3.3]) if not f.cleared] == []
    [slow] = [f for f in step(7, [3.9, 3.3]) if not f.cleared]
    assert slow.severity == "warning" and slow.step == 7
    assert "worst llama.py:9#0 3.90x" in slow.message
    assert "beyond the 2.65-3.48x cudnn measures at S≈2048 on an H200" in slow.message
    # Judged alone, the first step over the band is a warning, as before (no recent steps).
    [alone] = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0}).evaluate(
        _sites_report(1, [3.6, 3.3], n=2048))
    assert alone.severity == "warning" and "recent steps" not in alone.message


def test_regression_fires_within_n_plus_one_steps_of_a_slowdown_and_not_before():
    cfg = load_config({"rules": {"regression": {"warmup_steps": 5, "window": 20, "consecutive": 5,
                                                "sustain_seconds": 0}}})
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


def test_thousand_clean_steps_raise_no_memory_or_regression_flag(tmp_path):
    s = attach(jsonl=str(tmp_path))
    train(GPT(layers=2, dim=32, heads=2), steps=1000, seq=128, batch=1)
    s.flush(30)
    assert s.last_step().step == 1000
    regressions = flags_of(s, "regression")
    around = [round(r.attention_seconds * 1e3, 3) for r in s.history()
              if regressions and abs(r.step - regressions[0].step) <= 12]
    assert flags_of(s, "memory_savings") == []
    assert regressions == [], (regressions[0].message, s.rules.baseline_seconds, around)
    # Every step past the warm-up was judged, or counted as contended (a busy machine): the
    # baseline is learned from the first `window` (50) judged steps.
    fadiag.detach()
    steps = read_run(tmp_path / "fadiag-rank0.jsonl").steps
    judged = [r for r in steps[10:] if r.cpu_wait is None or r.cpu_wait <= 0.1]
    assert s.rules.contended_steps["regression"] == len(steps[10:]) - len(judged)
    assert (s.rules.baseline_seconds is not None) == (len(judged) >= 50)


def test_baseline_file_round_trips(tmp_path):
    reports = [_report(i, 0.01) for i in range(1, 21)]
    b = baseline.build(reports, device="cpu", skip=5)
    path = tmp_path / "baseline.json"
    baseline.save(b, path)
    loaded = baseline.load(path)
    assert loaded == b and loaded.steps == 15
    match = loaded.expected(reports[0].sites(), "cpu")
    assert (match.observed, match.expected, match.changes) == (pytest.approx(0.01),
                                                               pytest.approx(0.01), [])


def test_regression_against_a_baseline_file(tmp_path):
    path = tmp_path / "baseline.json"
    baseline.save(baseline.build([_report(i, 0.01) for i in range(20)], "cpu", skip=0), path)
    cfg = load_config({"rules": {"regression": {"baseline_file": str(path), "consecutive": 2,
                                                "warmup_steps": 0, "sustain_seconds": 0}}})
    rules = Rules(cfg.rules, device="cpu", baseline=baseline.load(path))
    assert rules.evaluate(_report(1, 0.0101)) == []
    assert rules.evaluate(_report(2, 0.02)) == []
    [flag] = rules.evaluate(_report(3, 0.02))
    assert flag.rule == "regression" and flag.value == pytest.approx(2.0)


def test_mismatched_baseline_is_a_warning_not_a_crash(tmp_path, caplog):
    path = tmp_path / "baseline.json"
    baseline.save(baseline.build([_report(i, 0.01) for i in range(20)], "NVIDIA H200", 0), path)
    rules = Rules(load_config({"rules": {"regression": {"warmup_steps": 0}}}).rules, device="cpu",
                  baseline=baseline.load(path))
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


def test_regression_compares_each_step_with_its_own_shapes_baseline():
    # Two sequence lengths, 2 ms and 20 ms a step, in the pattern short, short, long: each step
    # is judged against its own shape's baseline, so a clean run stays at ratio 1 and a 1.5x
    # slowdown of both shapes fires (a median over the raw seconds of mixed shapes would compare
    # a long step with short ones and miss it).
    cfg = load_config({"rules": {"regression": {"warmup_steps": 3, "window": 10, "consecutive": 5,
                                                "sustain_seconds": 0}}})
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
    rules = _rules(baseline_file=path, regression={"warmup_steps": 0})
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
        return CallRecord(site=site, impl="flash", shape=(1, 2, 4096, 4096, 64), dtype="float16",
                          causal=True, device="cuda", forward_seconds=fwd, backward_seconds=bwd,
                          kept_bytes=100, standard_bytes=10_000)

    calls = [call("m.py:1#0", 0.001, 0.005), call("m.py:2#0", 0.010, 0.010)]
    report = StepReport(step=1, forward_seconds=0.011, backward_seconds=0.015, kept_bytes=200,
                        standard_bytes=20_000, peak_bytes=None, calls=calls)
    [flag] = _rules(backward_forward_ratio={"warmup_steps": 0}).evaluate(report)
    assert flag.site == "m.py:1#0" and flag.value == pytest.approx(5.0)
    assert "(site m.py:1#0: impl=flash B=1 H=2 Sq=4096" in flag.message and "sites;" not in flag.message


# ---- the ratio rule: steady state, healthy bands, severity ---------------------------------


def test_probe_calls_and_the_first_steps_after_attach_are_not_judged():
    rules = _rules(backward_forward_ratio={"warmup_steps": 3})
    cold = [_report(i, 0.01, impl="flash", n=4096, ratio=60.0, device="cuda", dtype="float16")
            for i in (1, 2, 3)]
    probe = _report(4, 0.01, impl="flash", n=4096, ratio=60.0, device="cuda", dtype="float16",
                    probe=True)
    steady = _report(5, 0.01, impl="flash", n=4096, ratio=2.9, device="cuda", dtype="float16")
    assert _raised(rules, [*cold, probe, steady]) == []
    [flag] = _raised(rules, [_report(6, 0.01, impl="flash", n=4096, ratio=4.0, device="cuda",
                                     dtype="float16")])
    assert flag.step == 6 and flag.value == pytest.approx(4.0)


def _preempted(step, fwd_ms, ratio):
    """A one-call host-clock step whose forward took `fwd_ms` and backward `ratio` times that."""
    return _report(step, fwd_ms * 1e-3 * (1 + ratio), ratio=ratio)


def test_host_clock_ratio_spikes_do_not_flag_but_a_sustained_rise_does():
    rules = _rules()
    # Every third step a preempted backward reads 40x its 2x; the fastest of 9 stays at 2x.
    noisy = [_preempted(i, 1.0, 40.0 if i % 3 == 0 else 2.0) for i in range(1, 101)]
    assert _raised(rules, noisy) == []
    slow = [_preempted(i, 1.0, 4.0) for i in range(101, 121)]
    [flag] = _raised(rules, slow)
    # A window of nine holds only 4x steps from step 109 on, and nine such windows end at 117.
    assert flag.step == 117 and flag.value == pytest.approx(4.0)
    assert "the lowest of the last 9 windows" in flag.message


def _stretched(step, fwd_ms, bwd_ms):
    """A one-call host-clock step whose forward took `fwd_ms` and backward `bwd_ms`."""
    return _report(step, (fwd_ms + bwd_ms) * 1e-3, ratio=bwd_ms / fwd_ms)


def test_a_lucky_forward_among_stretched_steps_does_not_flag_but_a_slow_backward_does():
    rules = _rules()
    # A neighbour that comes and goes: for 12 steps it stretches every call 1.5x, but one short
    # forward runs undisturbed (step 46). The windows that hold it and only stretched backward
    # calls read 3.3x (2.2 * 1.5 / 1.0) for a healthy 2.2x kernel; not nine in a row do.
    clean = [_stretched(i, 1.0, 2.2) for i in range(1, 41)]
    neighbour = [_stretched(i, 1.0 if i == 46 else 1.5, 3.3) for i in range(41, 53)]
    assert max(fastest_ratio([(c.forward_seconds, c.backward_seconds) for r in
                              (clean + neighbour)[i - 9:i] for c in r.calls])
               for i in range(9, 53)) == pytest.approx(3.3)
    assert _raised(rules, clean + neighbour + [_stretched(i, 1.0, 2.2) for i in range(53, 80)]) == []
    # A backward that really is 1.8x slower reads 3.96x in every window.
    [flag] = _raised(rules, [_stretched(i, 1.0, 3.96) for i in range(80, 100)])
    assert flag.step == 96 and flag.value == pytest.approx(3.96)
    # What is normal for cpu_flash on the host clock, and what else reads as a slow backward.
    assert "cpu_flash measured 2.0-2.4x healthy" in flag.message
    assert "fadiag calibrate measures this machine's own range" in flag.message
    assert "over 3x in every window" in flag.message
    # A job's own threshold is the line the message names.
    rules = _rules(backward_forward_ratio={"per_impl": {"cpu_flash": 3.5}})
    [flag] = _raised(rules, [_stretched(i, 1.0, 3.96) for i in range(1, 21)])
    assert flag.threshold == 3.5 and "over 3.5x in every window" in flag.message


def test_a_host_clock_backward_stretched_in_most_steps_does_not_flag():
    # Beside a busy process two of three backward calls wait out a scheduler slice (2 ms on
    # top of a 2 ms backward); the forward of some steps is stretched too.
    rules = _rules()
    steps = [_report(i, (1.0 + (3.0 if i % 5 == 0 else 0.0) + 2.0 + (2.0 if i % 3 else 0.0)) * 1e-3,
                     ratio=(2.0 + (2.0 if i % 3 else 0.0)) / (1.0 + (3.0 if i % 5 == 0 else 0.0)))
             for i in range(1, 301)]
    assert sum(r.ratio > 3.0 for r in steps) >= 150
    assert _raised(rules, steps) == []


def test_device_clock_ratio_is_judged_on_each_step():
    rules = _rules(device="NVIDIA A100-SXM4-80GB")
    steps = [_report(i, 0.01, impl="flash", n=4096, ratio=2.8, device="cuda", dtype="bfloat16")
             for i in range(1, 6)]
    assert _raised(rules, steps) == []
    [flag] = _raised(rules, [_report(6, 0.01, impl="flash", n=4096, ratio=4.2, device="cuda",
                                     dtype="bfloat16")])
    assert flag.step == 6 and "median" not in flag.message


def test_a_ratio_within_the_band_measured_on_an_h200_is_info_and_says_so():
    rules = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0})
    [flag] = rules.evaluate(_report(1, 0.01, impl="cudnn", n=2048, ratio=3.3, device="cuda",
                                    dtype="bfloat16"))
    assert flag.severity == "info" and flag.band == "cudnn S≈2048 H200: 2.65-3.48x"
    assert "within the 2.65-3.48x cudnn measures at S≈2048 on an H200" in flag.message
    assert "this is the kernel, not a fault" in flag.message
    assert "rules.backward_forward_ratio.per_impl.cudnn" in flag.message


def test_a_ratio_beyond_its_band_is_a_warning_that_names_the_band():
    rules = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0})
    [flag] = rules.evaluate(_report(1, 0.01, impl="flash", n=8192, ratio=4.5, device="cuda",
                                    dtype="float16"))
    assert flag.severity == "warning" and flag.band == "flash S≈8192 H200: 2.73-2.99x"
    assert "beyond the 2.73-2.99x flash measures at S≈8192 on an H200" in flag.message


@pytest.mark.parametrize(("device", "impl", "n", "dtype"), [
    ("NVIDIA A100-SXM4-80GB", "flash", 2048, "float16"),  # another card
    ("NVIDIA H200", "flash", 512, "float16"),  # a length the grid did not measure
    ("NVIDIA H200", "flash", 2048, "float32"),  # fp32
    ("NVIDIA H200", "flash_attn", 2048, "float16"),  # another impl
])
def test_a_ratio_flag_where_no_band_was_measured_is_a_warning_with_band_unknown(device, impl, n,
                                                                                 dtype):
    rules = _rules(device=device, backward_forward_ratio={"warmup_steps": 0})
    [flag] = rules.evaluate(_report(1, 0.01, impl=impl, n=n, ratio=3.4, device="cuda", dtype=dtype))
    assert flag.severity == "warning" and flag.band == "unknown"
    assert "no healthy range measured for" in flag.message


def test_a_per_impl_threshold_replaces_the_default_for_that_impl_only():
    rules = _rules(device="NVIDIA H200", per_site=True, backward_forward_ratio={
        "warmup_steps": 0, "per_impl": {"cudnn": 3.7}})
    cudnn = _report(1, 0.01, impl="cudnn", n=2048, ratio=3.5, device="cuda", dtype="bfloat16")
    assert rules.evaluate(cudnn) == []
    [flag] = rules.evaluate(_report(2, 0.01, impl="cudnn", n=2048, ratio=3.8, device="cuda",
                                    dtype="bfloat16"))
    assert flag.threshold == pytest.approx(3.7) and "> 3.7x" in flag.message
    [flag] = _rules(backward_forward_ratio={"warmup_steps": 0, "per_impl": {"cudnn": 3.7}}).evaluate(
        _report(1, 0.01, impl="flash", n=2048, ratio=3.5, device="cuda", dtype="bfloat16"))
    assert flag.threshold == pytest.approx(3.0)


def _sites_report(step, ratios, impl="cudnn", n=2048):
    calls = [CallRecord(site=f"llama.py:9#{i}", impl=impl, shape=(1, 32, n, n, 128),
                        dtype="bfloat16", causal=True, device="cuda", forward_seconds=1e-4,
                        backward_seconds=r * 1e-4, kept_bytes=100, standard_bytes=10_000)
             for i, r in enumerate(ratios)]
    return StepReport(step=step, forward_seconds=1e-4 * len(calls),
                      backward_seconds=sum(c.backward_seconds for c in calls), kept_bytes=100,
                      standard_bytes=10_000, peak_bytes=None, calls=calls)


def test_sixteen_sites_over_the_line_are_one_flag_that_names_the_worst():
    rules = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0})
    ratios = [3.25 + 0.0086 * i for i in range(16)]  # 3.25-3.38x, as a healthy Llama measured
    [flag] = rules.evaluate(_sites_report(1, ratios))
    assert flag.site == "*" and flag.severity == "info"
    assert "(16/16 sites; worst llama.py:9#15 3.38x" in flag.message


def test_one_log_line_for_the_flags_of_one_step_and_none_again_after_attach(caplog):
    from fadiag.export.log import LogSink

    per_site = [Flag(rule="backward_forward_ratio", value=3.2 + 0.01 * i, threshold=3.0, step=1,
                     site=f"m.py:1#{i}", message=f"site {i}", severity="info") for i in range(16)]
    with caplog.at_level(logging.INFO, logger="fadiag"):
        LogSink(60.0).flags(per_site)
        LogSink(60.0).flags(per_site)  # a new session (attach after detach) inside the interval
    [line] = [r for r in caplog.records if "backward_forward_ratio" in r.message]
    assert line.levelno == logging.INFO
    assert "16 sites at once, the worst: site 15" in line.message and "[info]" in line.message


def test_a_warning_is_logged_even_while_an_info_flag_of_the_rule_is_rate_limited(caplog):
    from fadiag.export.log import LogSink

    def flag(severity):
        return Flag(rule="backward_forward_ratio", value=3.3, threshold=3.0, step=1, site="*",
                    message=severity, severity=severity)

    sink = LogSink(60.0)
    with caplog.at_level(logging.INFO, logger="fadiag"):
        sink.flags([flag("info")])
        sink.flags([flag("info")])
        sink.flags([flag("warning")])
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]


# ---- regression: sustained evidence, warm-up, impl switches ---------------------------------


def test_regression_needs_both_its_steps_and_its_seconds_above_tolerance():
    # 0.25 s steps: a burst of 7 slow steps keeps the median of 3 over for 6 consecutive steps
    # (32-38), more than `consecutive`, but they span 1.25 s, short of sustain_seconds=2.
    rules = _rules(regression={"warmup_steps": 2, "window": 10, "consecutive": 5,
                               "sustain_seconds": 2.0})
    clean = [_report(i, 0.01, step_seconds=0.25) for i in range(1, 31)]
    burst = [_report(i, 0.03, step_seconds=0.25) for i in range(31, 38)]
    calm = [_report(i, 0.01, step_seconds=0.25) for i in range(38, 60)]
    assert _raised(rules, clean + burst + calm) == []
    slow = [_report(i, 0.03, step_seconds=0.25) for i in range(60, 100)]
    [flag] = _raised(rules, slow)
    assert flag.rule == "regression" and flag.step == 69  # over from step 61, 2 s later
    assert "over 2 s" in flag.message


def test_a_baseline_file_is_not_compared_during_the_warm_up(tmp_path):
    path = tmp_path / "baseline.json"
    baseline.save(baseline.build([_report(i, 0.01) for i in range(20)], "cpu", skip=0), path)
    rules = _rules(baseline_file=path, regression={"consecutive": 2, "sustain_seconds": 0})
    cold = [_report(i, 0.05) for i in range(1, 11)]  # the first 10 steps: cold caches
    assert _raised(rules, cold) == [] and rules.regression_ratio is None
    assert _raised(rules, [_report(11, 0.0101)]) == []
    assert rules.regression_ratio == pytest.approx(1.01)


def test_a_switch_of_impl_at_the_baseline_shapes_is_a_regression_that_names_it(tmp_path):
    path = tmp_path / "baseline.json"
    baseline.save(baseline.build([_report(i, 0.01, impl="flash") for i in range(20)], "cpu",
                                 skip=0), path)
    rules = _rules(baseline_file=path, regression={"warmup_steps": 0, "sustain_seconds": 0})
    # The same time (a fallback need not be slower at this shape): the impl is what changed.
    [flag] = _raised(rules, [_report(i, 0.01, impl="math") for i in range(1, 8)])
    assert flag.rule == "regression" and flag.step == 5 and flag.impl == "math"
    assert "site m.py:1#0 switched impl flash → math at the baseline's shapes" in flag.message


def test_a_version_1_baseline_file_loads_with_the_impl_moved_into_its_entries(tmp_path):
    path = tmp_path / "v1.json"
    path.write_text('{"version": 1, "device": "cpu", "steps": 4, "entries": {'
                    '"m.py:1#0|1x2x256x256x32|float32|cpu|cpu_flash": '
                    '{"forward_seconds": 0.001, "backward_seconds": 0.002}}}')
    b = baseline.load(path)
    assert b.entries == {"m.py:1#0|1x2x256x256x32|float32|cpu": {
        "forward_seconds": 0.001, "backward_seconds": 0.002, "impl": "cpu_flash"}}


def test_a_baseline_leaves_out_the_warm_up_and_the_calls_that_learned_a_signature():
    reports = [_report(1, 0.5, probe=True)] + [_report(i, 0.01) for i in range(2, 21)]
    b = baseline.build(reports, "cpu", skip=0)
    [entry] = b.entries.values()
    assert entry["forward_seconds"] + entry["backward_seconds"] == pytest.approx(0.01)
    assert entry["impl"] == "cpu_flash"


def _checkpointed_report(step, first_fwd, again_fwd, bwd, n=2048):
    """One checkpointed site: its forward pass call, and the recomputation that carries the
    backward (as the tap and the wrapper report them)."""
    kw = dict(site="llama.py:9#0", impl="cudnn", shape=(2, 16, n, n, 128), dtype="bfloat16",
              causal=True, device="cuda", kept_bytes=100, standard_bytes=10_000)
    calls = [CallRecord(forward_seconds=first_fwd, backward_seconds=0.0, **kw),
             CallRecord(forward_seconds=again_fwd, backward_seconds=bwd, recompute=True, **kw)]
    return StepReport(step=step, forward_seconds=first_fwd, backward_seconds=bwd, kept_bytes=100,
                      standard_bytes=10_000, peak_bytes=None, calls=calls,
                      recompute_seconds=again_fwd)


def test_a_checkpointed_site_divides_by_the_faster_of_its_two_forward_windows():
    # The H200's HF Llama under non-reentrant checkpointing: the forward pass read 0.146 ms, the
    # recomputation of the same kernel 0.083 ms, the backward 0.271 ms (plain: 0.083 / 0.269).
    report = _checkpointed_report(1, 0.146e-3, 0.083e-3, 0.271e-3)
    (site,) = report.sites()
    assert site.calls == 1 and site.recomputes == 1
    assert site.forward_seconds == pytest.approx(0.146e-3)  # what the forward pass took, as read
    assert site.ratio == pytest.approx(0.271 / 0.083)
    assert report.ratio == pytest.approx(0.271 / 0.083)
    # A recomputation that read slower leaves the forward pass's window as the divisor.
    slow_again = _checkpointed_report(2, 0.083e-3, 0.146e-3, 0.271e-3)
    assert slow_again.sites()[0].ratio == pytest.approx(0.271 / 0.083)


def test_the_ratio_rule_judges_a_checkpointed_site_by_its_kernel_not_its_starved_window():
    rules = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0,
                                                                 "per_impl": {"cudnn": 3.7}})
    healthy = [_checkpointed_report(i, 0.146e-3, 0.083e-3, 0.271e-3) for i in range(1, 4)]
    assert _raised(rules, healthy) == []
    # A backward really 1.5x slow is flagged whichever window the forward pass read.
    [flag] = _raised(rules, [_checkpointed_report(4, 0.146e-3, 0.083e-3, 1.5 * 0.271e-3)])
    assert flag.rule == "backward_forward_ratio" and flag.value == pytest.approx(1.5 * 0.271 / 0.083)


def test_a_call_whose_windows_may_hold_host_time_is_not_judged_by_the_ratio_rule(caplog):
    # A starved device: the backward window may hold 0.2 ms of the host's launches (the tap saw
    # the device past the window's start before the op was queued whole), so its 5x says nothing
    # of the kernel. Counted, said once; the device-bound step beside it is judged as before.
    rules = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0})
    starved = _report(1, 0.6e-3, impl="cudnn", n=2048, ratio=5.0, device="cuda", dtype="bfloat16")
    starved.calls[0].backward_host_seconds = 0.2e-3
    assert starved.calls[0].host_bound and starved.host_bound_calls == 1
    with caplog.at_level(logging.INFO, logger="fadiag"):
        assert _raised(rules, [starved]) == []
        again = _report(2, 0.6e-3, impl="cudnn", n=2048, ratio=5.0, device="cuda", dtype="bfloat16")
        again.calls[0].forward_host_seconds = 0.05e-3  # a forward window: a ratio too small
        assert _raised(rules, [again]) == []
    assert rules.host_bound_calls == 2
    assert sum("may hold host time" in r.getMessage() for r in caplog.records) == 1
    # Host time under 5 % of the window: device-bound, judged.
    slight = _report(3, 0.6e-3, impl="cudnn", n=2048, ratio=5.0, device="cuda", dtype="bfloat16")
    slight.calls[0].backward_host_seconds = 0.01e-3
    assert not slight.calls[0].host_bound
    [flag] = _raised(rules, [slight])
    assert flag.rule == "backward_forward_ratio" and flag.value == pytest.approx(5.0)
    assert rules.host_bound_calls == 2


def test_a_checkpointed_site_whose_forward_pass_was_host_bound_is_judged_on_its_recomputation():
    # The forward pass starved (its window may hold host time); the recomputation of the same
    # kernel and the backward it carries are device work: the site is judged on those two.
    rules = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0})
    report = _checkpointed_report(1, 0.146e-3, 0.083e-3, 1.5 * 0.271e-3)
    report.calls[0].forward_host_seconds = 0.07e-3
    [flag] = _raised(rules, [report])
    assert flag.value == pytest.approx(1.5 * 0.271 / 0.083)
    assert rules.host_bound_calls == 1


def test_a_backward_turning_slow_under_an_open_info_episode_raises_a_warning_on_its_second_step():
    # A healthy cuDNN job on an H200 reads 3.3x, within the band: an info episode that never
    # ends. Its backward turning 1.5x slow (5x) must raise the warning the alert fires on, at
    # the second such step (one step's outlier is judged with the site's recent steps); back to
    # healthy, the warning clears after CLEAR_AFTER calm steps and the info episode is open again.
    from prometheus_client import CollectorRegistry

    from fadiag.export.prometheus import Metrics

    rules = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0})
    registry = CollectorRegistry()
    metrics = Metrics(rank=0, registry=registry)

    def step(i, ratio):
        out = rules.evaluate(_report(i, 0.6e-3, impl="cudnn", n=2048, ratio=ratio, device="cuda",
                                     dtype="bfloat16"))
        for f in out:
            metrics.flag(f)
        return [(f.severity, f.cleared) for f in out]

    def active(severity):
        return registry.get_sample_value("fadiag_flag_active", {
            "rank": "0", "rule": "backward_forward_ratio", "severity": severity})

    assert step(1, 3.3) == [("info", False)]
    assert [step(i, 3.3) for i in (2, 3, 4)] == [[], [], []]
    assert step(5, 5.0) == []  # one slow step: the site's median is still 3.3x
    assert step(6, 5.0) == [("warning", False)]
    assert (active("warning"), active("info")) == (1.0, 0.0)
    assert [step(i, 5.0) for i in (7, 8)] == [[], []]  # one episode, not a flag a step
    # Healthy again: the median is back from step 10, and the warning ends CLEAR_AFTER steps
    # later; then info is open again.
    assert [step(i, 3.3) for i in (9, 10, 11)] == [[], [], []]
    assert step(12, 3.3) == [("warning", True), ("info", False)]
    assert (active("warning"), active("info")) == (0.0, 1.0)
    # A backward slow every other step is slow in two of three: a warning, and one episode.
    assert [step(13, 5.0), step(14, 3.3)] == [[], []]
    assert step(15, 5.0) == [("warning", False)]
    assert [step(16, 3.3), step(17, 5.0), step(18, 3.3), step(19, 5.0)] == [[], [], [], []]


def test_low_savings_a_short_sequence_explains_is_info_and_a_math_fallback_a_warning():
    # Flash at Sk=32 with head dim 64 keeps its output, a large share of standard attention's
    # memory at that length: the message says "expected, not a fault", so the flag says info.
    def low(impl):  # savings 60 %
        report = _report(1, 1e-3, impl=impl, n=32, device="cuda", dtype="bfloat16")
        report.calls[0].shape = (1, 2, 32, 32, 64)
        report.calls[0].kept_bytes = report.kept_bytes = 4_000
        return report

    [flag] = _rules(device="NVIDIA H200").evaluate(low("flash"))
    assert flag.rule == "memory_savings" and flag.severity == "info"
    assert "expected, not a fault" in flag.message
    [flag] = _rules(device="NVIDIA H200").evaluate(low("math"))
    assert flag.severity == "warning" and "math path" in flag.message


def test_the_state_kept_per_shape_is_bounded_as_shapes_change(monkeypatch):
    """A padded batch's length changes the shape step to step: each new (site, impl, shape) key
    would keep its recent ratios, and each new set of a step's shapes its rolling-baseline window,
    for good; the rules keep at most keyed.KEYS of each, the oldest out."""
    from fadiag.rules import keyed

    monkeypatch.setattr(keyed, "KEYS", 8)
    device = _rules(device="NVIDIA H200", backward_forward_ratio={"warmup_steps": 0},
                    regression={"warmup_steps": 0, "window": 2})
    host = _rules(backward_forward_ratio={"warmup_steps": 0})
    for i in range(1, 41):
        for _ in range(2):  # each shape twice: its baseline window fills and freezes
            device.evaluate(_report(i, 0.01, impl="cudnn", n=1000 + i, ratio=2.0, device="cuda",
                                    dtype="bfloat16"))
        device.evaluate(_report(i, 0.01, impl="cudnn", n=5000 + i, ratio=2.0, device="cuda",
                                dtype="bfloat16"))  # and one that never fills its window
        host.evaluate(_report(i, 0.01, n=1000 + i, ratio=2.0))
    newest = (1, 2, 1040, 1040, 32)
    for kept, impl in ((device._device, "cudnn"), (host._host, "cpu_flash")):
        assert len(kept) <= 8 and ("m.py:1#0", impl, newest) in kept  # the oldest went first
        assert ("m.py:1#0", impl, (1, 2, 1001, 1001, 32)) not in kept
    regression = device.regression
    for kept in (regression._frozen, regression._warm):
        assert 0 < len(kept) <= 8
    assert frozenset({("m.py:1#0", newest, "bfloat16")}) in regression._frozen
    assert frozenset({("m.py:1#0", (1, 2, 5040, 5040, 32), "bfloat16")}) in regression._warm
