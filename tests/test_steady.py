"""Steady steps counted in C++ (fadiag/steps/steady.py): the same sums Python's rows make.

With sampling.reports_per_second set, a step shaped like the last one Python resolved, whose calls
are the same calls, is counted by the dispatcher tap's C++ with no Python per call. What it adds
to the metrics must be exactly what Python's path adds for the same marks.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

import fadiag
from fadiag.export.prometheus import Metrics
from fadiag.steps import resolver as resolver_module
from fadiag.steps import steady as steady_module
from fadiag.steps.counting import finite_seconds
from fadiag.steps.records import windows_host_bound
from tests.models import GPT, train
from tests.native_marks import NEEDS_TAP

pytestmark = NEEDS_TAP

RATE = {"exporter.enabled": False, "sampling.reports_per_second": 1e-6, "tap": "on"}


@pytest.fixture(autouse=True)
def one_pass(monkeypatch):
    """The resolver looks only when flush() asks: every step is pending at that one pass, so the
    newest step handed over (always reported) is the last, however slow the machine."""
    monkeypatch.setattr(resolver_module, "_BATCH_S", 300.0)


def _samples(metrics: Metrics) -> dict:
    registry = CollectorRegistry()
    registry.register(metrics)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


def _expected_rows(steady, batch, learned) -> list:
    """The rows Python's path makes of `batch`'s records (read before C++ gives the marks back):
    the marks read by the timer's own `seconds`, named by the keys of `learned` (its kind's)."""
    linked, compiled = batch.links(), batch.rows()
    assert not (linked and compiled)  # one kind a step in these models: records stay in order
    quads = [(r[1], r[2], r[3], r[4]) for r in linked or compiled]
    timer = steady.tap.timers["cpu"]
    rows = []
    for i, (f, b, fi, bi) in enumerate(timer.seconds(quads, False)):
        f, b = finite_seconds(f), finite_seconds(b)
        impl, site = steady._names[learned.record_keys[i]]
        rows.append((impl, site, f, b, learned.recompute[i],
                     windows_host_bound(f, b, fi * 1e-9, bi * 1e-9)))
    return rows


@pytest.mark.parametrize("compiled,checkpointing", [(False, None), (True, None),
                                                   (True, "non_reentrant")],
                         ids=["eager", "compiled", "compiled_checkpointed"])
@pytest.mark.parametrize("per_site", [False, True], ids=["per_impl", "per_site"])
def test_a_steady_step_counted_in_cpp_adds_exactly_what_pythons_rows_add(
        monkeypatch, compiled, checkpointing, per_site):
    by_python, by_cpp = Metrics(per_site=per_site), Metrics(per_site=per_site)
    original = steady_module.SteadySteps.count
    counted, recomputed = [], []

    def count(self, step, give_up):
        batch, learned = step.tap_batch, self.learned(bool(step.calls))
        expected = _expected_rows(self, batch, learned) if learned is not None and batch else None
        done = original(self, step, give_up)
        if done == 1:
            assert expected is not None
            by_python.count(expected)
            by_cpp.merge(*self.take())  # this step's sums alone
            counted.append(step.index)
            recomputed.append(any(learned.recompute))
        return done

    run_original = steady_module.SteadySteps.count_run

    def count_run(self, steps, give_up):  # steps in a row, counted in one C++ call
        learned = self.learned(False)
        expected = [_expected_rows(self, s.tap_batch, learned) for s in steps]
        done, why = run_original(self, steps, give_up)
        for step, rows in zip(steps[:done], expected, strict=False):
            by_python.count(rows)
            counted.append(step.index)
            recomputed.append(any(learned.recompute))
        if done:
            by_cpp.merge(*self.take())  # the run's sums
        return done, why

    monkeypatch.setattr(steady_module.SteadySteps, "count", count)
    monkeypatch.setattr(steady_module.SteadySteps, "count_run", count_run)
    torch._dynamo.reset()
    session = fadiag.attach(**RATE)
    try:
        torch.manual_seed(0)
        model = GPT(layers=2, dim=32, heads=2, checkpointing=checkpointing)
        train(torch.compile(model) if compiled else model, steps=12, seq=32)
        assert session.flush(30)
    finally:
        fadiag.detach()
    # Not the first step (reported: the rate's first), nor the newest (always reported). Eager,
    # not the second either: the first learned the signatures (Python's probe), so the shape is
    # learned from the second; compiled calls learn nothing in Python, the first is steady.
    assert counted == list(range(2 if compiled else 3, 12))
    a, b = _samples(by_python), _samples(by_cpp)
    # Every bucket and counter exactly; the sums to rounding, since C++ adds a step's seconds
    # before they join the running sum, where Python adds each call's to it in turn.
    sums = {k for k in a if k[0].endswith("_sum")}
    assert a.keys() == b.keys() and sums
    assert {k: v for k, v in a.items() if k not in sums} == {
        k: v for k, v in b.items() if k not in sums}
    assert {k: b[k] for k in sums} == pytest.approx({k: a[k] for k in sums}, rel=1e-12, abs=0)
    calls = ("fadiag_attention_calls_total", (("impl", "cpu_flash"), ("rank", "0")))
    assert b[calls] == 2 * len(counted)
    if checkpointing:  # each layer's forward recomputed in the backward: timed, not a call
        assert all(recomputed)


def test_every_step_is_in_the_metrics_whichever_path_counted_it(monkeypatch):
    # Steps of a second shape (a longer sequence: new signatures, learned and reported) between
    # steady ones: each is counted once, by C++ or by Python, and the shape is learned again.
    by_python = []
    count = Metrics.count
    monkeypatch.setattr(Metrics, "count", lambda self, rows: (by_python.append(rows),
                                                              count(self, rows)))
    session = fadiag.attach(**RATE)
    try:
        torch.manual_seed(0)
        model = GPT(layers=2, dim=32, heads=2)
        train(model, steps=8, seq=32)
        train(model, steps=8, seq=48)
        train(model, steps=8, seq=32)
        assert session.flush(30)
        steady = session.resolver._steady
        samples = _samples(session.metrics)
        reported = session.history()
    finally:
        fadiag.detach()
    rank = (("rank", "0"),)
    impl = (("impl", "cpu_flash"), ("rank", "0"))
    assert samples[("fadiag_steps_total", rank)] == 24
    assert samples[("fadiag_steps_unreported_total", rank)] == 24 - len(reported)
    assert samples[("fadiag_attention_calls_total", impl)] == 48
    assert samples[("fadiag_attention_backward_seconds_count", impl)] == 48
    assert samples[("fadiag_step_attention_seconds_count", rank)] == 24
    assert sum(1 + r.counted_before for r in reported) == 24
    # Reported: the first step, the first of the longer sequence (new signatures) and the
    # newest. Python counts the step the shape is learned from; the longer sequence's steps have
    # the same calls (impl, site) and are counted in C++ with the rest: no step twice, none left.
    assert [r.step for r in reported] == [1, 9, 24]
    assert steady is not None and len(by_python) == 1 and steady.counted == 20
    assert session.devices.timer("cpu").marks_in_use() == 0


def test_no_rate_reports_every_step_and_counts_none_in_cpp():
    session = fadiag.attach(**{**RATE, "sampling.reports_per_second": 0})
    try:
        train(GPT(layers=2, dim=32, heads=2), steps=6, seq=32)
        assert session.flush(30)
        assert [r.step for r in session.history()] == [1, 2, 3, 4, 5, 6]
        assert session.resolver._steady is None
    finally:
        fadiag.detach()


def test_steady_steps_in_a_row_are_counted_in_one_cpp_call_up_to_a_new_shape(monkeypatch):
    # Compiled steps pending together: counted as runs, one C++ call each. A model with one layer
    # more (a new shape) stops the run at its first step, which Python resolves and learns from;
    # the next run counts the rest. Every step is in the metrics once.
    runs = []
    original = steady_module.SteadySteps.count_run

    def count_run(self, steps, give_up):
        done, why = original(self, steps, give_up)
        runs.append(([s.index for s in steps], done, why))
        return done, why

    monkeypatch.setattr(steady_module.SteadySteps, "count_run", count_run)
    torch._dynamo.reset()
    session = fadiag.attach(**RATE)
    try:
        torch.manual_seed(0)
        train(torch.compile(GPT(layers=2, dim=32, heads=2)), steps=6, seq=32)
        train(torch.compile(GPT(layers=3, dim=32, heads=2)), steps=6, seq=32)
        assert session.flush(30)
        samples = _samples(session.metrics)
        reported = [r.step for r in session.history()]
        counted_in_runs = session.resolver._steady.counted
    finally:
        fadiag.detach()
    # Step 1 reported (the rate's first); 2-6 one run, stopped by step 7's shape (Python's);
    # 8-11 the next run; 12, the newest, reported.
    assert runs[0] == ([2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 5, -1)
    assert ([8, 9, 10, 11], 4, 1) in runs
    assert reported == [1, 12] and counted_in_runs == 9
    rank = (("rank", "0"),)
    assert samples[("fadiag_steps_total", rank)] == 12
    assert samples[("fadiag_steps_unreported_total", rank)] == 10
    assert samples[("fadiag_attention_calls_total", (("impl", "cpu_flash"), ("rank", "0")))] == 30
    assert session.devices.timer("cpu").marks_in_use() == 0


def test_a_step_that_verifies_the_order_is_resolved_in_python_and_the_bypassed_after_it_counted(
        monkeypatch):
    # Bypassed eager steps (steps/bypass.py) with a step the wrapper measures every fifth: that
    # step verifies the order in Python, and leaves the bypassed steps' learned shape as it was,
    # so the bypassed step after it is counted in C++ (or reported, where it was the newest at a
    # pass of the resolver), not resolved in Python to learn that shape again.
    in_cpp, verifying = [], []
    count_run = steady_module.SteadySteps.count_run
    try_resolve = resolver_module.Resolver._try_resolve

    count_quiet = steady_module.SteadySteps.count_quiet

    def counting_run(self, steps, give_up):
        done, why = count_run(self, steps, give_up)
        in_cpp.extend(s.index for s in steps[:done])
        return done, why

    def counting_quiet(self, run, n, grace_s):  # steps closed in C++, handed over as a run
        first = run.first
        done, why = count_quiet(self, run, n, grace_s)
        in_cpp.extend(range(first, first + done))
        return done, why

    def resolving(self, step):
        verifies = step.verifies
        resolved = try_resolve(self, step)
        if verifies and resolved:
            verifying.append(step.index)
        return resolved

    monkeypatch.setattr(steady_module.SteadySteps, "count_run", counting_run)
    monkeypatch.setattr(steady_module.SteadySteps, "count_quiet", counting_quiet)
    monkeypatch.setattr(resolver_module.Resolver, "_try_resolve", resolving)
    session = fadiag.attach(**RATE, **{"steps.verify_every": 5})
    try:
        torch.manual_seed(0)
        model = GPT(layers=2, dim=32, heads=2)
        for seed in range(3):  # the signatures, then the order, learned
            train(model, steps=1, seq=32, seed=seed)
            assert session.flush(30)
        train(model, steps=12, seq=32, seed=3)
        assert session.flush(30)
        reported = {r.step for r in session.history()}
        bypassed, order = session.recorder.bypass.steps, session.recorder.tap.order
    finally:
        fadiag.detach()
    # 4-7, 9-12 and 14-15 bypassed; 8 and 13 the wrapper's, each verifying the order.
    assert bypassed == 10 and verifying == [8, 13] and order.step == 13
    assert all(step in in_cpp or step in reported for step in (9, 14))
    assert not set(verifying) & set(in_cpp)
