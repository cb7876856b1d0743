"""On a CUDA GPU: the backend that ran, no host sync, timing against CUPTI, the rules, long runs.

Run on the GPU machine with ``python -m pytest -m gpu tests/test_gpu.py``; CI has no GPU.
"""

from __future__ import annotations

import statistics
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadiag
from tests.models import GPT, GpuBusy, capture_behind_a_pending_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

@pytest.fixture(scope="module", autouse=True)
def native_marks_built():
    """Build (or load) the native marks once, so `native: auto` uses them from the first call."""
    from fadiag.capture import native

    module = native.load("cuda")
    print(f"native marks: {native.status('cuda')}")
    return module


@pytest.fixture(params=["tap", "native", "python"])
def marks(request, native_marks_built):
    """How eager calls are timed: by the dispatcher tap (the default once the extension is
    loaded: the wrapper names the call, the tap marks its kernels), or by the wrapper's own marks
    and backward hooks, C++ (`native`) or Python (`python`). Each test using it runs all three."""
    if request.param != "python" and native_marks_built is None:
        from fadiag.capture import native

        pytest.fail(f"native marks did not build here: {native.status('cuda')}")
    return request.param


def attach(marks, **kw):
    native = "off" if marks == "python" else "on"
    session = fadiag.attach(port=0, native=native, tap="on" if marks == "tap" else "off", **kw)
    assert session.devices.timer("cuda").native == (native == "on")
    if marks == "tap":
        assert session.recorder.tap.shares(session.devices.timer("cuda"))
    return session


def test_the_default_setting_uses_the_native_marks_once_they_are_loaded(native_marks_built):
    """`native: auto`, the default: with the extension already loaded, the first call gets it."""
    assert native_marks_built is not None
    session = fadiag.attach(port=0)
    q = torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    for _ in range(3):
        F.scaled_dot_product_attention(q, q, q).sum().backward()
        fadiag.step()
    assert session.flush(30)
    timer = session.devices.timer("cuda")
    assert timer.native and session.devices.native_timers == [timer]
    assert session.last_step().backward_seconds > 0 and session.errors == 0


def test_the_native_allocator_read_matches_torchs_memory_stats(native_marks_built):
    """The resolver reads the allocator each step in C++ (three numbers, no GIL): the same
    figures torch.cuda.memory_stats() gives, on the current device and on a named one."""
    from fadiag.capture.timers import NativeTimer

    timer = NativeTimer("cuda", native_marks_built, torch.cuda)
    keep = torch.empty(3 << 20, device="cuda", dtype=torch.uint8)
    del keep  # a peak above the current
    held = torch.empty(1 << 20, device="cuda", dtype=torch.uint8)
    torch.cuda.synchronize()
    for device in (None, torch.cuda.current_device()):
        stats = torch.cuda.memory_stats() if device is None else torch.cuda.memory_stats(device)
        assert timer.memory_stats(device) == {
            "current": stats["allocated_bytes.all.current"],
            "peak": stats["allocated_bytes.all.peak"],
            "allocated": stats["allocated_bytes.all.allocated"]}
    assert timer.memory_stats()["current"] >= held.numel()
    assert timer.memory_stats()["peak"] >= timer.memory_stats()["current"] + (2 << 20)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the fast path needs Python 3.11's frame API")
def test_native_on_keeps_the_fast_path_beside_the_cpu_timer_the_tap_adopts(native_marks_built):
    """`native: on` with the tap: the CPU native timer is adopted for the tap's CPU records and
    takes no mark here; learned CUDA calls still start in C++ (not Python's path)."""
    session = attach("tap")
    assert {t.kind for t in session.devices.native_timers} == {"cpu", "cuda"}
    q = torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    for _ in range(4):
        F.scaled_dot_product_attention(q, q, q).sum().backward()
        fadiag.step()
    assert session.flush(30)
    assert session.recorder._fast is not None
    assert session.last_step().backward_seconds > 0 and session.errors == 0


BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def qkv(s, b=1, h=16, d=128, dtype=torch.float16):
    return [torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]


