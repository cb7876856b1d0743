"""The native (C++) marks, on CPU: the same measurements as the Python marks, and safe fallbacks.

The CPU build of `fadiag/capture/_native/marks.cpp` takes host-clock marks in C++ and hooks backward nodes
in C++, exactly as the CUDA build does with events; the CUDA build is tested on the GPU machine.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import fadiag
from fadiag.capture import native
from fadiag.capture.device import CpuTimer, Devices, EventTimer, NativeTimer
from tests.models import GPT, train
from tests.native_marks import NEEDS_NATIVE

pytestmark = NEEDS_NATIVE


@pytest.fixture(scope="module")
def ext():
    module = native.load("cpu")
    assert module is not None, native.status("cpu")
    return module


def attach(**kw):
    """These tests are of the wrapper's own native marks and C++ hooks: no dispatcher tap, which
    would time the learned calls itself (tests/test_linked.py)."""
    kw.setdefault("port", 0)
    kw.setdefault("tap", "off")
    return fadiag.attach(**kw)


def resolved(session):
    assert session.flush(10)
    return session.last_step()


def test_native_marks_time_every_call_forward_and_backward(ext):
    s = attach(native="on")
    assert isinstance(s.devices.timer("cpu"), NativeTimer)
    model = GPT(layers=3)
    train(model, steps=3)
    r = resolved(s)
    assert r.step == 3 and len(r.calls) == 3
    assert [c.site for c in r.calls] == [c.site for c in s.history()[0].calls]
    for c in r.calls:
        assert c.impl == "cpu_flash"
        assert 0 < c.forward_seconds < 1 and 0 < c.backward_seconds < 1
    assert s.errors == 0 and not s.recorder.python_hooks  # the C++ hooks fired every step


@pytest.mark.parametrize("mode", [None, "reentrant", "non_reentrant"])
def test_training_is_bit_identical_with_native_marks(ext, mode):
    def run():
        torch.manual_seed(0)
        model = GPT(layers=2, checkpointing=mode)
        return train(model, steps=4), [p.detach().clone() for p in model.parameters()]

    plain_losses, plain_params = run()
    s = attach(native="on")
    losses, params = run()
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    r = resolved(s)
    assert r.backward_seconds > 0 and s.errors == 0
    if mode is not None:  # the recomputed forwards are marked, not counted as forward time
        assert sum(c.recompute for c in r.calls) == 2 and len(r.calls) == 4


def test_micro_batches_are_one_step_with_native_hooks(ext):
    """Phases (a forward after a backward) are seen through the C++ hooks' counter."""
    s = attach(native="on")
    train(GPT(layers=2), steps=2, micro_batches=4)
    r = resolved(s)
    assert r.step == 2 and len(r.calls) == 8
    assert [c.site for c in r.calls[:2]] == [c.site for c in r.calls[2:4]]  # same sites per pass
    assert all(c.backward_seconds > 0 for c in r.calls)


def test_without_optimizer_each_pass_becomes_a_step_with_native_hooks(ext):
    s = attach(native="on", **{"steps.fallback_after": 3})
    model = GPT(layers=1)
    for _ in range(6):
        model(torch.randint(0, 64, (2, 16))).sum().backward()
    model(torch.randint(0, 64, (2, 16)))  # the forward that closes the sixth pass
    assert s.resolver.flush(10)
    assert [len(r.calls) for r in s.history()] == [1] * 6
    assert all(r.backward_seconds > 0 for r in s.history())


def hooked(ext):
    """A CPU pool whose slots 0 and 1 are hooked to the backward of one SDPA call."""
    marks = ext.Marks(False)
    marks.ensure(2)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    out = F.scaled_dot_product_attention(q, q, q)
    assert marks.hook(out, 0, 1, [])
    return marks, out


def test_a_released_slot_disarms_the_hook_still_holding_it(ext):
    marks, out = hooked(ext)
    marks.release(0)
    marks.release(1)
    out.sum().backward()
    assert not marks.recorded(0) and not marks.recorded(1)
    assert marks.errors() == 0 and marks.in_backward() == 0


def test_hooked_backward_fills_both_slots_once(ext):
    marks, out = hooked(ext)
    out.sum().backward(retain_graph=True)
    assert marks.done(0) and marks.done(1)
    first = marks.elapsed(0, 1)
    assert first >= 0
    out.sum().backward()  # a second backward over the same graph does not move the marks
    assert marks.elapsed(0, 1) == first
    assert marks.backward_starts() == 1 and marks.in_backward() == 0


def test_hook_refuses_a_tensor_without_grad_fn_or_a_broken_path(ext):
    marks = ext.Marks(False)
    marks.ensure(2)
    assert not marks.hook(torch.randn(3), 0, 1, [])
    out = F.scaled_dot_product_attention(*(torch.randn(1, 1, 4, 4, requires_grad=True),) * 3)
    assert not marks.hook(out, 0, 1, [99])


