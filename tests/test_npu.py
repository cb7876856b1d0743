"""The Ascend path, driven by the fake torch_npu in fadiag.testing (no Ascend hardware here).

The fake keeps torch_npu's real signature and return tuple, names its backward node
NpuFusionAttentionBackward0, and its events refuse `elapsed_time` before `query()` was True —
which is what would synchronise a real NPU.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

import fadiag
from fadiag.testing import FakeNpuEvent, FakeNpuGraph, fake_npu


@pytest.fixture
def torch_npu():
    with fake_npu(lag=0.002) as module:
        yield module


def train_npu(torch_npu, layout, steps=3, **kwargs):
    b, s, n, d = 2, 64, 4, 16
    shapes = {"BSND": (b, s, n, d), "BNSD": (b, n, s, d), "BSH": (b, s, n * d), "SBH": (s, b, n * d)}
    q, k, v = (torch.randn(*shapes[layout], requires_grad=True) for _ in range(3))
    for _ in range(steps):
        out = torch_npu.npu_fusion_attention(q, k, v, n, layout, scale=d ** -0.5, **kwargs)[0]
        out.sum().backward()
        fadiag.step()
    return out


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
def test_npu_fusion_attention_is_measured_in_every_layout(torch_npu, layout):
    s = fadiag.attach(device="npu", port=0)
    out = train_npu(torch_npu, layout, sparse_mode=2)
    assert type(out.grad_fn).__name__ != ""  # the op's output has a graph
    assert s.flush(10)
    call = s.last_step().calls[0]
    assert call.impl == "npu_fusion" and call.device == "npu" and call.layout == layout
    assert call.shape == (2, 4, 64, 64, 16) and call.causal
    assert call.forward_seconds > 0 and call.backward_seconds > 0
    # kept: O plus fp32 softmax_max and softmax_sum [B, N, S, 8] (+ the causal mask it built)
    stats = 2 * (2 * 4 * 64 * 8 * 4)
    assert call.kept_bytes >= 2 * 4 * 64 * 16 * 4 + stats
    assert s.errors == 0


def test_the_fused_backward_node_is_named_as_on_ascend(torch_npu):
    q = torch.randn(1, 8, 2, 4, requires_grad=True)
    out = torch_npu.npu_fusion_attention(q, q, q, 2, "BSND")[0]
    names = {type(fn).__name__ for fn, _ in out.grad_fn.next_functions if fn is not None}
    assert "NpuFusionAttentionBackward0" in names | {type(out.grad_fn).__name__}


def test_events_are_resolved_only_after_query_says_done(torch_npu):
    FakeNpuEvent.lag = 0.2  # the "device" is 200 ms behind the host
    s = fadiag.attach(device="npu", port=0)
    train_npu(torch_npu, "BSND", steps=2)
    assert s.last_step() is None or s.last_step().step < 2  # not resolved before the device finished
    assert s.flush(10)
    assert s.last_step().step == 2 and s.errors == 0


@pytest.mark.parametrize("lag, starved", [(0.0, True), (0.5, False)])
def test_windows_the_device_entered_idle_are_host_bound_and_the_rule_leaves_them(torch_npu, lag,
                                                                                 starved):
    """Python's marks, as the tap's: a stream with nothing left to run when a window opens (lag
    0: the "device" keeps up with every event at once) passes the start mark at once and waits
    in the window for the host, so the window may hold host time and is not judged; a device
    half a second behind the host enters every window busy, and no window holds any."""
    FakeNpuEvent.lag = lag
    s = fadiag.attach(device="npu", port=0)
    train_npu(torch_npu, "BSND", steps=4)
    assert s.flush(10)
    calls = [c for r in s.history() for c in r.calls if not c.probe]
    assert len(calls) == 3 and s.errors == 0
    for c in calls:
        assert c.forward_seconds > 0 and c.backward_seconds > 0
        if starved:  # on the fake, a window is host time only: what it may hold is all of it
            assert c.host_bound and c.forward_host_seconds >= 0.9 * c.forward_seconds, c
            assert c.backward_host_seconds >= 0.9 * c.backward_seconds, c
        else:
            assert (c.forward_host_seconds, c.backward_host_seconds) == (0.0, 0.0), c
    assert s.rules.host_bound_calls == (3 if starved else 0)
    assert (s.last_step().ratio is None) == starved  # the ratio divides device-bound windows


def test_calls_while_a_graph_captures_the_stream_take_no_mark_and_are_counted(torch_npu):
    """An event recorded (or a stream queried) while a graph captures the stream would
    invalidate the user's capture; the fake raises where the device would. A call made then
    takes no mark and is counted (graph_capture), and the backward of a call measured before
    the capture, run inside it, takes none either: that call is reported unmeasured
    (graph_capture_backward), not with a backward of 0; nothing fails, nothing is an error."""
    s = fadiag.attach(device="npu", port=0)
    train_npu(torch_npu, "BSND", steps=2)  # the signature learned
    q = torch.randn(2, 64, 4, 16, requires_grad=True)
    FakeNpuGraph.capturing = True
    try:
        out = torch_npu.npu_fusion_attention(q, q, q, 4, "BSND")[0]
        out.sum().backward()
    finally:
        FakeNpuGraph.capturing = False
    before = torch_npu.npu_fusion_attention(q, q, q, 4, "BSND")[0]  # measured outside
    FakeNpuGraph.capturing = True
    try:
        before.sum().backward()
    finally:
        FakeNpuGraph.capturing = False
    fadiag.step()
    assert s.flush(10)
    assert s.errors == 0
    totals = s.recorder.unmeasured_totals()
    assert totals["graph_capture"] == 1 and totals["graph_capture_backward"] == 1, totals
    last = s.last_step()
    assert last.calls == [] and last.unmeasured == {"graph_capture": 1,
                                                    "graph_capture_backward": 1}, last
    train_npu(torch_npu, "BSND", steps=1)  # a step after it is measured whole
    assert s.flush(10)
    assert [c.backward_seconds > 0 for c in s.last_step().calls] == [True]


def test_a_window_holds_host_time_when_the_device_passed_its_start_before_its_end_mark(torch_npu):
    """EventTimer.held: a window's end mark asks whether the device has passed its start. Passed
    — idle at the start, run dry between the marks while the host was still queueing the op, or
    done with the op before the end mark — the window may hold the host's time between the
    marks; not passed, every kernel was queued before the device got there: none. The second
    case is one no query of the stream at either mark can see: it is busy at both."""
    from fadiag.capture.timers import EventTimer

    timer = EventTimer("npu", torch.npu)
    stream = torch.npu.current_stream()

    def window(host_seconds: float):
        """An op whose host side takes `host_seconds` before it queues its kernel."""
        start = timer.mark()
        time.sleep(host_seconds)
        FakeNpuEvent().record()  # the op's kernel
        busy = not stream.query()
        end = timer.mark(start)
        return start, end, busy

    def host_gap(start, end) -> int:
        return end.fadiag_host[1] - start.fadiag_host[1]

    FakeNpuEvent.lag = 0.5  # the device runs half a second behind the host
    timer.mark()  # work queued ahead
    start, end, busy = window(0.0)
    assert busy and not end.fadiag_host[0] and timer.held(start, end) == 0
    start, end, busy = window(0.6)  # the device ran dry while the host worked: busy at both marks
    assert busy and end.fadiag_host[0] and timer.held(start, end) == host_gap(start, end) >= 6e8
    FakeNpuEvent.lag = 0.0  # the device keeps up: idle at the start, done before the end
    while not stream.query():
        time.sleep(0.01)
    start, end, _ = window(0.0)
    assert timer.held(start, end) == host_gap(start, end) > 0
    assert not timer.mark().fadiag_host[0]  # a start mark asks nothing


def test_fake_event_rejects_an_early_elapsed_time(torch_npu):
    FakeNpuEvent.lag = 10.0
    a, b = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    a.record()
    b.record()
    with pytest.raises(RuntimeError, match="synchronise"):
        a.elapsed_time(b)


def test_npu_device_seam_reports_the_device_name(torch_npu):
    s = fadiag.attach(device="npu", port=0)
    train_npu(torch_npu, "BSND", steps=1)
    assert s.flush(10)
    assert s.devices.name() == "Ascend910B (fake)"


def test_npu_training_is_bit_identical_with_fadiag(torch_npu):
    def run():
        torch.manual_seed(0)
        q = torch.randn(2, 32, 4, 16, requires_grad=True)
        losses = []
        for _ in range(3):
            out = torch_npu.npu_fusion_attention(q, q, q, 4, "BSND", sparse_mode=2)[0]
            loss = out.square().mean()
            loss.backward()
            losses.append(loss.item())
        return losses, q.grad.clone()

    plain = run()
    fadiag.attach(device="npu", port=0)
    losses, grad = run()
    assert losses == plain[0] and torch.equal(grad, plain[1])


def test_tnd_layout_reads_batch_and_longest_sequence_from_cumulative_lengths():
    from fadiag.capture.ops import read_npu_fusion

    q = torch.randn(10, 4, 16)  # T=10 tokens: sequences of 3 and 7
    k = v = torch.randn(10, 2, 16)
    info = read_npu_fusion((q, k, v, 4, "TND"), {"actual_seq_qlen": [3, 10],
                                                 "actual_seq_kvlen": [3, 10], "sparse_mode": 3})
    assert info.shape == (2, 4, 7, 7, 16) and info.kv_heads == 2 and info.causal


def test_flash_attn_varlen_reads_batch_from_cu_seqlens():
    from fadiag.capture.ops import read_flash_attn_varlen

    q = torch.randn(10, 4, 16)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    info = read_flash_attn_varlen((q, q, q, cu, cu, 7, 7), {"causal": True})
    assert info.shape == (2, 4, 7, 7, 16) and info.causal and info.layout == "TND"


def test_the_cli_finds_an_ascend_device_through_torch_npu(monkeypatch):
    """`fadiag bench` and `fadiag demo` look for a device the same way: npu when torch_npu imports
    and sees one (importing it registers torch.npu), else cuda, else cpu."""
    from fadiag.capture.device import available
    from fadiag.cli.bench import measure as bench

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed: import fails
    assert not available("npu") and available("cpu")
    assert bench.default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.delitem(sys.modules, "torch_npu")
    with fake_npu():
        assert available("npu") and bench.default_device() == "npu"


def test_step_memory_is_read_for_the_training_threads_device(torch_npu, monkeypatch):
    # Under torchrun each rank sets its own device on its training thread; the resolver thread
    # reads the step's allocator figures, and its own current device is device 0. The figures
    # must be those of the training thread's device.
    import threading

    training = threading.current_thread()
    monkeypatch.setattr(torch.npu, "current_device",
                        lambda: 3 if threading.current_thread() is training else 0)
    asked: list[tuple[str, object]] = []
    stats = torch.npu.memory_stats

    def memory_stats(device=None):
        asked.append((threading.current_thread().name, device))
        return stats(device)

    monkeypatch.setattr(torch.npu, "memory_stats", memory_stats)
    s = fadiag.attach(device="npu", port=0)
    train_npu(torch_npu, "BSND", steps=2)
    assert s.flush(10)
    from_resolver = {device for thread, device in asked if thread != training.name}
    assert from_resolver == {3}

