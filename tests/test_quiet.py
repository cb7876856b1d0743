"""Steady bypassed steps closed in C++ at the optimizer's step (fadiag/steps/quiet.py).

The tap's QuietSteps hook closes a bypassed step that the Python boundary would close as one
matching its order with nothing else to do, and hands the steps over at the next Python boundary,
as one QuietRun. What reaches the resolver must be exactly what the Python boundary alone hands
it: the same steps, in order, each with its index, its order, its records; the same reports,
counts and metrics.
"""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadiag
from fadiag.steps import quiet
from fadiag.steps.boundary import ClosedStep
from fadiag.steps.quiet import QuietRun
from tests.metrics import call_rows, sample
from tests.models import GPT, train
from tests.native_marks import NEEDS_TAP

SEQ, BATCH, DIM, HEADS, LAYERS = 64, 2, 32, 2, 3
pytestmark = NEEDS_TAP


class Run:
    """A session attached with bypassing every `verify_every`-th step, whose closed steps are
    written down as the resolver receives them: index, bypassed, learns the order, verifies it,
    the wrapper's calls, the tap's records."""

    def __init__(self, verify_every: int):
        self.session = fadiag.attach(port=0, tap="on", **{"steps.verify_every": verify_every})
        self.handed: list[tuple] = []
        self.closed_in_cpp: list[int] = []  # the indices of the steps the hook closed
        submit = self.session.resolver.submit

        def written(step) -> None:
            if isinstance(step, QuietRun):  # each step as the ClosedStep QuietRun.split makes
                for i, records in enumerate(step.native.sizes()):
                    self.handed.append((step.first + i, step.order is not None, False, False, 0,
                                        records))
                    self.closed_in_cpp.append(step.first + i)
            else:
                batch = step.tap_batch
                self.handed.append((step.index, step.order is not None, step.learn_order,
                                    step.verifies, len(step.calls),
                                    0 if batch is None else len(batch)))
            submit(step)

        self.session.resolver.submit = written

    def train(self, model: torch.nn.Module, steps: int, seed: int,
              flush: bool = False) -> list[float]:
        losses = train(model, steps, seq=SEQ, batch=BATCH, seed=seed)
        if flush:
            assert self.session.flush(10)
        return losses

    def ended(self) -> dict:
        """Everything the two ways must agree on, after a flush."""
        s = self.session
        assert s.flush(10)
        rec = s.recorder
        return {"handed": self.handed, "rows": [call_rows(r) for r in s.history()],
                "indices": [r.step for r in s.history()], "bypassed": rec.bypass.steps,
                "unmeasured": rec.unmeasured_totals(),
                "flags": [f.rule for r in s.history() for f in r.flags],
                "steps_total": sample(s, "fadiag_steps_total")}


def _both(monkeypatch, body) -> tuple[dict, dict, list[int]]:
    """`body(run, model)` once with steps closed in C++ and once with the Python boundary alone
    (the hook never armed), from the same model: what each ends with, and the steps closed in
    C++."""
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    ended = {}
    closed: list[int] = []
    for way in ("quiet", "python"):
        with monkeypatch.context() as m:
            if way == "python":
                m.setattr(quiet.QuietSteps, "arm", lambda self, rec: None)
            run = Run(verify_every=6)
            losses = body(run, copy.deepcopy(model))
            ended[way] = {**run.ended(), "losses": losses}
            if way == "quiet":
                closed = run.closed_in_cpp
                assert len(closed) == run.session.recorder.quiet.closed
            else:
                assert run.closed_in_cpp == []
            fadiag.detach()
    return ended["quiet"], ended["python"], closed


def _learned(run: Run, model: torch.nn.Module) -> list[float]:
    """Three steps, each resolved before the next: the signatures learned at the first, the
    order at the second, so that the fourth and later are bypassed whatever the resolver's pace."""
    return [loss for i in range(3) for loss in run.train(model, 1, seed=i, flush=True)]


def _bypassed_before_bypassed(handed: list[tuple]) -> list[int]:
    """The bypassed steps whose next step is bypassed too: those the hook may close."""
    return [a[0] for a, b in zip(handed, handed[1:], strict=False) if a[1] and b[1]]


