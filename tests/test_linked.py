"""Eager calls timed by the dispatcher tap: the Python wrapper names the call, the tap times it.

Once a signature is learned and the tap saw its fused op, the wrapper takes no marks: the tap
takes them around the op's own kernel and its backward op, below autograd, and the resolver joins
each record to the wrapper's call (its site). What autograd does around the kernel (saved-tensor
hooks, as activation checkpointing's) is then outside the forward window.
"""

from __future__ import annotations

import statistics
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fadiag
from fadiag.capture import eager
from tests.models import GPT, train
from tests.native_marks import NEEDS_TAP

SEQ, BATCH, DIM, HEADS, LAYERS = 64, 2, 32, 2, 2


pytestmark = NEEDS_TAP


def _kept_bytes(q: torch.Tensor) -> int:
    """What cpu_flash keeps for its backward: the output and the float32 logsumexp."""
    b, h, s, d = q.shape
    return b * h * s * d * q.element_size() + b * h * s * 4


def test_eager_calls_are_timed_by_the_tap_once_learned_and_report_as_before():
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    s = fadiag.attach(port=0, tap="on")
    tap = s.recorder.tap
    assert tap is not None
    train(model, 4, seq=SEQ, batch=BATCH)
    assert s.flush(10)
    steps = s.history()
    assert [len(r.calls) for r in steps] == [LAYERS] * 4
    first, *later = steps
    for r in later:
        assert [c.site for c in r.calls] == [c.site for c in first.calls]
        assert all("models.py" in c.site for c in r.calls)  # the eager call site, not compiled#n
        for c in r.calls:
            assert c.impl == "cpu_flash" and not c.probe
            assert c.forward_seconds > 0 and c.backward_seconds > 0
            q = torch.empty(BATCH, HEADS, SEQ, DIM // HEADS)
            assert c.kept_bytes == _kept_bytes(q)
            assert c.standard_bytes == first.calls[0].standard_bytes
    # The tap timed the backward op of every call after the first step's (probe) calls.
    assert tap.backward_starts() >= LAYERS * 3
    assert tap.counts()["unrecorded"] == 0


class _SlowPacking(nn.Module):
    """SDPA under saved-tensor hooks whose packing sleeps: host time autograd spends saving
    the op's tensors for its backward, after the kernel has run (as checkpointing's hooks do)."""

    def __init__(self, pause_s: float):
        super().__init__()
        self.pause_s = pause_s

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def pack(t: torch.Tensor) -> torch.Tensor:
            time.sleep(self.pause_s)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _forward_seconds(tap: str, steps: int, pause_s: float) -> list[float]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(3))
    model = _SlowPacking(pause_s)
    s = fadiag.attach(port=0, tap=tap)
    try:
        for _ in range(steps):
            model(q, k, v).sum().backward()
            fadiag.step()
        assert s.flush(10)
        return [r.calls[0].forward_seconds for r in s.history()]
    finally:
        fadiag.detach()


def test_saved_tensor_hooks_stay_out_of_a_tapped_forward_window():
    pause = 0.05  # per saved tensor; the fused op saves several, so >= 100 ms a call
    wrapped = _forward_seconds("off", 3, pause)
    tapped = _forward_seconds("on", 9, pause)
    # The wrapper's window holds the packing (a lower bound: sleeps cannot be shorter) ...
    assert min(wrapped) >= 2 * pause
    # ... the tap's holds the kernel (~0.1 ms here): its steady-state calls (after the first, the
    # probe) read under one pause, where the wrapper's read over two. A busy machine preempts a
    # CPU kernel's threads for scheduler slices of milliseconds, not for half of its calls
    # by 50 ms.
    assert statistics.median(tapped[1:]) < pause


def test_micro_batches_keep_their_sites_when_the_tap_times_them():
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    s = fadiag.attach(port=0, tap="on")
    train(model, 3, seq=SEQ, batch=BATCH, micro_batches=2)
    assert s.flush(10)
    steps = s.history()
    assert [len(r.calls) for r in steps] == [2 * LAYERS] * 3
    for r in steps[1:]:
        assert [c.site for c in r.calls] == [c.site for c in steps[0].calls]
        assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in r.calls)
    assert s.recorder.tap.counts()["unrecorded"] == 0