def test_take_and_finish_hand_out_slots_and_give_them_back(ext):
    marks = ext.Marks(False)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    start = marks.take()
    out = F.scaled_dot_product_attention(q, q, q)
    fwd, bwd0, bwd1 = marks.finish(out, [], start)
    assert len({start, fwd, bwd0, bwd1}) == 4 and marks.slots() == 4
    assert marks.done(start) and marks.done(fwd) and marks.elapsed(start, fwd) >= 0
    assert not marks.recorded(bwd0) and not marks.recorded(bwd1)
    out.sum().backward()
    assert marks.done(bwd0) and marks.done(bwd1) and marks.elapsed(bwd0, bwd1) >= 0
    for slot in (start, fwd, bwd0, bwd1, None):
        marks.give_back(slot)
    assert not marks.recorded(start)
    assert {marks.take() for _ in range(4)} == {start, fwd, bwd0, bwd1}  # reused, none new
    assert marks.slots() == 4 and marks.errors() == 0


def test_finish_on_an_output_without_grad_fn_gives_the_hook_slots_back(ext):
    marks = ext.Marks(False)
    with torch.no_grad():
        out = F.scaled_dot_product_attention(*(torch.randn(1, 1, 4, 4),) * 3)
    fwd, bwd0, bwd1 = marks.finish(out, [], marks.take())
    assert marks.done(fwd) and bwd0 is None and bwd1 is None
    assert marks.take() != fwd and marks.slots() == 4  # the two hook slots went back to the pool


def test_seconds_reads_a_whole_step_in_one_call(ext):
    marks = ext.Marks(False)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    steps = []
    for _ in range(2):
        start = marks.take()
        out = F.scaled_dot_product_attention(q, q, q)
        steps.append((start, *marks.finish(out, [], start)))
        out.sum().backward()
    flat = [s for call in steps for s in call]
    secs = marks.seconds(flat, False)  # per call: forward, backward seconds, host ns each holds
    assert len(secs) == 8 and all(x >= 0 for x in secs)
    assert secs[0] == marks.elapsed(steps[0][0], steps[0][1])
    assert secs[5] == marks.elapsed(steps[1][2], steps[1][3])
    assert secs[2:4] == secs[6:8] == [0.0, 0.0]  # a CPU window is host time: none is "held"
    marks.give_back_all(flat)
    assert marks.slots() == 8 and not marks.recorded(flat[0])


def test_seconds_waits_for_a_started_backward_until_told_to_give_up(ext):
    marks = ext.Marks(False)
    f0, f1, b0, b1 = marks.take(), marks.take(), marks.take(), marks.take()
    marks.mark(b0)  # the backward started; its end mark never came
    marks.give_back(b1)
    assert marks.seconds([f0, f1, b0, b1], False) is None
    fwd, bwd, _, held = marks.seconds([f0, f1, b0, b1], True)
    assert fwd >= 0 and bwd == 0.0 and held == 0.0
    fwd, bwd, _, _ = marks.seconds([f0, f1, -1, -1], False)  # no backward hooked: 0, nothing to wait for
    assert fwd >= 0 and bwd == 0.0


def test_seconds_of_a_call_whose_forward_mark_failed_are_nan(ext):
    marks = ext.Marks(False)
    f0, f1 = marks.take(), marks.take()
    marks.give_back(f1)  # as if its record had failed: never recorded
    fwd, bwd, _, _ = marks.seconds([f0, f1, -1, -1], False)
    assert fwd != fwd and bwd != bwd


def test_the_backward_window_spans_the_hooked_backwards(ext):
    """Open from a hooked backward's start until every hooked call's backward has ended."""
    marks = ext.Marks(False)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    out1 = F.scaled_dot_product_attention(q, q, q)
    marks.finish(out1, [], marks.take())
    x = out1 * 2
    out2 = F.scaled_dot_product_attention(x, x, x)
    marks.finish(out2, [], marks.take())
    seen = {}

    def look(when):
        def hook(grad):
            seen[when] = marks.window()
        return hook

    x.register_hook(look("between"))
    q.register_hook(look("after"))
    assert not marks.window()
    out2.sum().backward()
    assert seen == {"between": True, "after": False}
    assert not marks.window() and not marks.wait_window(0.01)


def test_wake_window_ends_a_wait_at_once_and_a_wake_before_the_wait_is_kept(ext):
    """flush() must not sit out the resolver's wait for a backward window (up to 0.1 s a wait,
    on a GPU-bound step most of what a flush took): it ends the wait at once."""
    marks = ext.Marks(False)
    marks.wake_window()  # before any wait: the next one returns at once
    assert marks.wait_window(30.0)
    assert not marks.wait_window(0.01)  # the wake was used up: no window, nothing to wake it
    result = {}

    def wait():
        result["ready"] = marks.wait_window(30.0)
        result["at"] = time.monotonic()

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    woke = time.monotonic()
    marks.wake_window()
    waiter.join(30.0)
    assert result["ready"] and result["at"] - woke < 10.0  # not the wait's 30 s
    assert not marks.window()