def test_steady_bypassed_steps_close_in_cpp_and_reach_the_resolver_as_pythons(monkeypatch):
    # Runs as long as the test lasts: the CPU steps' cap (a CPU wait read each 20 ms) lifted, so
    # that which steps close in C++ is decided by the verify cadence alone.
    monkeypatch.setattr(quiet, "_CAP_HOST_S", 60.0)

    def body(run: Run, model: torch.nn.Module) -> list[float]:
        losses = _learned(run, model)
        return losses + run.train(model, 24, seed=3)  # one optimizer, no Python boundary between

    with_cpp, python, closed = _both(monkeypatch, body)
    assert with_cpp == python
    assert with_cpp["indices"] == list(range(1, 28)) and with_cpp["steps_total"] == 27
    # Steps 4-8, 10-14, 16-20 and 22-26 bypassed; 9, 15, 21 and 27 verify the order.
    assert python["bypassed"] == 20 and not python["flags"]
    # Every bypassed step that opens another bypassed one is closed in C++, but step 4, whose
    # hook the flush before it disarmed; the one before each verifying step, and the verifying
    # (wrapper's) steps, by Python.
    assert closed == [i for i in _bypassed_before_bypassed(python["handed"]) if i != 4]
    assert closed == [5, 6, 7, 10, 11, 12, 13, 16, 17, 18, 19, 22, 23, 24, 25]


def test_a_step_the_hook_cannot_close_goes_to_python_and_the_steps_before_it_first(monkeypatch):
    # The math path in one step: SDPA's calls pass the builtin with no fused op for the tap, so
    # the builtins' calls are not the tap's records; that step is Python's (untapped, a miss).
    def body(run: Run, model: torch.nn.Module) -> list[float]:
        losses = _learned(run, model)
        losses += run.train(model, 9, seed=3)
        with sdpa_kernel([SDPBackend.MATH]):
            losses += run.train(model, 1, seed=12, flush=True)
        # The order is learned again from a step the wrapper measures, at the resolver's pace:
        # each step resolved before the next until it is, so both ways bypass the same steps.
        losses += [loss for i in range(2) for loss in run.train(model, 1, seed=13 + i, flush=True)]
        return losses + run.train(model, 8, seed=15)

    with_cpp, python, closed = _both(monkeypatch, body)
    assert with_cpp == python
    assert with_cpp["unmeasured"]["untapped"] == LAYERS
    assert with_cpp["indices"] == list(range(1, 24))
    math_step = 13
    assert closed and math_step not in closed
    assert set(closed) <= set(_bypassed_before_bypassed(python["handed"]))


def _bypassing(learning: int = 3, **config) -> tuple[fadiag.Session, torch.nn.Module,
                                                     torch.optim.Optimizer]:
    """A session (`config` beside the defaults) whose next steps are bypassed (as `_learned`:
    `learning` steps, each resolved before the next), with its model and optimizer."""
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    s = fadiag.attach(port=0, tap="on", **{"steps.verify_every": 100, **config})
    for i in range(learning):
        train(model, 1, seq=SEQ, batch=BATCH, seed=i)
        assert s.flush(10)
    return s, model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_a_flush_or_a_detach_hands_over_the_steps_closed_in_cpp(monkeypatch):
    monkeypatch.setattr(quiet, "_CAP_HOST_S", 60.0)
    s, model, opt = _bypassing()
    for i in range(6):
        train_one(model, opt, seed=i)
    native = s.recorder.quiet.native
    assert native.armed() and s.recorder.quiet.closed == 5  # the first closed by Python
    assert s.flush(10)  # a manual boundary: the five first, then its own (no step)
    assert [r.step for r in s.history()] == list(range(1, 10))
    for i in range(4):
        train_one(model, opt, seed=10 + i)
    assert s.recorder.quiet.closed == 8
    fadiag.detach()
    assert [r.step for r in s.history()] == list(range(1, 14))
    assert sample(s, "fadiag_steps_total") == 13
    assert all(len(r.calls) == LAYERS for r in s.history())


