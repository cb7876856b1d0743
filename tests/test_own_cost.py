"""fadiag's own cost: said once, where the job is host-bound and the resolver busy."""

from __future__ import annotations

import logging

import pytest

import fadiag
from fadiag.steps import own_cost
from fadiag.steps.own_cost import OwnCost, Totals


def _window(own: OwnCost, *, share: float, host_bound: float, steps: int = 1000,
            wall: float = own_cost.WINDOW_S, calls_per_step: int = 6, at: float = 0.0,
            cpu: float = 0.0, done: int = 0) -> str | None:
    """Two ticks `wall` apart: the resolver used `share` of it in CPU over `steps` steps."""
    calls = done * calls_per_step
    own.update(Totals(at, cpu, done, calls, int(calls * host_bound)))
    calls += steps * calls_per_step
    return own.update(Totals(at + wall, cpu + share * wall, done + steps, calls,
                             int(calls * host_bound)))


def test_a_busy_resolver_on_a_host_bound_job_is_said_once_with_its_figures_and_a_setting():
    own = OwnCost()
    hint = _window(own, share=0.015, host_bound=0.9, steps=1100)
    assert hint is not None
    assert "host-bound" in hint and "90%" in hint and "1.5%" in hint
    assert f"{0.015 * own_cost.WINDOW_S / 1100 * 1e6:.0f} µs a step" in hint
    assert "sampling.every_n_steps: 15" in hint  # 1.5 % / 15 = 0.1 %
    assert own.said
    assert _window(own, share=0.05, host_bound=1.0, at=100.0, cpu=1.0, done=5000) is None


def test_the_hint_offers_fewer_reports_before_sampling():
    hint = _window(OwnCost(), share=0.02, host_bound=0.9, steps=1100)
    assert hint is not None and "sampling.reports_per_second: 10" in hint
    assert "sampling.every_n_steps: 20" in hint
    # Already reporting fewer steps: the sampling period alone.
    hint = _window(OwnCost(reports_per_second=10), share=0.02, host_bound=0.9, steps=1100)
    assert hint is not None and "reports_per_second" not in hint


def test_a_sampled_job_is_told_a_period_that_many_times_longer():
    hint = _window(OwnCost(every_n_steps=4), share=0.02, host_bound=0.8)
    assert hint is not None and "sampling.every_n_steps: 80" in hint


@pytest.mark.parametrize(("share", "host_bound"), [
    (0.005, 1.0),   # host-bound, but the resolver is quiet
    (0.05, 0.2),    # a busy resolver beside a device that does not wait for the host: hidden
    (0.05, 0.0),    # CPU runs: no window is host-bound there
])
def test_nothing_is_said_where_it_costs_the_step_little_or_nothing(share, host_bound):
    own = OwnCost()
    assert _window(own, share=share, host_bound=host_bound) is None
    assert not own.said


def test_a_window_is_judged_only_once_it_spans_its_seconds_and_steps():
    own = OwnCost()
    assert _window(own, share=0.05, host_bound=1.0, wall=own_cost.WINDOW_S / 2) is None
    own = OwnCost()
    assert _window(own, share=0.05, host_bound=1.0, steps=own_cost.MIN_STEPS - 1) is None
    # The same start, a later tick: the window now spans enough.
    later = Totals(own_cost.WINDOW_S * 2, 1.0, own_cost.MIN_STEPS * 3, 6 * own_cost.MIN_STEPS * 3,
                   6 * own_cost.MIN_STEPS * 3)
    assert own.update(later) is not None


def test_counters_that_start_again_start_a_new_window():
    own = OwnCost()
    own.update(Totals(0.0, 5.0, 10_000, 60_000, 60_000))
    # A new session's counters (lower than the last tick's): no share from the difference.
    assert own.update(Totals(20.0, 0.1, 10, 60, 60)) is None
    assert own.update(Totals(40.0, 0.1 + 0.5, 10 + 2000, 60 + 12_000, 60 + 12_000)) is not None


def test_the_session_logs_the_hint_from_its_tick_once(caplog, monkeypatch):
    session = fadiag.attach(port=0)
    fadiag.detach()  # the resolver thread stopped: only these ticks feed the judgement
    counts = iter([(0, 0, 0), (2000, 12_000, 11_000), (4000, 24_000, 22_000)])
    monkeypatch.setattr(session.metrics, "counts", lambda: next(counts))
    monkeypatch.setattr(own_cost, "WINDOW_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="fadiag"):
        for cpu in (0.0, 1e3, 2e3):  # far more CPU than any wall time between the ticks
            session.resolver.cpu_seconds = cpu
            session._on_tick(0.0)
    hints = [r.getMessage() for r in caplog.records if "resolver thread used" in r.getMessage()]
    assert len(hints) == 1
    assert "the device waited for the host in 92%" in hints[0]