def test_flush_and_detach_end_the_resolvers_wait_for_a_backward_window(ext):
    s = attach(native="on")
    timer = s.devices.timer("cpu")
    woken = []
    wake = timer.wake_window
    timer.wake_window = lambda: (woken.append("wake"), wake())[1]
    train(GPT(layers=2), steps=2)
    assert s.flush(30) and woken == ["wake"]
    assert s.last_step().step == 2
    fadiag.detach()  # stop(): its flush, then the thread's own wait ended too
    assert woken == ["wake"] * 3


def test_a_graph_freed_without_backward_does_not_hold_the_window_open(ext):
    marks = ext.Marks(False)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    dropped = F.scaled_dot_product_attention(q, q, q)
    marks.finish(dropped, [], marks.take())
    del dropped  # evaluation with grad on, an unused output: its hooks go with its graph
    out = F.scaled_dot_product_attention(q, q, q)
    marks.finish(out, [], marks.take())
    out.sum().backward()
    assert marks.backward_starts() == 1 and not marks.window()


def test_steps_are_resolved_while_a_backward_holds_the_window_open(ext):
    """A closed step waits for the next backward; it is resolved while that backward runs."""
    s = attach(native="on")
    timer = s.devices.timer("cpu")
    report = s.resolver._report
    window_at_report = []

    def recording(step, timed):
        window_at_report.append(timer.window())
        report(step, timed)

    s.resolver._report = recording

    class WaitForStep1(torch.autograd.Function):
        """Holds the backward (between two hooked attention backwards) until step 1 is in."""

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            deadline = time.monotonic() + 5.0
            while s.last_step() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            return g

    q = torch.randn(1, 2, 8, 4, requires_grad=True)

    def step():
        y = WaitForStep1.apply(F.scaled_dot_product_attention(q, q, q))
        F.scaled_dot_product_attention(y, y, y).sum().backward()
        fadiag.step()

    step()
    step()
    assert s.history()[0].step == 1 and window_at_report[0] is True
    assert resolved(s).step == 2 and s.errors == 0


def test_a_mark_that_fails_in_cpp_is_counted_as_an_internal_error(ext):
    s = attach(native="on")
    timer = s.devices.timer("cpu")
    assert not timer._marks.mark(10**9)  # no such slot: counted in C++, never raised
    train(GPT(layers=1), steps=1)
    resolved(s)
    assert s.errors == 1


def test_a_failed_build_falls_back_to_python_marks(monkeypatch, caplog):
    monkeypatch.setattr(native, "_modules", {})
    monkeypatch.setattr(native, "_failures", {})

    def no_compiler(kind):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(native, "_build", no_compiler)
    with caplog.at_level(logging.INFO, logger="fadiag"):
        s = attach(native="on")
        train(GPT(layers=1), steps=2)
    assert isinstance(s.devices.timer("cpu"), CpuTimer)
    assert resolved(s).backward_seconds > 0 and s.errors == 0
    assert native.status("cpu").startswith("unavailable: RuntimeError: Ninja is required")
    assert "native marks for cpu unavailable" in caplog.text


@pytest.mark.parametrize("setting", ["off", "auto"])
def test_off_and_auto_never_build_for_cpu(monkeypatch, setting):
    def forbidden(kind):
        raise AssertionError(f"built native marks for {kind}")

    monkeypatch.setattr(native, "load", forbidden)
    monkeypatch.setattr(native, "load_in_background", forbidden)
    s = attach(native=setting, tap="off")  # the tap builds the same extension: see below
    train(GPT(layers=1), steps=2)
    assert isinstance(s.devices.timer("cpu"), CpuTimer)
    assert resolved(s).step == 2 and s.errors == 0


@pytest.mark.parametrize("compiled_before", [False, True])
def test_a_tap_still_building_at_attach_is_installed_at_a_step_boundary_and_says_from_which_step(
        monkeypatch, caplog, compiled_before):
    """`tap: auto` (the default) with no fresh build cached builds the extension off the training
    thread and installs the tap at the next step boundary, on the training thread; the log names
    the step it measures from, as a warning where torch.compile'd code ran before it (whose
    attention went unseen)."""
    asked = []
    monkeypatch.setattr(native, "load", lambda kind: pytest.fail("attach() waited for a build"))
    monkeypatch.setattr(native, "load_in_background", lambda kind, ready: asked.append((kind, ready)))
    monkeypatch.setattr(native, "status", lambda kind: "not built")
    monkeypatch.setattr(native, "fresh", lambda kind: False)
    with caplog.at_level(logging.INFO, logger="fadiag"):
        s = attach(native="off", tap="auto")
        assert s.tap_status == "loading" and asked and asked[0][0] == "cpu"
        assert "building the native extension for cpu in the background" in caplog.text
        model = GPT(layers=1)
        train(torch.compile(model, backend="eager") if compiled_before else model, steps=1)
        build = threading.Thread(target=asked[0][1], args=(native._modules["cpu"],))
        build.start()  # as the build thread calls it when the build is done
        build.join()
        assert s.tap_status == "loading"  # not installed from that thread
        train(GPT(layers=1), steps=2)  # installed as step 2 closes: step 3 is its first
    assert s.tap_status == "installed" and s.recorder.tap is not None
    said = [r for r in caplog.records if "dispatcher tap installed at step 3" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING if compiled_before else logging.INFO]
    assert ("before it was not measured" in said[0].getMessage()) == compiled_before


