"""Bypassed eager steps: SDPA's calls run no fadiag Python, the tap times them, named by order.

Once the wrapper has measured a step whose calls the dispatcher tap all timed, later steps that
an optimizer ends are bypassed: SDPA's eager builtin counts each call and calls the original, and
the resolver names each tapped call by its place in the learned order (capture/order.py,
steps/bypass.py). Every `steps.verify_every`-th step the wrapper measures again. A bypassed step
must report what the wrapper would have reported, and whatever does not match the order must be
counted and named as unknown, never given another call's site.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadiag
from tests.metrics import call_rows, sample
from tests.models import GPT, train
from tests.native_marks import NEEDS_TAP

SEQ, BATCH, DIM, HEADS, LAYERS = 64, 2, 32, 2, 3
pytestmark = NEEDS_TAP


@pytest.fixture(autouse=True)
def _detached():
    yield
    fadiag.detach()


def _attach(verify_every: int = 5, **overrides) -> fadiag.Session:
    return fadiag.attach(port=0, tap="on", **{"steps.verify_every": verify_every, **overrides})


def _steps(session: fadiag.Session | None, model: torch.nn.Module, n: int, first_seed: int = 0,
           seq: int = SEQ, micro_batches: int = 1) -> list[float]:
    """`n` optimizer steps, each flushed: each step's order is learned before the next boundary."""
    losses: list[float] = []
    for i in range(n):
        losses += train(model, 1, seq=seq, batch=BATCH, micro_batches=micro_batches,
                        seed=first_seed + i)
        if session is not None:
            assert session.flush(10)
    return losses



def test_steady_steps_are_bypassed_and_report_as_the_wrapper_measures_them():
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    plain = _steps(None, copy.deepcopy(model), 20)
    s = _attach(verify_every=5)
    losses = _steps(s, model, 20)
    assert losses == plain  # bit-identical: a bypassed call is the original's
    # Step 1 learns the signature (probe), step 2 the order, which steps from 4 on follow: four
    # bypassed, then one the wrapper measures (4-7, 9-12, 14-17, 19-20; 8, 13 and 18 check).
    assert s.recorder.bypass.steps == 14
    reports = s.history()
    assert len(reports) == 20 and sample(s, "fadiag_steps_total") == 20
    wrapper = reports[2]  # step 3: the wrapper's, linked calls
    assert [c.site for c in wrapper.calls] == [f"tests/models.py:24#{i}" for i in range(LAYERS)]
    for r in reports[1:]:
        assert call_rows(r) == call_rows(wrapper)
        assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in r.calls)
        assert not r.unmeasured
    assert all(v == 0 for v in s.recorder.unmeasured_totals().values())


def test_a_bypassed_call_runs_no_python_of_fadiag():
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    s = _attach(verify_every=1000)
    _steps(s, model, 4)
    assert s.recorder.bypass.order is not None  # the open step (5) is bypassed
    fadiag_frames: list[str] = []
    sdpa_calls = 0

    def profile(frame, event, arg):
        nonlocal sdpa_calls
        if event == "call" and "/fadiag/" in frame.f_code.co_filename:
            fadiag_frames.append(frame.f_code.co_name)
        elif event == "c_call" and getattr(arg, "__name__", "") == "scaled_dot_product_attention":
            sdpa_calls += 1

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 64, (BATCH, SEQ))
    sys.setprofile(profile)
    try:
        loss = F.cross_entropy(model(tokens).view(-1, 64), tokens.view(-1))
        loss.backward()
    finally:
        sys.setprofile(None)
    opt.step()
    assert s.flush(10)
    assert sdpa_calls == LAYERS and fadiag_frames == []
    last = s.history()[-1]
    assert [c.site for c in last.calls] == [f"tests/models.py:24#{i}" for i in range(LAYERS)]
    assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in last.calls)


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
def test_micro_batches_and_recomputation_are_named_as_the_wrapper_names_them(checkpointing):
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS, checkpointing=checkpointing)
    s = _attach(verify_every=6)
    _steps(s, model, 12, micro_batches=2)
    # A reentrant checkpoint runs its first forward without grad: the wrapper measures those
    # calls itself (no fused op timed by the tap), so no order is learned and none is bypassed.
    assert s.recorder.bypass.steps == (0 if checkpointing == "reentrant" else 8)  # 4-8, 10-12
    reports = s.history()
    wrapper = reports[2]  # step 3: measured by the wrapper, its calls linked
    recomputed = 2 * LAYERS if checkpointing else 0
    assert len(wrapper.calls) == 2 * LAYERS + recomputed
    assert sum(c.recompute for c in wrapper.calls) == recomputed
    for r in reports[2:]:
        assert call_rows(r) == call_rows(wrapper)
        summary = {site.site: site for site in r.sites()}
        assert len(summary) == LAYERS and all(site.calls == 2 for site in summary.values())
    assert s.recorder.tap.counts()["unrecorded"] == 0