def train_one(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (BATCH, SEQ), generator=gen)
    torch.nn.functional.cross_entropy(model(tokens).view(-1, 64), tokens.view(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_an_error_in_the_hook_never_reaches_the_optimizer_and_is_counted_once(caplog):
    s, model, opt = _bypassing()
    train_one(model, opt, seed=0)  # closed by Python, which arms the hook
    rec = s.recorder
    assert rec.quiet.native.armed()
    # Not an int: the hook cannot read it (the Python boundary can), so the step is Python's.
    rec.calls_since_boundary = 0.0
    with caplog.at_level(logging.WARNING, logger="fadiag"):
        for i in range(1, 5):
            train_one(model, opt, seed=i)
    assert rec.quiet.native.errors() == 1
    assert sample(s, "fadiag_internal_errors_total") == 1
    assert sum("recorder.quiet" in r.getMessage() for r in caplog.records) == 1
    assert s.flush(10)
    assert [r.step for r in s.history()] == list(range(1, 9))
    assert all(len(r.calls) == LAYERS for r in s.history())


def test_with_a_report_rate_the_steps_closed_in_cpp_reach_the_metrics_counted_in_cpp(monkeypatch):
    """sampling.reports_per_second: the steps the hook closes are counted by the tap's C++ tally
    (steps/steady.py) like the Python boundary's, every call of every step in the metrics."""
    monkeypatch.setattr(quiet, "_CAP_HOST_S", 60.0)
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    s = fadiag.attach(port=0, tap="on", **{"steps.verify_every": 6,
                                          "sampling.reports_per_second": 1e-6})
    for i in range(3):
        train(model, 1, seq=SEQ, batch=BATCH, seed=i)
        assert s.flush(10)
    train(model, 24, seq=SEQ, batch=BATCH, seed=3)
    assert s.flush(10)
    reported = len(s.history())
    assert s.recorder.quiet.closed == 15  # as in the test above: 5-7, 10-13, 16-19, 22-25
    assert sample(s, "fadiag_steps_total") == 27
    assert sample(s, "fadiag_steps_unreported_total") == 27 - reported >= 15
    assert sample(s, "fadiag_attention_calls_total", impl="cpu_flash") == 27 * LAYERS
    assert sample(s, "fadiag_attention_backward_seconds_count", impl="cpu_flash") == 27 * LAYERS
    assert s.resolver._steady.counted >= 15


def _held_run(monkeypatch, steps: int) -> tuple[fadiag.Session, list]:
    """A bypassing session with a report rate, whose resolver thread is stopped once the bypassed
    step's shape is learned: `steps` more optimizer steps (the first closed by Python, the others
    in C++) and a flush, their closed steps left for the test to resolve on its own thread
    (`Resolver._resolve_pending`)."""
    monkeypatch.setattr(quiet, "_CAP_HOST_S", 60.0)
    # Signatures, the order, then a bypassed step resolved (its shape learned).
    s, model, opt = _bypassing(4, **{"sampling.reports_per_second": 1e-6})
    assert s.resolver._steady.learned(False) is not None
    s.resolver.stop()
    for i in range(steps):
        train_one(model, opt, seed=10 + i)
    s.flush(0)  # a manual boundary: the run handed over; no resolver waits
    pending = s.resolver._pending
    while not s.resolver._queue.empty():
        pending.append(s.resolver._queue.get_nowait())
    return s, [p for p in pending if not isinstance(p, threading.Event)]


def test_a_run_is_counted_in_cpp_whole_and_only_its_newest_step_made_a_closed_step(monkeypatch):
    s, handed = _held_run(monkeypatch, steps=10)
    assert [type(h) for h in handed] == [ClosedStep, QuietRun] and len(handed[1]) == 9
    first, last = handed[0].index, handed[1].first + 8
    split: list[tuple] = []
    real_split = QuietRun.split

    def splitting(run: QuietRun) -> ClosedStep:
        c = real_split(run)
        split.append((c.index, c.order, c.learn_order, c.verifies, list(c.calls),
                      len(c.tap_batch), c.closed, c.wall_time))
        return c

    monkeypatch.setattr(QuietRun, "split", splitting)
    order, closed = handed[1].order, handed[1].closed()
    counted = s.resolver._steady.counted
    reports = len(s.history())
    s.resolver._resolve_pending()
    assert not s.resolver._pending
    # The Python boundary's step and the run's first eight counted in C++; the newest, the run's
    # last, made a ClosedStep and reported, counting the nine before it.
    assert s.resolver._steady.counted - counted == 9
    # The ClosedStep the Python boundary would have made of it: its index, order, cut, times.
    assert [c[:6] for c in split] == [(last, order, False, False, [], LAYERS)]
    assert split[0][6] == closed[-1] and handed[0].wall_time < split[0][7]
    assert [r.step for r in s.history()[reports:]] == [last]
    assert s.history()[-1].counted_before == 9 and len(s.history()[-1].calls) == LAYERS
    assert last == first + 9
    assert s.devices.timer("cpu").marks_in_use() == 0
    fadiag.detach()
    assert sample(s, "fadiag_steps_total") == last
    assert sample(s, "fadiag_attention_calls_total", impl="cpu_flash") == last * LAYERS


def test_a_run_the_resolver_cannot_resolve_loses_its_first_step_alone(monkeypatch):
    s, handed = _held_run(monkeypatch, steps=6)
    run = handed[1]
    first, last = run.first, run.first + len(run) - 1
    reports = len(s.history())
    real = s.resolver._quiet_head
    failed = []

    def once(r):
        if not failed:
            failed.append(r.first)
            raise RuntimeError("resolver bug")
        return real(r)

    monkeypatch.setattr(s.resolver, "_quiet_head", once)
    with pytest.raises(RuntimeError):
        s.resolver._resolve_pending()
    s.resolver._drop_head()  # as the resolver's loop does after an error
    assert failed == [first] and s.resolver._pending[0] is run and run.first == first + 1
    s.resolver._resolve_pending()
    assert not s.resolver._pending
    assert [r.step for r in s.history()[reports:]] == [last]
    assert s.devices.timer("cpu").marks_in_use() == 0  # the dropped step's marks came back too
    fadiag.detach()