def run_steps(backend, s, steps=3, causal=False, b=1):
    q, k, v = qkv(s, b=b)
    for _ in range(steps):
        GpuBusy.apply(q)
        with sdpa_kernel(BACKENDS[backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out = GpuBusy.apply(out)
        out.backward(torch.ones_like(out))
        fadiag.step()


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_impl_is_the_backend_that_ran(backend, marks):
    s = attach(marks)
    run_steps(backend, 1024)
    assert s.flush(30)
    assert s.last_step().calls[0].impl == backend


def test_no_host_sync_on_the_training_thread(marks):
    syncs = []
    torch._C._activate_gpu_trace()
    from torch.cuda import _gpu_trace

    _gpu_trace.register_callback_for_device_synchronization(lambda *a: syncs.append("device"))
    _gpu_trace.register_callback_for_stream_synchronization(lambda *a: syncs.append("stream"))
    _gpu_trace.register_callback_for_event_synchronization(lambda *a: syncs.append("event"))
    model = GPT(layers=4, dim=256, heads=4, vocab=256).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    tokens = torch.randint(0, 256, (4, 512), device="cuda")
    s = attach(marks)
    for _ in range(3):  # warm-up, also learns every signature
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    syncs.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            model(tokens).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert syncs == []
    assert s.flush(30)
    assert s.last_step().step == 23 and s.errors == 0


def _cupti_kernel_seconds(fn):
    """CUPTI device time of every kernel the SDPA op launched: (forward, backward).

    Kernels are attributed through the profiler's CPU ops: the forward op
    (aten::scaled_dot_product_attention) and the backward op (aten::_scaled_dot_product_*_backward),
    children included, so the helper kernels a backend launches (memsets, dq conversion) count.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fwd = bwd = 0.0
    for e in prof.events():
        if e.name == "aten::scaled_dot_product_attention":
            fwd += e.device_time_total * 1e-6
        elif e.name.startswith("aten::_scaled_dot_product") and e.name.endswith("_backward"):
            bwd += e.device_time_total * 1e-6
    return fwd, bwd


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("s", [2048, 4096, 8192])
def test_forward_and_backward_within_5_percent_of_cupti_kernel_time(backend, s, marks):
    q, k, v = qkv(s, b=2)
    session = attach(marks)

    def ahead(x):
        """~4 ms of device work queued ahead of the next window, in forward and in backward."""
        for _ in range(4):
            x = GpuBusy.apply(x)
        return x

    def once():
        ahead(q)
        with sdpa_kernel(BACKENDS[backend]):
            out = F.scaled_dot_product_attention(q, k, v)
        ahead(out).backward(torch.ones_like(out))

    for _ in range(5):
        once()
        fadiag.step()
    ours_f, ours_b, ref_f, ref_b = [], [], [], []
    for _ in range(5):
        f, b = _cupti_kernel_seconds(once)
        fadiag.step()
        assert session.flush(30)
        call = session.last_step().calls[0]
        # The device is ~4 ms ahead of the host at each window's start: device work alone. (With
        # ~1 ms ahead, the profiler's host cost let the device reach a window's start before its
        # end mark in 2 of 60 calls, run 54: host-bound, rightly.)
        assert (call.forward_host_seconds, call.backward_host_seconds) == (0.0, 0.0), call
        ours_f.append(call.forward_seconds)
        ours_b.append(call.backward_seconds)
        ref_f.append(f)
        ref_b.append(b)
    rf, rb = statistics.median(ours_f) / statistics.median(ref_f), \
        statistics.median(ours_b) / statistics.median(ref_b)
    print(f"{backend} S={s} {marks=}: fwd {statistics.median(ours_f)*1e3:.3f} ms vs CUPTI "
          f"{statistics.median(ref_f)*1e3:.3f} ms ({rf:.3f}); bwd {statistics.median(ours_b)*1e3:.3f}"
          f" vs {statistics.median(ref_b)*1e3:.3f} ms ({rb:.3f})")
    assert 0.95 <= rf <= 1.05
    assert 0.95 <= rb <= 1.05


@pytest.mark.parametrize("marks, compiled", [("tap", False), ("tap", True), ("native", False),
                                             ("python", False)])
def test_windows_on_a_starved_device_are_host_bound_and_on_a_busy_one_not(marks, compiled):
    """A device idle when the op is queued (a synchronize before each call and each backward)
    waits inside the window for the host's launches: the window may hold host time, the call is
    host-bound and the ratio rule leaves it. A device kept 2 ms ahead: no host time at all. So
    whichever marks time the call: the tap's (eager and compiled), the wrapper's C++ ones and
    its Python ones (tap off: a build that has none, or before it loads)."""
    session = attach(marks)
    q = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    sdpa = F.scaled_dot_product_attention
    attention = torch.compile(lambda x: sdpa(x, x, x)) if compiled else (lambda x: sdpa(x, x, x))

    def busy():
        out = attention(GpuBusy.apply(q))
        GpuBusy.apply(out).backward(torch.ones_like(out))

    def starved():
        torch.cuda.synchronize()
        out = attention(q)
        torch.cuda.synchronize()
        out.backward(torch.ones_like(out))

    for step in [busy] * 6 + [starved] * 6:
        step()
        fadiag.step()
    assert session.flush(30)
    history = session.history()
    assert [r.step for r in history] == list(range(1, 13))
    # Not the first two steps: the first call learns its signature, and a compiled function's
    # first run compiles for seconds after the busy kernel was queued (the device really waits).
    busy_calls = [c for r in history[2:6] for c in r.calls]
    starved_calls = [c for r in history[6:] for c in r.calls]
    assert len(busy_calls) == 4 and len(starved_calls) == 6
    assert all((c.forward_host_seconds, c.backward_host_seconds) == (0.0, 0.0) for c in busy_calls)
    for c in starved_calls:
        assert c.host_bound and c.forward_host_seconds > 0 and c.backward_host_seconds > 0, c
        assert c.backward_seconds > 0  # measured still: an upper bound, reported as such
    assert session.rules.host_bound_calls >= 6
    fadiag.detach()


class _HostThenKernel(torch.autograd.Function):
    """An op whose host side takes `host_seconds` before it queues a ~2 ms kernel, in forward and
    in backward; `busy` notes whether the stream had work queued when it began and when its
    kernel was queued."""

    host_seconds = 0.0
    busy: list[tuple[bool, bool]] = []

    @staticmethod
    def _run() -> None:
        stream = torch.cuda.current_stream()
        began_busy = not stream.query()
        time.sleep(_HostThenKernel.host_seconds)
        torch.cuda._sleep(4_000_000)
        _HostThenKernel.busy.append((began_busy, not stream.query()))

    @staticmethod
    def forward(ctx, q, k, v):
        _HostThenKernel._run()
        return q.clone()

    @staticmethod
    def backward(ctx, g):
        _HostThenKernel._run()
        return g, None, None


def test_a_window_the_device_ran_dry_inside_is_host_bound_though_busy_at_both_marks(marks):
    """The stream busy when the op begins and when its kernel is queued, yet dry between: the
    op's host side (5 ms) outlasts the work queued ahead of it (~1 ms). Only the end mark's
    question — has the device passed the start? — sees the gap; a query of the stream at either
    mark finds it busy. With no host time in the op, the start is still ahead of the device at
    the end mark and the window is device time. (An instrumented Function: the wrapper's marks,
    C++ or Python; the tap's windows close the same way, Pool::mark.)"""
    session = attach(marks)
    fadiag.instrument(_HostThenKernel, name="host_then_kernel", layout="BHSD")
    q = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)

    def step(host_seconds: float) -> None:
        torch.cuda.synchronize()  # ~1 ms queued ahead of each step's op, no backlog from the last
        _HostThenKernel.host_seconds = host_seconds
        out = _HostThenKernel.apply(GpuBusy.apply(q), q, q)
        GpuBusy.apply(out).backward(torch.ones_like(out))
        fadiag.step()

    for host_seconds in [0.0] * 5 + [0.005] * 4:
        step(host_seconds)
    assert session.flush(30)
    history = session.history()
    assert [r.step for r in history] == list(range(1, 10))
    busy_calls = [c for r in history[1:5] for c in r.calls]  # not the first: it learns the op
    dry_calls = [c for r in history[5:] for c in r.calls]
    assert len(busy_calls) == len(dry_calls) == 4
    assert all(b for pair in _HostThenKernel.busy[-8:] for b in pair), _HostThenKernel.busy[-8:]
    assert all((c.forward_host_seconds, c.backward_host_seconds) == (0.0, 0.0) for c in busy_calls)
    for c in dry_calls:
        assert c.host_bound and c.forward_host_seconds >= 0.004 and c.backward_host_seconds >= 0.004, c
    fadiag.detach()


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("s", [1024, 4096])
def test_flash_and_cudnn_raise_no_warning_flag(backend, s):
    """Flash and cuDNN measure 2.6-3.75x at these shapes on the H200 and the H100 (each card's ratio
    grid): the user's 3x rule still flags them, as info that names the card's band ("the kernel,
    not a fault")."""
    session = fadiag.attach(port=0)
    run_steps(backend, s, steps=5, b=4)
    assert session.flush(30)
    history = session.history()
    flags = [f for r in history for f in r.flags]
    print(f"{backend} S={s} B=4: bwd/fwd per step",
          [None if r.ratio is None else round(r.ratio, 2) for r in history])
    # The first step may have none: cuDNN builds its plans inside the first windows, on the host,
    # and those windows are host-bound. Every later window is device work.
    assert all(r.ratio is not None for r in history[1:])
    assert [f for f in flags if f.severity != "info"] == [], [f.message for f in flags]
    assert all(f.rule == "backward_forward_ratio" and f.band and "not a fault" in f.message
               for f in flags), [f.message for f in flags]
    assert session.last_step().memory_savings > 0.8


@pytest.mark.parametrize("s", [2048, 4096])
def test_mem_efficient_backend_raises_the_ratio_flag(s):
    session = fadiag.attach(port=0)
    run_steps("efficient", s, steps=5, b=4)
    assert session.flush(30)
    flags = [f for r in session.history() for f in r.flags]
    assert [f.rule for f in flags] == ["backward_forward_ratio"], [f.message for f in flags]
    assert flags[0].impl == "efficient" and "impl=efficient" in flags[0].message
    assert flags[0].severity in ("info", "warning") and flags[0].band, flags[0].message
    print(f"efficient S={s}: ratio {flags[0].value:.2f}")


def test_forced_math_path_raises_the_memory_flag():
    session = fadiag.attach(port=0)
    run_steps("math", 2048, steps=2)
    assert session.flush(30)
    flags = [f for r in session.history() for f in r.flags if f.rule == "memory_savings"]
    assert len(flags) == 1 and flags[0].impl == "math"
    call = session.last_step().calls[0]
    assert call.kept_bytes >= 16 * 2048 * 2048 * 2  # at least P, [B, H, S, S]


def test_ten_thousand_steps_keep_event_pool_and_device_memory_flat(marks):
    model = GPT(layers=2, dim=128, heads=2, vocab=128).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    tokens = torch.randint(0, 128, (2, 256), device="cuda")
    session = attach(marks)

    def steps(n):
        for _ in range(n):
            model(tokens).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    steps(200)
    assert session.flush(30)
    timer = session.devices.timer("cuda")
    pool0, mem0 = timer.pool_size(), torch.cuda.memory_allocated()
    steps(10_000)
    assert session.flush(60)
    pool1, mem1 = timer.pool_size(), torch.cuda.memory_allocated()
    print(f"events created: {pool0} after warm-up, {pool1} after 10000 more steps; "
          f"allocated {mem0} -> {mem1} bytes")
    assert session.last_step().step == 10_200
    assert mem1 == mem0
    # Every mark came back, so the pool is the high-water mark of marks in flight (how far the
    # resolver lagged at worst, which varies with the host), not a count of steps.
    assert timer.marks_in_use() == 0
    assert session.errors == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_counted_steps_time_every_call_and_give_every_mark_back(marks, compiled):
    """sampling.reports_per_second: a rate this low reports the step that learned the signatures
    and counts every steady step after it, whatever the host's speed."""
    if compiled and marks != "tap":
        pytest.skip("compiled code's calls are timed by the tap alone")
    from prometheus_client import CollectorRegistry

    torch._dynamo.reset()
    model = GPT(layers=2, dim=128, heads=2, vocab=128).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    run = torch.compile(model) if compiled else model
    tokens = torch.randint(0, 128, (2, 256), device="cuda")
    session = attach(marks, **{"sampling.reports_per_second": 1e-6})
    for _ in range(50):
        run(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert session.flush(30)
    registry = CollectorRegistry()
    registry.register(session.metrics)
    value = registry.get_sample_value
    reported = session.history()
    impl = reported[0].calls[0].impl
    labels = {"rank": "0", "impl": impl}
    counted = 50 - len(reported)
    assert reported[0].step == 1 and counted >= 45
    assert value("fadiag_steps_total", {"rank": "0"}) == 50
    assert value("fadiag_steps_unreported_total", {"rank": "0"}) == counted
    # A counted step is a steady one: both layers' calls timed, forward and backward.
    assert value("fadiag_attention_calls_total", labels) == 2 * counted + sum(
        len(r.calls) for r in reported)
    assert value("fadiag_attention_backward_seconds_count", labels) == 2 * counted + sum(
        1 for r in reported for c in r.calls if c.backward_seconds > 0)
    assert value("fadiag_attention_forward_seconds_sum", labels) > 0
    if marks == "tap":  # every steady step after the one its shape was learned from: in C++
        # (bypassed steps, whose records are not linked to the wrapper's calls, are a second
        # shape: the first of them is resolved in Python too)
        shapes = 2 if session.recorder.bypass.steps else 1
        assert session.resolver._steady.counted >= counted - shapes
    assert session.devices.timer("cuda").marks_in_use() == 0
    assert session.errors == 0


def test_bypassed_eager_steps_report_as_the_wrapper_measures_them():
    """Steps whose SDPA calls run no fadiag Python (steps/bypass.py): the tap times each call,
    named by the order of the last step the wrapper measured; one step in five is the wrapper's."""
    model = GPT(layers=4, dim=256, heads=4, vocab=128).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    tokens = torch.randint(0, 128, (4, 512), device="cuda")
    session = attach("tap", **{"steps.verify_every": 5})
    for _ in range(20):
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert session.flush(30)
    assert session.recorder.bypass.steps == 14  # 4-7, 9-12, 14-17, 19-20 (tests/test_bypass.py)
    reports = session.history()
    wrapper = [r for r in reports if r.step in (3, 8, 13, 18)]
    bypassed = [r for r in reports[3:] if r.step not in (8, 13, 18)]

    def rows(r):
        return [(c.site, c.impl, c.kept_bytes, c.standard_bytes) for c in r.calls]

    assert all(rows(r) == rows(wrapper[0]) for r in reports[1:])
    assert all(c.impl in ("flash", "cudnn", "efficient") for c in wrapper[0].calls)
    for kind in ("forward_seconds", "backward_seconds"):
        by_wrapper = statistics.median(getattr(c, kind) for r in wrapper for c in r.calls)
        by_order = statistics.median(getattr(c, kind) for r in bypassed for c in r.calls)
        print(f"{kind}: wrapper's steps {by_wrapper * 1e6:.1f} us, bypassed {by_order * 1e6:.1f} us")
        assert abs(by_order / by_wrapper - 1) < 0.25  # the same kernels, timed the same way
    assert session.devices.timer("cuda").marks_in_use() == 0
    assert session.errors == 0


def test_steady_bypassed_steps_close_in_cpp_at_the_optimizer_step(monkeypatch):
    """steps/quiet.py on a card: every bypassed step that opens another bypassed one is closed by
    the tap's C++ hook, not the Python boundary; each is reported as the wrapper measures it."""
    from fadiag.steps import quiet

    monkeypatch.setattr(quiet, "_CAP_S", 60.0)  # runs as long as the verify cadence allows
    model = GPT(layers=4, dim=256, heads=4, vocab=128).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    tokens = torch.randint(0, 128, (4, 512), device="cuda")
    session = attach("tap", **{"steps.verify_every": 10})
    handed: list[tuple[int, bool, bool]] = []  # index, bypassed, closed in C++
    submit = session.resolver.submit

    def written(step) -> None:  # a run of steps closed in C++ (QuietRun), or one the boundary's
        if isinstance(step, quiet.QuietRun):
            handed.extend((step.first + i, step.order is not None, True) for i in range(len(step)))
        else:
            handed.append((step.index, step.order is not None, False))
        submit(step)

    session.resolver.submit = written

    def steps(n: int, flush: bool) -> None:
        for _ in range(n):
            model(tokens).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if flush:
                assert session.flush(30)

    steps(3, flush=True)  # the signatures, then the order learned
    steps(40, flush=False)  # 4-12 bypassed, 13 verifies; ... 34-42, 43
    assert session.flush(30)
    closed = [i for i, _, in_cpp in handed if in_cpp]
    # Each bypassed step that opens another, but step 4, whose hook the flush before it disarmed.
    assert closed == [a[0] for a, b in zip(handed, handed[1:], strict=False)
                      if a[1] and b[1] and a[0] != 4]
    assert len(closed) == session.recorder.quiet.closed == 31
    reports = session.history()
    assert [r.step for r in reports] == list(range(1, 44))
    sites = [c.site for c in reports[2].calls]
    for r in reports[3:]:
        assert [c.site for c in r.calls] == sites
        assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in r.calls)
    assert session.devices.timer("cuda").marks_in_use() == 0
    assert session.errors == 0


def test_the_hang_signal_sees_a_tapped_call_the_device_has_not_passed():
    import time

    session = attach("tap")
    q, k, v = qkv(1024, b=1)
    for _ in range(3):  # learn the signature: later calls are the tap's to time
        F.scaled_dot_product_attention(q, k, v).backward(torch.ones_like(q))
        fadiag.step()
    assert session.flush(30)
    torch.cuda._sleep(4_000_000_000)  # ~2 s of the GPU's clock: the call's marks wait behind it
    out = F.scaled_dot_product_attention(q, k, v)
    open_since = session.recorder.tap.oldest_open_ns()
    deadline, inflight = time.monotonic() + 1.5, 0.0
    while time.monotonic() < deadline and inflight < 0.5:
        time.sleep(0.05)
        inflight = session.resolver.oldest_inflight_seconds
    torch.cuda.synchronize()
    assert open_since >= 0 and inflight >= 0.5, (open_since, inflight)
    out.backward(torch.ones_like(out))
    fadiag.step()
    assert session.flush(30)
    assert session.last_step().calls[0].forward_seconds > 0
    assert session.recorder.tap.oldest_open_ns() == -1


def test_calls_on_a_side_stream_are_timed_on_that_stream(marks):
    side = torch.cuda.Stream()
    session = attach(marks)
    q, k, v = qkv(2048, b=2)
    with torch.cuda.stream(side):
        for _ in range(3):
            GpuBusy.apply(q)
            out = F.scaled_dot_product_attention(q, k, v)
            GpuBusy.apply(out).backward(torch.ones_like(out))
            fadiag.step()
    torch.cuda.current_stream().wait_stream(side)
    assert session.flush(30)
    call = session.last_step().calls[0]
    # the flash forward at this shape takes ~0.2 ms; a mark on the wrong stream would read ~0 or
    # include the 1 ms busy kernel
    assert 0.05e-3 < call.forward_seconds < 0.9e-3, call.forward_seconds
    assert session.errors == 0


# ---- torch.compile: the dispatcher tap ---------------------------------------------------------


def _compiled_gpt_step(mode: str | None = None):
    torch.manual_seed(0)
    model = GPT(layers=4, dim=256, heads=4).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = torch.compile(model, mode=mode)
    tokens = torch.randint(0, 64, (4, 512), device="cuda")

    def step() -> float:
        logits = run(tokens)
        loss = F.cross_entropy(logits.view(-1, 64).float(), tokens.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


@pytest.mark.parametrize("backend", [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                     SDPBackend.EFFICIENT_ATTENTION])
def test_compiled_model_reports_every_call_with_the_impl_that_ran(backend):
    torch._dynamo.reset()
    impl = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.CUDNN_ATTENTION: "cudnn",
            SDPBackend.EFFICIENT_ATTENTION: "efficient"}[backend]
    session = fadiag.attach(port=0, tap="on")
    assert session.tap_status == "installed"
    # Compiled-graph caches key on the graph, not on the SDPA backend switches: without them
    # off, a graph compiled under another backend comes back (and fadiag reports what ran).
    with sdpa_kernel(backend), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        step = _compiled_gpt_step()
        for _ in range(3):
            step()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    assert session.flush(30)
    ran = {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product_")}
    assert f"aten::_scaled_dot_product_{impl}_attention" in ran, ran  # torch's own account
    report = session.last_step()
    seen = [(c.site, c.impl, c.forward_seconds, c.backward_seconds, c.kept_bytes) for c in report.calls]
    assert [c.site for c in report.calls] == [f"compiled#{i}" for i in range(4)], (seen, report.unmeasured)
    assert {c.impl for c in report.calls} == {impl}, seen
    assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in report.calls), seen
    assert all(c.kept_bytes and c.kept_bytes < c.standard_bytes for c in report.calls), seen
    assert session.errors == 0


def test_a_new_process_measures_the_first_compiled_step_with_the_default_tap(native_marks_built):
    """As a user runs it: a new interpreter, the default `tap: auto`, the CUDA build cached by an
    earlier run (the fixture's): the tap is installed at attach(), so the first compiled step's
    attention is measured, with the impl that ran."""
    import subprocess
    import textwrap
    from pathlib import Path

    assert native_marks_built is not None
    script = textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        import fadiag
        from tests.models import GPT
        torch.manual_seed(0)
        model = GPT(layers=2, dim=128, heads=2, vocab=64).cuda().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        run = torch.compile(model)
        tokens = torch.randint(0, 64, (2, 256), device="cuda")
        session = fadiag.attach(port=0)
        print(session.tap_status)
        for _ in range(2):
            run(tokens).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert session.flush(30) and session.errors == 0
        for r in session.history():
            print(r.step, [(c.site, c.impl, c.forward_seconds > 0, c.backward_seconds > 0)
                           for c in r.calls], r.unmeasured)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    impl = next((i for i in ("flash", "cudnn", "efficient") if f"'{i}'" in lines[1]), None)
    calls = [(f"compiled#{i}", impl, True, True) for i in range(2)]  # whichever fused one ran
    assert impl and lines == ["installed", f"1 {calls} {{}}", f"2 {calls} {{}}"], done.stdout


def test_ten_thousand_compiled_steps_keep_device_memory_rss_and_marks_flat():
    import psutil

    torch._dynamo.reset()
    session = fadiag.attach(port=0, tap="on")
    assert session.tap_status == "installed"
    torch.manual_seed(0)
    model = GPT(layers=2, dim=128, heads=2, vocab=128).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    run = torch.compile(model)
    tokens = torch.randint(0, 128, (2, 256), device="cuda")

    def steps(n):
        for _ in range(n):
            run(tokens).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    steps(300)  # compiles, warms up; the allocator and the mark pool reach their working size
    assert session.flush(30)
    rss0, mem0 = psutil.Process().memory_info().rss, torch.cuda.memory_allocated()
    steps(10_000)
    assert session.flush(60)
    rss1, mem1 = psutil.Process().memory_info().rss, torch.cuda.memory_allocated()
    report = session.last_step()
    print(f"allocated {mem0} -> {mem1} bytes; RSS {rss0 >> 20} -> {rss1 >> 20} MiB; "
          f"tap {session.tap_status}; unmeasured {session.recorder.unmeasured_totals()}")
    assert report.step == 10_300
    assert [c.site for c in report.calls] == ["compiled#0", "compiled#1"]
    assert mem1 == mem0
    # Step reports are kept in a bounded history and the resolver's caches are bounded: 10 000
    # steps must not grow the process by more than noise (the history's own bound included).
    assert rss1 - rss0 < 64 << 20, (rss0, rss1)
    assert session.devices.timer("cuda").marks_in_use() == 0
    assert session.errors == 0


def test_cuda_graph_replays_of_compiled_attention_are_counted():
    torch._dynamo.reset()
    session = fadiag.attach(port=0, tap="on")
    step = _compiled_gpt_step("reduce-overhead")
    for _ in range(8):
        step()
    assert session.flush(30)
    totals = session.recorder.unmeasured_totals()
    assert totals.get("cuda_graph", 0) >= 4, totals  # 4 layers' forwards, per replay
    assert session.errors == 0


@pytest.mark.parametrize("marks", ["tap", "native", "python"])
def test_an_eager_cuda_graph_capture_succeeds_and_its_calls_are_counted(marks):
    """`torch.cuda.graph` over eager SDPA, in its default "global" mode, in which a timing event
    recorded or a stream or event queried on any thread invalidates the capture: the wrapper
    takes no mark there and the resolver, polling the marks of a step the device has not passed
    (a 0.5 s sleep queued ahead), queries them from its own thread all through the capture."""
    session = attach(marks)
    captured, static = capture_behind_a_pending_step(session, replays=2)
    fadiag.step()
    assert session.flush(30)
    torch.testing.assert_close(captured, F.scaled_dot_product_attention(static, static, static))
    assert session.errors == 0
    totals = session.recorder.unmeasured_totals()
    if marks == "tap":  # the tap sees the capture and counts each replay
        assert totals.get("cuda_graph") == 2 and not totals.get("graph_capture"), totals
    else:
        assert totals.get("graph_capture") == 1, totals
    assert 4 in [r.step for r in session.history()]  # resolved while the capture ran


@pytest.mark.parametrize("marks", ["tap", "native", "python"])
def test_a_measured_forward_whose_backward_is_captured_into_a_graph_is_counted_unmeasured(marks):
    """The forward runs eagerly on a side stream (measured), its backward is captured into a CUDA
    graph on that stream (autograd runs a backward on its forward's stream): no mark can be
    taken in the capture, so the call is reported unmeasured (graph_capture_backward), not with
    a backward of 0, and the step's ratio is not lowered by it. The capture and its replay
    work."""
    session = attach(marks)
    q = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    for _ in range(3):  # the signature learned, measured whole
        F.scaled_dot_product_attention(q, q, q).sum().backward()
        fadiag.step()
    assert session.flush(30)
    assert session.last_step().calls[0].backward_seconds > 0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = F.scaled_dot_product_attention(q, q, q)
    grad = torch.ones_like(out)
    q.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out.backward(grad, retain_graph=True)
    graph.replay()
    torch.cuda.synchronize()
    fadiag.step()
    assert session.flush(30)
    assert session.errors == 0
    expected = q.detach().clone().requires_grad_()
    F.scaled_dot_product_attention(expected, expected, expected).backward(grad)
    torch.testing.assert_close(q.grad, expected.grad)  # the replay computed the gradient
    last = session.last_step()
    assert last.calls == [] and last.unmeasured.get("graph_capture_backward") == 1, last
    assert session.recorder.unmeasured_totals()["graph_capture_backward"] == 1
    F.scaled_dot_product_attention(q, q, q).sum().backward()
    fadiag.step()
    assert session.flush(30)  # the next step (the reference call's and this one) measured whole
    assert [c.backward_seconds > 0 for c in session.last_step().calls] == [True, True]


def test_a_captured_last_backward_closes_the_backward_window_the_tap_opened():
    """Two measured forwards; the first one's backward runs eagerly (the tap opens the backward
    window: the training thread is blocked in backward() and the resolver may take the GIL), the
    second one's is captured into a CUDA graph. That was the last backward the pass awaited, so
    the window ends there, not at the next step boundary: a window left open lets the resolver
    run Python while the training thread does."""
    session = attach("tap")
    timer = session.devices.timer("cuda")
    a = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    b = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    for _ in range(3):  # both signatures learned (one shape): linked calls from here
        (F.scaled_dot_product_attention(a, a, a).sum()
         + F.scaled_dot_product_attention(b, b, b).sum()).backward()
        fadiag.step()
    assert session.flush(30)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out_a = F.scaled_dot_product_attention(a, a, a)
        out_b = F.scaled_dot_product_attention(b, b, b)
        out_a.sum().backward()
    assert timer.window()  # one backward of two: the window is open
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out_b.backward(torch.ones_like(out_b), retain_graph=True)
    assert not timer.window()  # the pass's last awaited backward ran (captured)
    graph.replay()
    torch.cuda.synchronize()
    fadiag.step()
    assert session.flush(30)
    assert session.errors == 0
    last = session.last_step()
    assert len(last.calls) == 1 and last.calls[0].backward_seconds > 0, last
    assert last.unmeasured.get("graph_capture_backward") == 1, last


# ---- flex_attention inside a compiled model -----------------------------------------------------


class _FlexGPT(torch.nn.Module):
    """Causal flex_attention layers, trained (flex has a backward on CUDA)."""

    def __init__(self, layers: int, dim: int, heads: int, seq: int):
        from torch.nn.attention.flex_attention import create_block_mask

        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(64, dim)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, 64)
        self.mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seq, seq,
                                      device="cuda")

    def forward(self, tokens):
        from torch.nn.attention.flex_attention import flex_attention

        b, s = tokens.shape
        x = self.emb(tokens)
        for proj in self.qkv:
            q, k, v = proj(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            x = x + flex_attention(q, k, v, block_mask=self.mask).transpose(1, 2).reshape(b, s, -1)
        return self.head(x)


def test_flex_inside_a_compiled_model_counts_its_forward_and_backward_calls_each_step():
    torch._dynamo.reset()
    session = fadiag.attach(port=0)
    torch.manual_seed(0)
    model = _FlexGPT(layers=4, dim=256, heads=4, seq=512).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = torch.compile(model)
    tokens = torch.randint(0, 64, (2, 512), device="cuda")
    for _ in range(3):
        F.cross_entropy(run(tokens).view(-1, 64).float(), tokens.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert session.flush(30)
    counted = [r.unmeasured for r in session.history()]
    assert counted == [{"flex_compiled": 4, "flex_compiled_backward": 4}] * 3, counted
    assert session.errors == 0


def test_measured_compiled_flex_backward_is_not_counted_as_flex_compiled_backward():
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    session = fadiag.attach(port=0)
    fn = torch.compile(flex_attention)
    q, k, v = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    for _ in range(3):
        fn(q, k, v).sum().backward()
        fadiag.step()
    assert session.flush(30)
    calls = [c for r in session.history() for c in r.calls]
    # The first call compiled (counted as compiling, untimed); the others are measured.
    assert len(calls) == 2 and {c.impl for c in calls} == {"flex"}, calls
    assert all(c.backward_seconds > 0 for c in calls), calls
    totals = session.recorder.unmeasured_totals()
    assert "flex_compiled" not in totals and "flex_compiled_backward" not in totals, totals
    assert session.errors == 0