def test_without_optimizer_each_pass_is_a_step_when_the_tap_times_its_calls():
    # Before any optimizer step, each pass's first call opens a micro-batch (made whole in C++);
    # once steps.fallback_after passes went by without one, opening it closes a step (Python's
    # path then makes the call). Every pass ends as a step of its own either way.
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS)
    s = fadiag.attach(port=0, tap="on", **{"steps.fallback_after": 3})
    for _ in range(8):
        model(torch.randint(0, 64, (BATCH, SEQ))).sum().backward()
    model(torch.randint(0, 64, (BATCH, SEQ)))  # the forward that closes the eighth pass
    assert s.flush(10)
    steps = s.history()[:8]  # the ninth: the last forward, with no backward, as flush() left it
    assert [r.step for r in steps] == list(range(1, 9))
    assert [len(r.calls) for r in steps] == [LAYERS] * 8
    assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for r in steps for c in r.calls)
    assert all([c.site for c in r.calls] == [c.site for c in steps[0].calls] for r in steps)
    assert s.recorder.tap.counts()["unrecorded"] == 0 and s.errors == 0


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_checkpointed_layers_under_the_tap_mark_recomputes_and_time_every_backward(mode):
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, dim=DIM, heads=HEADS, checkpointing=mode)
    s = fadiag.attach(port=0, tap="on")
    train(model, 4, seq=SEQ, batch=BATCH)
    assert s.flush(10)
    for r in s.history()[1:]:
        first = [c for c in r.calls if not c.recompute]
        again = [c for c in r.calls if c.recompute]
        assert len(first) == LAYERS and len(again) == LAYERS
        assert {c.site for c in again} == {c.site for c in first}
        summary = {site.site: site for site in r.sites()}
        assert len(summary) == LAYERS
        assert all(site.calls == 1 and site.backward_seconds > 0 for site in summary.values())
    assert s.recorder.tap.counts()["unrecorded"] == 0


def test_the_tap_and_the_recorder_share_one_native_timer_when_native_marks_are_on():
    s = fadiag.attach(port=0, tap="on", native="on")
    tap = s.recorder.tap
    timer = s.devices.timer("cpu")
    assert timer.native and tap.shares(timer) and tap.timers["cpu"] is timer
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    for _ in range(3):
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        fadiag.step()
    assert s.flush(10)
    assert [len(r.calls) for r in s.history()] == [1, 1, 1]
    assert all(r.calls[0].backward_seconds > 0 for r in s.history())
    assert tap.backward_starts() == 2  # the calls after the probe: the tap's to time
    assert timer.marks_in_use() == 0


def test_with_python_marks_on_cpu_the_tap_keeps_its_own_timer_and_still_times_the_calls():
    s = fadiag.attach(port=0, tap="on", native="auto")  # auto: Python marks on CPU
    tap = s.recorder.tap
    timer = s.devices.timer("cpu")
    assert not getattr(timer, "native", False) and not tap.shares(timer)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    for _ in range(3):
        F.scaled_dot_product_attention(q, q, q).sum().backward()
        fadiag.step()
    assert s.flush(10)
    assert tap.backward_starts() == 2
    assert all(r.calls[0].backward_seconds > 0 for r in s.history())
    assert tap.timers["cpu"].marks_in_use() == 0


def test_a_fault_joining_the_tap_records_drops_those_calls_and_training_goes_on(monkeypatch,
                                                                               caplog):
    s = fadiag.attach(port=0, tap="on")
    tap = s.recorder.tap
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q).sum().backward()  # learn the signature
    fadiag.step()
    assert s.flush(10)

    def broken(*args, **kwargs):
        raise RuntimeError("join bug")

    monkeypatch.setattr(tap, "calls", broken)
    for _ in range(2):
        F.scaled_dot_product_attention(q, q, q).sum().backward()
        fadiag.step()
    assert s.flush(10)  # resolved, not waiting for marks no call will ever get
    assert s.errors == 2  # each failed join counted ...
    logged = [r for r in caplog.records if "internal error in resolver.tap" in r.getMessage()]
    assert len(logged) == 1  # ... and logged once
    # The steps are reported, each saying what it could not measure.
    assert [len(r.calls) for r in s.history()] == [1, 0, 0]
    assert [r.unmeasured.get("unrecorded", 0) for r in s.history()] == [0, 1, 1]
    assert s.recorder.unmeasured_totals()["unrecorded"] == 2


def test_a_step_the_resolver_drops_gives_back_the_marks_of_its_tap_records(monkeypatch):
    s = fadiag.attach(port=0, tap="on", native="on")
    timer = s.devices.timer("cpu")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q).sum().backward()  # learn the signature
    fadiag.step()
    assert s.flush(10)

    def broken(step):
        raise RuntimeError("window bug")

    monkeypatch.setattr(s.resolver, "_await_window", lambda: broken(None))
    F.scaled_dot_product_attention(q, q, q).sum().backward()  # linked: its marks are the tap's
    fadiag.step()
    assert s.flush(10)
    assert s.errors >= 1 and len(s.history()) == 1  # dropped, counted
    assert timer.marks_in_use() == 0  # the cut's four marks came back


def _native_calls_per_sdpa(q: torch.Tensor, calls: int) -> list[list[str]]:
    """`calls` SDPA calls from one line in one forward, then their backward: the C functions
    each call made, and its Python frames (`py:name`), as sys.setprofile sees them."""
    seen: list[list[str]] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "c_call" and frame.f_code is not own:  # not this loop's append
            seen[-1].append(getattr(arg, "__name__", str(arg)))
        elif event == "call" and frame.f_code is not own:
            seen[-1].append(f"py:{frame.f_code.co_name}")

    own = sys._getframe().f_code

    outs = []
    for _ in range(calls):
        seen.append([])
        sys.setprofile(profile)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        sys.setprofile(None)
        outs.append(out)
    sum(o.sum() for o in outs).backward()
    return seen


