"""sampling.reports_per_second: every call timed and counted, a step report for N steps a second."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

import fadiag
from fadiag import ConfigError
from fadiag.export.prometheus import Metrics
from fadiag.steps.counting import ReportRate
from fadiag.steps.records import CallRecord, StepReport
from tests.models import GPT, train


def test_steady_steps_are_reported_at_the_rate_on_the_training_clock():
    # Steps 30 ms apart at 10 reports a second: the first, then the first closed 0.1 s or more
    # after the last reported one (here every fourth), whenever the resolver gets to them.
    rate = ReportRate(10.0)
    counted, before = [], []
    for i in range(9):
        counted.append(rate.counted_only(100.0 + 0.03 * i, steady=True))
        if not counted[-1]:
            before.append(rate.reported())  # each report: the steps counted since the last
    assert counted == [False, True, True, True, False, True, True, True, False]
    assert before == [0, 3, 3]


def test_a_step_that_learned_or_left_calls_unmeasured_is_always_reported():
    rate = ReportRate(10.0)
    assert not rate.counted_only(100.0, steady=True)
    assert not rate.counted_only(100.01, steady=False)
    # ... and the rate counts from it.
    assert rate.counted_only(100.02, steady=True)
    assert not rate.counted_only(100.11, steady=True)


def test_zero_reports_every_step():
    rate = ReportRate(0.0)
    assert not any(rate.counted_only(100.0 + 1e-3 * i, steady=True) for i in range(5))
    assert rate.reported() == 0


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


@pytest.mark.parametrize("per_site", [False, True])
def test_a_counted_step_moves_the_metrics_as_its_report_would(per_site):
    calls = [
        CallRecord("a.py:1#0", "cpu_flash", (2, 2, 64, 64, 32), "float32", True,
                   forward_seconds=1e-3, backward_seconds=3e-3),
        CallRecord("a.py:2#0", "cpu_flash", (2, 2, 64, 64, 32), "float32", True,
                   forward_seconds=2e-3, backward_seconds=5e-3, forward_host_seconds=1e-3),
        CallRecord("a.py:1#0", "cpu_flash", (2, 2, 64, 64, 32), "float32", True,
                   forward_seconds=1e-3, backward_seconds=0.0, recompute=True),
        CallRecord("a.py:3#0", "math", (2, 2, 64, 64, 32), "float32", True,
                   forward_seconds=4e-3, backward_seconds=0.0, backward_host_seconds=1e-3),
    ]
    fwd = sum(c.forward_seconds for c in calls if not c.recompute)
    report = StepReport(step=1, forward_seconds=fwd,
                        backward_seconds=sum(c.backward_seconds for c in calls),
                        kept_bytes=None, standard_bytes=0, peak_bytes=None, calls=calls)
    reported, counted = CollectorRegistry(), CollectorRegistry()
    Metrics(registry=reported, per_site=per_site).emit(report)
    m = Metrics(registry=counted, per_site=per_site)
    m.count([(c.impl, c.site, c.forward_seconds, c.backward_seconds, c.recompute, c.host_bound)
             for c in calls])
    a, b = _samples(reported), _samples(counted)
    unreported = ("fadiag_steps_unreported_total", (("rank", "0"),))
    assert a.pop(unreported) == 0 and b.pop(unreported) == 1
    # Every series the count moves reads as the report's; the report's alone are the last-step
    # gauges, which a metrics object with nothing emitted does not show either.
    fresh = CollectorRegistry()
    Metrics(registry=fresh, per_site=per_site)
    last_step = a.keys() - b.keys()
    assert last_step and not last_step & _samples(fresh).keys() and b.keys() <= a.keys()
    assert {k: a[k] for k in b} == b
    assert m.counts() == (1, 3, 2)


def test_a_job_reports_its_first_and_newest_steps_and_counts_the_steps_between():
    # A rate this low reports the step that learned the signatures and, at each pass of the
    # resolver, the newest step handed over (one pass here, or a few on a slow machine); every
    # other step is counted, and each report says how many were counted before it.
    s = fadiag.attach(**{"exporter.enabled": False, "sampling.reports_per_second": 1e-6})
    train(GPT(layers=2, dim=32, heads=2), steps=12, seq=32)
    assert s.flush(10)
    reported = s.history()
    assert reported[0].step == 1 and reported[0].calls[0].probe
    assert s.last_step() is reported[-1] and reported[-1].step == 12
    assert sum(1 + r.counted_before for r in reported) == 12 and len(reported) < 12
    registry = CollectorRegistry()
    registry.register(s.metrics)
    value = registry.get_sample_value
    assert value("fadiag_steps_total", {"rank": "0"}) == 12
    assert value("fadiag_steps_unreported_total", {"rank": "0"}) == 12 - len(reported)
    assert value("fadiag_attention_calls_total", {"rank": "0", "impl": "cpu_flash"}) == 24
    for what in ("forward", "backward"):
        labels = {"rank": "0", "impl": "cpu_flash"}
        assert value(f"fadiag_attention_{what}_seconds_count", labels) == 24
        assert value(f"fadiag_attention_{what}_seconds_sum", labels) > 0
    assert value("fadiag_step_attention_seconds_count", {"rank": "0"}) == 12


def test_a_negative_rate_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"sampling\.reports_per_second must be a number >= 0"):
        fadiag.attach(**{"exporter.enabled": False, "sampling.reports_per_second": -1})


def test_a_runs_log_accounts_for_every_counted_step(tmp_path):
    # Each report says how many steps were counted since the one before, and the newest step is
    # always reported, so a run's JSONL (and `fadiag report` on it) accounts for every step.
    from fadiag.cli.report.summary import format_summary, summarize
    from fadiag.export.jsonl import read_run

    fadiag.attach(**{"exporter.enabled": False, "sampling.reports_per_second": 1e-6,
                     "jsonl.path": str(tmp_path)})
    train(GPT(layers=2, dim=32, heads=2), steps=7, seq=32)
    fadiag.detach()
    run = read_run(next(tmp_path.glob("fadiag-rank0.jsonl")))
    steps = [r.step for r in run.steps]
    assert steps[0] == 1 and steps[-1] == 7
    assert sum(1 + r.counted_before for r in run.steps) == 7
    summary = summarize(run.steps)
    n = len(steps)
    assert summary.steps == n and summary.counted_steps == 7 - n > 0
    assert format_summary(summary).startswith(
        f"rank 0: {n} steps (1..7); {7 - n} more counted in the metrics without a report "
        "(sampling.reports_per_second)")