def test_auto_loads_a_fresh_cached_build_at_attach_and_installs_the_tap_there(monkeypatch):
    """A build already cached (and not older than its sources) loads in ~0.1 s: `tap: auto` loads
    it at attach(), so the first step's compiled attention is measured (a tap installed at the
    first boundary would miss it, with nothing to tell that step from one without attention)."""
    loaded = []
    monkeypatch.setattr(native, "load_in_background",
                        lambda kind, ready: pytest.fail("a fresh cached build went to the background"))
    monkeypatch.setattr(native, "status", lambda kind: "not built")
    monkeypatch.setattr(native, "fresh", lambda kind: True)
    monkeypatch.setattr(native, "load", lambda kind: loaded.append(kind) or native._modules[kind])
    s = attach(native="off", tap="auto")
    assert loaded == ["cpu"] and s.tap_status == "installed" and s.recorder.tap is not None


def test_a_cached_build_is_fresh_only_if_no_source_is_newer_and_no_build_is_under_way(
        tmp_path, monkeypatch):
    import os

    sources, folder = tmp_path / "src", tmp_path / "build"
    sources.mkdir()
    folder.mkdir()
    for name in ("marks.cpp", "pool.h"):
        (sources / name).write_text("")
    monkeypatch.setattr(native, "SOURCES", (sources / "marks.cpp",))
    monkeypatch.setattr(native, "_build_dir", lambda kind: folder)
    assert not native.fresh("cpu")  # nothing built
    built = folder / "fadiag_marks_cpu.so"
    built.write_text("")
    now = time.time()
    for p in sources.iterdir():
        os.utime(p, (now - 100, now - 100))
    os.utime(built, (now - 50, now - 50))
    assert native.fresh("cpu")
    os.utime(sources / "pool.h", (now, now))  # a header edited after the build: ninja rebuilds
    assert not native.fresh("cpu")
    os.utime(sources / "pool.h", (now - 100, now - 100))
    (folder / "lock").write_text("")  # another process is building there
    assert not native.fresh("cpu")


def test_the_background_build_leaves_the_import_system_alone():
    """The build thread must not change `sys.meta_path` or `sys.path`: another thread importing
    while a list it walks changes can step past the path finder (ModuleNotFoundError in the
    user's import). In a fresh process (setuptools not yet imported, as after `import torch`),
    every change to either list made while `tap: auto` attaches and the extension loads comes
    from the attaching thread."""
    import subprocess

    script = """
import sys, threading, time
import torch
import fadiag
from fadiag.capture import native

class Watched(list):
    def __init__(self, items, name):
        super().__init__(items)
        self.name = name
    def _note(self, what):
        CHANGES.append((self.name, what, threading.current_thread().name))
    def insert(self, i, x):
        self._note("insert"); super().insert(i, x)
    def append(self, x):
        self._note("append"); super().append(x)
    def extend(self, xs):
        self._note("extend"); super().extend(xs)
    def remove(self, x):
        self._note("remove"); super().remove(x)
    def pop(self, *a):
        self._note("pop"); return super().pop(*a)
    def __setitem__(self, i, x):
        self._note("setitem"); super().__setitem__(i, x)
    def __delitem__(self, i):
        self._note("delitem"); super().__delitem__(i)

CHANGES = []
assert "setuptools" not in sys.modules
sys.meta_path = Watched(sys.meta_path, "meta_path")
sys.path = Watched(sys.path, "path")
s = fadiag.attach(port=0, tap="auto")
deadline = time.monotonic() + 600
while native.status("cpu") not in ("loaded",) and not native.status("cpu").startswith("unavailable"):
    assert time.monotonic() < deadline, native.status("cpu")
    time.sleep(0.05)
print("STATUS", native.status("cpu"))
print("SETUPTOOLS", "setuptools" in sys.modules)
print("OTHER", [c for c in CHANGES if c[2] != threading.main_thread().name])
fadiag.detach()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines.get("STATUS") == "loaded", out.stdout + out.stderr
    assert lines.get("SETUPTOOLS") == "True", out.stdout  # the builder's imports did run
    assert lines.get("OTHER") == "[]", out.stdout


def test_a_bad_native_setting_is_a_config_error():
    with pytest.raises(fadiag.ConfigError, match="native must be one of"):
        attach(native="yes")


def test_steps_resolve_without_flush_when_no_backward_follows(ext):
    """The resolver waits for the next backward only up to its deferral limit."""
    s = attach(native="on")
    train(GPT(layers=1), steps=3)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and (s.last_step() is None or s.last_step().step < 3):
        time.sleep(0.05)
    assert s.last_step() is not None and s.last_step().step == 3
    assert s.last_step().backward_seconds > 0 and s.errors == 0


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.write_text("")
    now = lock.stat().st_mtime
    assert not native.clear_stale_lock(tmp_path, now=now + 60)  # another process is building
    assert lock.exists()
    with caplog.at_level(logging.WARNING, logger="fadiag"):
        assert native.clear_stale_lock(tmp_path, now=now + native.STALE_LOCK_S + 1)
    assert not lock.exists() and "stale extension build lock" in caplog.text
    assert not native.clear_stale_lock(tmp_path)  # nothing there: nothing to do


def _fake_build(monkeypatch, folder, seen: list):
    """native._build against `folder`, with torch's builder replaced by one that records whether
    its lock file was there when it was called and when."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(native, "_build_dir", lambda kind: folder)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(
        ((folder / "lock").exists(), time.monotonic())) or SimpleNamespace(name=kw["name"]))