@pytest.mark.parametrize("wrapper", ["builtin", "python"])
def test_a_learned_call_the_tap_times_is_one_native_call(wrapper, monkeypatch):
    if wrapper == "python":  # where the builtin is not used (capture/eager.py)
        monkeypatch.setattr(eager, "unavailable", lambda ext: "off for this test")
    s = fadiag.attach(port=0, tap="on", native="on")
    assert eager.is_builtin(F.scaled_dot_product_attention) is (wrapper == "builtin")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    for _ in range(3):
        per_call = _native_calls_per_sdpa(q, 3)  # a step's forward, then its backward
        first = _native_calls_per_sdpa(q, 1)  # a micro-batch: a forward after a backward
        fadiag.step()
    assert s.flush(10)
    # Learned calls from a known line are handed whole to C++ (FastBegin.call): by the builtin,
    # with nothing else called from Python; by the Python wrapper, its one C call. No Tap.enter,
    # no Recorder.begin. A forward after a backward (a micro-batch's first) is made whole too,
    # once Recorder.open_phase has opened its micro-batch as Python's path would.
    python = ["py:fadiag_attention", "py:is_dynamo_compiling", "call"] if wrapper == "python" else []
    assert per_call == [python] * 3
    assert first == [[*python, "py:open_phase", "py:_native_backward_seen", "backward_starts",
                      "py:_new_phase", "py:new_pass", "clear"]]
    last = s.history()[-1]
    assert len(last.calls) == 4
    assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in last.calls)
    sites = [c.site for c in last.calls]
    # One line's calls by ordinal in each micro-batch, as Python's path names them.
    assert [site.rpartition("#")[2] for site in sites] == ["0", "1", "2", "0"]
    assert all("test_linked.py" in site for site in sites) and len(set(sites)) == 3
    assert [c.site for c in s.history()[-2].calls] == sites
    assert s.recorder.depth == 0 and s.recorder.tap.counts()["unrecorded"] == 0


def _attend(q: torch.Tensor, **kwargs: object) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q, **kwargs)  # one line: one call site


def _learned() -> tuple[fadiag.Session, torch.Tensor]:
    """A session whose wrapper makes `_attend`'s calls whole in C++ (two steps learned them)."""
    s = fadiag.attach(port=0, tap="on", native="on")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    for _ in range(2):
        _attend(q).sum().backward()
        fadiag.step()
    assert s.recorder._fast_call is not None
    return s, q


@pytest.mark.parametrize("wrapper", ["builtin", "python"])
def test_an_error_raised_inside_a_native_whole_call_reaches_the_caller_unchanged(wrapper,
                                                                                 monkeypatch):
    if wrapper == "python":
        monkeypatch.setattr(eager, "unavailable", lambda ext: "off for this test")
    s, q = _learned()
    assert eager.is_builtin(F.scaled_dot_product_attention) is (wrapper == "builtin")
    names: list[str] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if frame.f_code.co_name == "fadiag_attention" and event in ("call", "c_call"):
            names.append("frame" if event == "call" else getattr(arg, "__name__", str(arg)))

    first = _attend(q)
    # `scale` is not part of a signature: the call takes the native path from a known line,
    # and SDPA's own argument check raises inside it.
    sys.setprofile(profile)
    try:
        with pytest.raises(TypeError, match="scale"):
            _attend(q, scale="wide")
    finally:
        sys.setprofile(None)
    # Raised inside the native whole call: the builtin's, or the one the Python wrapper makes.
    assert names == ([] if wrapper == "builtin" else ["frame", "call"])
    assert s.recorder.depth == 0
    out = _attend(q)  # the wrapper's state is whole again
    (first + out).sum().backward()
    fadiag.step()
    assert s.flush(10)
    last = s.history()[-1]
    assert [c.backward_seconds > 0 for c in last.calls] == [True, True]  # the failed call: none
    assert s.errors == 0
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))


def test_a_fault_in_the_native_whole_call_leaves_the_call_to_python_and_training_goes_on():
    s, q = _learned()
    rec = s.recorder
    first = _attend(q)
    class Unreadable:
        def __bool__(self) -> bool:
            raise RuntimeError("recorder state broken")

    # The native call cannot read the recorder's state: it hands the call to Python's path,
    # whose failure is counted once, and the op's result comes back as without fadiag.
    seen, rec.backward_seen = rec.backward_seen, Unreadable()
    try:
        out = _attend(q)
    finally:
        rec.backward_seen = seen
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))
    assert s.errors == 1 and rec.depth == 0
    (first + out).sum().backward()
    fadiag.step()
    _attend(q).sum().backward()  # the next step is measured again
    fadiag.step()
    assert s.flush(10)
    assert [len(r.calls) for r in s.history()[-2:]] == [1, 1]
    assert s.history()[-1].calls[0].backward_seconds > 0