def test_a_new_sequence_length_keeps_its_sites_with_its_own_signature():
    rows = {}
    for verify_every in (1000, 0):  # bypassed, then the wrapper alone
        torch.manual_seed(0)
        model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
        s = _attach(verify_every)
        _steps(s, model, 5)
        bypassed = s.recorder.bypass.steps
        _steps(s, model, 2, first_seed=5, seq=SEQ // 2)  # the order's shapes are SEQ's
        if verify_every:
            assert s.recorder.bypass.steps == bypassed + 2 and not s.recorder.tap.order.broken
        else:
            assert s.recorder.bypass.steps == 0
        rows[verify_every] = [call_rows(r) for r in s.history()]
        fadiag.detach()
    assert rows[1000] == rows[0]
    assert rows[0][-1] != rows[0][0]  # the short steps' own bytes


def test_calls_the_tap_cannot_see_in_a_bypassed_step_are_counted_and_the_wrapper_takes_over():
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    s = _attach(verify_every=1000)
    _steps(s, model, 5)
    assert s.recorder.bypass.order is not None
    with sdpa_kernel([SDPBackend.MATH]):  # no fused op: nothing for the tap to time
        _steps(s, model, 2, first_seed=5)
    _steps(s, model, 5, first_seed=7)
    reports = s.history()
    math_bypassed, math_wrapper = reports[5], reports[6]
    assert math_bypassed.calls == [] and math_bypassed.unmeasured == {"untapped": LAYERS}
    # The next step is the wrapper's: it measures the math path itself, at its sites.
    assert [c.site for c in math_wrapper.calls] == [f"tests/models.py:24#{i}"
                                                   for i in range(LAYERS)]
    assert all(c.impl == "math" for c in math_wrapper.calls) and not math_wrapper.unmeasured
    # Back on the fused op, a new order is learned and steps are bypassed again.
    assert s.recorder.bypass.order is not None
    assert all(c.impl == "cpu_flash" for c in reports[-1].calls)
    assert s.recorder.unmeasured_totals()["untapped"] == LAYERS
    assert sample(s, "fadiag_steps_total") == 12


def test_steps_whose_calls_change_every_step_end_bypassing_and_are_never_misnamed():
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    s = _attach(verify_every=1000)
    _steps(s, model, 5)
    for i in range(24):  # an extra attention call every other step: the order never holds
        extra = torch.randn(1, 2, 8, 8, requires_grad=True)
        if i % 2:
            F.scaled_dot_product_attention(extra, extra, extra).sum().backward()
        _steps(s, model, 1, first_seed=5 + i)
    assert s.recorder.bypass.verify_every == 0  # three misses close together: bypassing ended
    model_sites = {f"tests/models.py:24#{i}" for i in range(LAYERS)}
    for r in s.history():
        sites = {c.site for c in r.calls}
        assert model_sites <= sites or all(site.startswith("eager#") for site in sites)
        for c in r.calls:
            if c.site in model_sites:
                assert c.standard_bytes == s.history()[2].calls[0].standard_bytes


def test_detach_stops_bypassing_and_the_builtin_calls_the_original():
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    for _ in range(3):
        s = _attach(verify_every=1000)
        _steps(s, model, 5)
        assert s.recorder.bypass.order is not None
        fadiag.detach()
        assert s.recorder.bypass.order is None
        q = torch.randn(1, 2, 16, 8)
        assert torch.equal(F.scaled_dot_product_attention(q, q, q),
                           torch._C._nn.scaled_dot_product_attention(q, q, q))


def test_with_sampling_only_measured_steps_are_bypassed_and_some_are_still_checked():
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    s = _attach(verify_every=3, every_n_steps=2)
    _steps(s, model, 24)
    reports = s.history()
    assert [r.step for r in reports] == list(range(2, 25, 2))  # the measured steps
    # Step 2 learns the signature, step 4 the order: 6, 8, 12, 14, 18, 20 and 24 are bypassed;
    # 10, 16 and 22 the wrapper measures (two of three measured steps in a row bypassed).
    assert s.recorder.bypass.steps == 7
    assert all(call_rows(r) == call_rows(reports[1]) for r in reports[1:])
    assert s.recorder.unmeasured_totals()["sampling"] == 12 * LAYERS


class _TwoSites(torch.nn.Module):
    """Two attention call sites of one shape, called in either order (`swapped`)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.swapped = False

    def first(self, x):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)  # site A

    def second(self, x):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)  # site B

    def forward(self, x):
        x = self.proj(x).view(2, 2, 32, 16)
        calls = (self.second, self.first) if self.swapped else (self.first, self.second)
        for call in calls:
            x = call(x)
        return x


def test_a_verifying_step_learns_a_new_order_that_later_bypassed_steps_follow():
    torch.manual_seed(0)
    model = _TwoSites()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    s = _attach(verify_every=4)

    def step():
        model(torch.randn(2, 32, 32)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert s.flush(10)

    for _ in range(8):
        step()
    first_order = [c.site for c in s.history()[-1].calls]
    assert s.recorder.bypass.steps > 0
    model.swapped = True  # the same shapes: only a step the wrapper measures can tell
    for _ in range(8):
        step()
    # Within four steps a step the wrapper measured learned the new order; the last steps,
    # bypassed, follow it.
    assert [c.site for c in s.history()[-1].calls] == first_order[::-1]
    assert s.recorder.bypass.order is not None and s.recorder.bypass.order.entries[0][1] == (
        first_order[1])