@pytest.mark.skipif(sys.platform == "win32", reason="the build claim is an flock")
def test_a_build_lock_whose_builder_is_gone_is_removed_at_once(tmp_path, monkeypatch, caplog):
    # A job that attached while the marks built in the background, and ended (or was killed)
    # before the build did, leaves torch's lock: every later build would wait on it.
    (tmp_path / "lock").write_text("")
    seen: list = []
    _fake_build(monkeypatch, tmp_path, seen)
    with caplog.at_level(logging.WARNING, logger="fadiag"):
        assert native._build("cpu").name == "fadiag_marks_cpu"
    assert [lock for lock, _ in seen] == [False]
    assert "its builder is gone" in caplog.text


@pytest.mark.skipif(sys.platform == "win32", reason="the build claim is an flock")
def test_a_build_waits_for_a_live_builder_and_takes_over_when_it_dies(tmp_path, monkeypatch):
    import subprocess

    # Another process builds: it holds the claim and torch's lock, and is killed mid-build.
    builder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys, time
fd = os.open({str(tmp_path / native.CLAIM)!r}, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
open({str(tmp_path / "lock")!r}, "w").close()
print("building", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "building"
        seen: list = []
        _fake_build(monkeypatch, tmp_path, seen)
        done = threading.Event()
        t = threading.Thread(target=lambda: native._build("cpu") and done.set(), daemon=True)
        t.start()
        assert not done.wait(1.0)  # a live builder: this one waits for it
        assert seen == [] and (tmp_path / "lock").exists()
        killed = time.monotonic()
        builder.kill()
        builder.wait(10)
        assert done.wait(10)
        (lock, at), = seen
        assert not lock and at >= killed  # its lock removed, once the claim was free
    finally:
        builder.kill()
        builder.wait(10)
        builder.stdout.close()


@pytest.mark.parametrize("around", ["backward", "forward_and_backward"])
def test_compiled_autograd_still_trains_with_native_marks(ext, around):
    """C++ node hooks cannot describe themselves to compiled autograd, so they opt out of its
    graph: gradients are unchanged and nothing fails. Switched on at forward time, fadiag uses
    Python hooks, which it runs, so those backwards are timed."""
    from torch._dynamo import compiled_autograd

    def run():
        torch.manual_seed(0)
        q = torch.randn(1, 2, 16, 8, requires_grad=True)
        grads = []
        for _ in range(3):
            with compiled_autograd._enable(torch.compile(backend="eager")):
                if around == "forward_and_backward":
                    F.scaled_dot_product_attention(q, q * 2, q * 3).sum().backward()
                else:
                    out = F.scaled_dot_product_attention(q, q * 2, q * 3)
            if around == "backward":
                with compiled_autograd._enable(torch.compile(backend="eager")):
                    out.sum().backward()
            grads.append(q.grad.clone())
            q.grad = None
            fadiag.step()
        return grads

    plain = run()
    s = attach(native="on")
    assert all(torch.equal(a, b) for a, b in zip(run(), plain, strict=True))
    assert s.flush(10) and s.errors == 0
    timed = [c.backward_seconds > 0 for r in s.history() for c in r.calls]
    assert len(timed) == 3 and timed[0]  # a signature's first call always has Python hooks
    if around == "forward_and_backward":
        assert all(timed)


def test_the_compiled_autograd_config_flag_is_read_at_step_boundaries(ext, monkeypatch):
    """`torch._dynamo.config.compiled_autograd` (a slow read, and per thread) is read at attach and
    at step boundaries, never per call: from the step after it is seen set, calls get Python
    backward hooks, which compiled autograd can run; after it is seen cleared, C++ hooks again."""
    import torch._dynamo
    from torch._dynamo import compiled_autograd  # noqa: F401  (what compiled code has loaded)

    from fadiag.steps import recorder

    monkeypatch.setattr(recorder, "_CONFIG_EVERY_S", 0.0)  # at every boundary
    s = attach(native="on")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    F.scaled_dot_product_attention(q, q * 2, q * 3).sum().backward()  # learns the signature
    fadiag.step()

    def hooked_in_cpp() -> bool:
        F.scaled_dot_product_attention(q, q * 2, q * 3)  # no backward yet
        hooked = s.recorder.calls[-1].bwd0 is not None  # C++ hooks take their slots at once
        fadiag.step()
        return hooked

    assert hooked_in_cpp()
    with torch._dynamo.config.patch(compiled_autograd=True):
        assert hooked_in_cpp()  # read at the last boundary, before it was set
        assert not hooked_in_cpp()
    assert not hooked_in_cpp()
    assert hooked_in_cpp()
    assert s.flush(10) and s.errors == 0


def test_the_compiled_autograd_config_flag_is_read_once_a_second_at_most(ext, monkeypatch):
    from fadiag.steps import recorder

    reads = []
    monkeypatch.setattr(recorder, "compiled_autograd_configured", lambda: reads.append(1) or False)
    s = attach(native="on")
    t0 = time.monotonic()
    train(GPT(layers=1), steps=40)
    elapsed = time.monotonic() - t0
    assert 1 <= len(reads) <= 2 + elapsed / recorder._CONFIG_EVERY_S  # at attach, then per second
    assert s.flush(10) and s.errors == 0


def test_a_background_build_serves_every_session_that_asked_during_it(monkeypatch):
    monkeypatch.setattr(native, "_modules", {})
    monkeypatch.setattr(native, "_failures", {})
    monkeypatch.setattr(native, "_waiters", {})
    release = threading.Event()
    built = object()

    def slow_build(kind):
        release.wait(5)
        return built

    monkeypatch.setattr(native, "_build", slow_build)
    got: list[object] = []
    native.load_in_background("cpu", got.append)
    native.load_in_background("cpu", got.append)  # a second session while the first builds
    assert native.status("cpu") == "building"
    release.set()
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [built, built] and native.status("cpu") == "loaded"
    native.load_in_background("cpu", got.append)  # later sessions get it at once
    assert got == [built] * 3


def test_a_callback_that_fails_leaves_python_marks_and_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(native, "_modules", {"cpu": object()})

    def broken(module):
        raise RuntimeError("no Marks here")

    with caplog.at_level(logging.WARNING, logger="fadiag"):
        native.load_in_background("cpu", broken)
    assert "native marks loaded but not used (RuntimeError: no Marks here)" in caplog.text


@pytest.mark.parametrize("when", ["already_loaded", "loaded_in_the_background"])
def test_auto_uses_native_marks_on_cuda_once_the_extension_is_loaded(monkeypatch, caplog, when):
    """An extension loaded before the first call is used from that call, never overwritten by
    the Python timer made meanwhile; one that loads later is swapped in."""
    ext = SimpleNamespace(Marks=mock.MagicMock(name="Marks"))
    release = threading.Event()
    monkeypatch.setattr(native, "_failures", {})
    monkeypatch.setattr(native, "_waiters", {})
    monkeypatch.setattr(native, "_building", set())
    if when == "already_loaded":
        monkeypatch.setattr(native, "_modules", {"cuda": ext})
    else:
        monkeypatch.setattr(native, "_modules", {})
        monkeypatch.setattr(native, "_build", lambda kind: release.wait(5) and ext)
    caplog.set_level(logging.INFO, logger="fadiag")
    devices = Devices(native="auto")
    first = devices.timer("cuda")
    if when == "loaded_in_the_background":
        assert isinstance(first, EventTimer)  # Python events until the load is done
        assert devices.marks() == {"cuda": "python"}
        release.set()
        deadline = time.monotonic() + 5
        while not devices.native_timers and time.monotonic() < deadline:
            time.sleep(0.01)
    timer = devices.timer("cuda")
    assert isinstance(timer, NativeTimer) and devices.native_timers == [timer]
    assert devices.timer("cuda") is timer and devices.marks() == {"cuda": "native"}
    ext.Marks.assert_called_once_with(True)
    assert caplog.text.count("native marks in use on cuda") == 1  # which marks run is said


def test_every_slot_comes_back_once_steps_are_resolved(ext):
    """Slots are handed out per call and given back when its step is resolved, including calls
    whose backward never ran (their graph freed) and the backward of a call inside no_grad."""
    s = attach(native="on")
    timer = s.devices.timer("cpu")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    for _ in range(20):
        F.scaled_dot_product_attention(q, q * 2, q * 3).sum().backward()
        F.scaled_dot_product_attention(q, q * 2, q * 3)  # its graph is freed, never run
        with torch.no_grad():
            F.scaled_dot_product_attention(q, q, q)
        fadiag.step()
    assert s.flush(10)
    assert timer.marks_in_use() == 0 and timer.pool_size() > 0
    F.scaled_dot_product_attention(q, q * 2, q * 3)  # an open step holds its call's slots
    assert timer.marks_in_use() == 4
    fadiag.step()
    assert s.flush(10) and timer.marks_in_use() == 0 and s.errors == 0


def test_a_call_whose_forward_marks_failed_is_left_out_of_its_step(ext):
    s = attach(native="on")
    timer = s.devices.timer("cpu")
    seconds = timer.seconds

    def first_failed(marks, give_up):
        out = seconds(marks, give_up)
        return out if out is None else [(float("nan"), float("nan"), 0, 0)] + out[1:]

    timer.seconds = first_failed
    model = GPT(layers=2)
    train(model, steps=1)
    r = resolved(s)
    assert len(r.calls) == 1 and r.forward_seconds == r.calls[0].forward_seconds > 0
    train(model, steps=1)
    assert resolved(s).step == 2
    assert timer.pool_size() == 4 * 2  # the second step reused the first one's slots
    assert timer.marks_in_use() == 0  # the failed call's slots came back too


def _workload() -> None:
    """Calls that the fast path must start exactly as Python does, or hand back to it: two call
    sites, micro-batches (phases), checkpointed recomputation, a backend switch, masks, dropout,
    grouped-query attention, a call without backward and one under no_grad."""
    torch.manual_seed(0)
    train(GPT(layers=2), steps=3, micro_batches=2)
    train(GPT(layers=2, checkpointing="non_reentrant"), steps=2)
    q = torch.randn(1, 4, 16, 8, requires_grad=True)
    kv = torch.randn(1, 2, 16, 8, requires_grad=True)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    for i in range(8):
        outs = [F.scaled_dot_product_attention(q, q, q, is_causal=i % 2 == 0),
                F.scaled_dot_product_attention(q, q, q, mask if i % 3 else None),
                F.scaled_dot_product_attention(q, q, q, dropout_p=0.5 if i == 5 else 0.0),
                F.scaled_dot_product_attention(q, kv, kv, None, 0.0, False, enable_gqa=True)]
        if i == 4:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                outs.append(F.scaled_dot_product_attention(q, q, q))
        sum(o.sum() for o in outs).backward()
        F.scaled_dot_product_attention(q, q, q)  # never backpropagated
        with torch.no_grad():
            F.scaled_dot_product_attention(q, q, q)
        fadiag.step()


def _run_workload(monkeypatch, fast: bool):
    if not fast:
        monkeypatch.setattr(NativeTimer, "fast_begin", lambda self, *state: None)
    s = attach(native="on")
    python_begins = []
    site = s.recorder._site
    s.recorder._site = lambda recompute: python_begins.append(1) or site(recompute)
    _workload()
    assert s.flush(10) and s.errors == 0
    reports = [(r.step, [(c.site, c.impl, c.shape, c.dtype, c.causal, c.dropout, c.recompute,
                          c.kv_heads, c.backward_seconds > 0) for c in r.calls])
               for r in s.history()]
    fadiag.detach()
    monkeypatch.undo()
    return reports, len(python_begins)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the fast path needs Python 3.11's frame API")
def test_the_fast_path_starts_calls_exactly_as_python_does(ext, monkeypatch):
    python_only, begins_python = _run_workload(monkeypatch, fast=False)
    with_fast, begins_fast = _run_workload(monkeypatch, fast=True)
    assert with_fast == python_only
    calls = sum(len(calls) for _, calls in with_fast)
    assert begins_python == calls
    # Python starts the first calls of each signature, each phase's first call after a
    # backward, recomputations and the no_grad call; the C++ path the rest.
    print(f"{calls} calls: {begins_fast} started in Python with the fast path, {begins_python} without")
    assert begins_fast < calls / 2, (begins_fast, calls)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the fast path needs Python 3.11's frame API")
def test_the_fast_path_makes_each_call_as_init_would_without_running_it(ext, monkeypatch):
    from fadiag.capture.calls import Call

    # The wrapper's steady call, not a bypassed step's (tests/test_bypass.py): verify_every 0.
    s = fadiag.attach(port=0, native="on", tap="on", **{"steps.verify_every": 0})
    model = GPT(layers=4)
    train(model, steps=3)  # the signature learned, the tap serving it: later calls are linked
    made_by_init: set[int] = set()
    init = Call.__init__

    def counted(self, *args, **kwargs):
        made_by_init.add(id(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(Call, "__init__", counted)
    before = time.monotonic_ns()
    model(torch.randint(0, 64, (2, 64)))  # one forward: the calls stay open, untouched after it
    after = time.monotonic_ns()
    made_in_cpp = [c for c in s.recorder.calls if id(c) not in made_by_init]
    assert len(made_in_cpp) >= 3, [c.site for c in s.recorder.calls]  # the phase's first is Python's
    for c in made_in_cpp:
        assert type(c) is Call
        assert before <= c.host_ns <= after  # time.monotonic_ns()'s clock
        assert c.link > 0 and c.sig is not None and c.qkv is None and c.timer is not None
        assert c.site.startswith("tests/models.py:")
        reference = Call(c.site, c.timer, False, None, None, None)
        for name in Call.__slots__:
            if name not in ("host_ns", "link", "sig"):
                assert getattr(c, name) == getattr(reference, name), name


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the fast path needs Python 3.11's frame API")
def test_the_fast_path_is_used_while_one_native_timer_marks(ext):
    s = attach(native="on")
    train(GPT(layers=2), steps=3)
    assert s.recorder._fast is not None and s.recorder._fast.size() == 1
    # A second native device kind that takes no mark (the CPU timer `native: on` adopts on a
    # CUDA machine, for the tap): it counts no backward, so the fast path stays.
    second = NativeTimer("cpu", native.load("cpu"))
    s.devices.native_timers.append(second)
    train(GPT(layers=2), steps=2)
    assert s.recorder._fast is not None
    # Once it marks, two backward counters differ: the fast path, which reads one, is left.
    second.release(second.mark())
    train(GPT(layers=2), steps=2)
    assert s.recorder._fast is None
    assert s.flush(10) and s.errors == 0


def test_nested_inputs_with_native_marks_never_raise(ext):
    """Jagged nested q, k, v (whose sizes are not plain integers) stay on Python's path."""
    s = attach(native="on")
    a = torch.randn(5, 4, 8, requires_grad=True)
    b = torch.randn(7, 4, 8, requires_grad=True)
    for _ in range(3):
        q = torch.nested.as_nested_tensor([a, b], layout=torch.jagged).transpose(1, 2)
        F.scaled_dot_product_attention(q, q, q).values().sum().backward()
        fadiag.step()
    assert s.flush(10) and s.errors == 0
    assert [len(r.calls) for r in s.history()] == [1, 1, 1] and a.grad is not None


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the fast path needs Python 3.11's frame API")
def test_tensor_subclasses_stay_on_pythons_path(ext):
    """A Tensor subclass may answer .shape or .device its own way: the C++ path leaves it alone."""

    class Tagged(torch.Tensor):
        pass

    s = attach(native="on")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    tq = q.detach().as_subclass(Tagged).requires_grad_()

    def step():  # both forwards, then one backward: no backward between the two calls
        (F.scaled_dot_product_attention(q, q, q).sum()
         + F.scaled_dot_product_attention(tq, tq, tq).sum()).backward()
        fadiag.step()

    for _ in range(3):
        step()
    sites = []
    site = s.recorder._site
    s.recorder._site = lambda recompute: sites.append(1) or site(recompute)
    step()
    assert len(sites) == 1  # the plain call took the C++ path; the subclass call Python's
    assert s.flush(10) and s.errors == 0 and all(len(r.calls) == 2 for r in s.history())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the fast path needs Python 3.11's frame API")
def test_the_per_step_cap_holds_on_the_fast_path(ext):
    """Past steps.max_calls_per_step the C++ path hands calls back, and Python counts them."""
    s = attach(native="on", **{"steps.max_calls_per_step": 2})
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    for _ in range(5):
        sum(F.scaled_dot_product_attention(q, q, q).sum() for _ in range(4)).backward()
        fadiag.step()
    assert s.flush(10) and s.errors == 0
    assert s.recorder._fast is not None
    assert [len(r.calls) for r in s.history()] == [2] * 5 and s.recorder.over_cap == 2 * 5


def test_calls_that_raise_give_their_marks_back(ext):
    # A user who catches an error from attention (a bad shape) and goes on: each such call took
    # a start mark; once its step is resolved every slot is back in the pool.
    s = attach(native="on")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    narrow = torch.randn(1, 2, 16, 4, requires_grad=True)  # head dim 4 against the query's 8
    for _ in range(3):
        for _ in range(50):
            with pytest.raises(RuntimeError):
                F.scaled_dot_product_attention(q, narrow, narrow)
        F.scaled_dot_product_attention(q, q, q).sum().backward()
        fadiag.step()
    r = resolved(s)
    assert len(r.calls) == 1 and r.calls[0].backward_seconds > 0
    assert s.devices.timer("cpu").marks_in_use() == 0


def test_compiled_autograd_around_backward_alone_falls_back_to_python_hooks(ext):
    # Compiled autograd switched on around backward() only (its context manager, not dynamo's
    # config) is invisible at forward time, and it does not call C++ hooks: their backward would
    # read 0 for ever. After three such optimizer steps later calls get Python hooks.
    from torch._dynamo import compiled_autograd

    s = attach(native="on")
    q = torch.randn(2, 4, 128, 32, requires_grad=True)
    opt = torch.optim.SGD([q], lr=0.0)
    for _ in range(7):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            out.sum().backward()
        opt.step()
        opt.zero_grad()
    assert s.flush(10)
    assert s.recorder.python_hooks and s.errors == 0
    assert [r.calls[0].backward_seconds > 0 for r in s.history()[-2:]] == [True, True]
