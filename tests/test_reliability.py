"""fadiag never hurts training: faults inside it are counted and logged once, long runs stay flat."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import _global_optimizer_post_hooks

import fadiag
from fadiag.capture import ops
from fadiag.cli import main
from fadiag.export import jsonl
from fadiag.rules import engine as rules
from fadiag.steps import recorder
from tests.models import GPT, train

ROOT = Path(__file__).resolve().parents[1]


def run_model(steps=3):
    torch.manual_seed(0)
    model = GPT(layers=2)
    losses = train(model, steps=steps)
    return losses, [p.detach().clone() for p in model.parameters()]


def _fault(monkeypatch, case, tmp_path):
    """Install one fault; returns attach() overrides for it."""
    if case == "interceptor":
        def bad_read(args, kwargs):
            raise RuntimeError("reader bug")
        # AttentionOp is frozen; the test restores the field itself (see the caller's finally).
        object.__setattr__(ops.OPS[0], "read", bad_read)
        object.__setattr__(ops.OPS[0], "quick", None)
    elif case == "backward_hook":
        def bad_hook(self, *a):
            raise RuntimeError("hook bug")
        monkeypatch.setattr(recorder.Recorder, "_hook_backward", bad_hook)
    elif case == "rule":
        def bad_rule(self, report):
            raise RuntimeError("rule bug")
        monkeypatch.setattr(rules.Rules, "evaluate", bad_rule)
    elif case == "sink_disk_full":
        def full(self, obj):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(jsonl.JsonlSink, "_write_line", full)
        return {"jsonl": str(tmp_path)}
    elif case in ("nan_timing", "negative_timing", "inf_timing"):
        value = {"nan_timing": float("nan"), "negative_timing": -1.0, "inf_timing": float("inf")}[case]
        monkeypatch.setattr(fadiag.capture.device.CpuTimer, "elapsed", staticmethod(lambda a, b: value))
        return {"tap": "off"}  # the wrapper's own marks (the tap's are C++, timed as tap.cpp does)
    elif case == "missing_timing":
        monkeypatch.setattr(fadiag.capture.device.CpuTimer, "mark", lambda self, since=None: None)
        monkeypatch.setattr(fadiag.capture.device.CpuTimer, "elapsed", staticmethod(lambda a, b: a - b))
        return {"tap": "off"}
    return {}


FAULTS = ["interceptor", "backward_hook", "rule", "sink_disk_full", "nan_timing",
          "negative_timing", "inf_timing", "missing_timing"]


@pytest.mark.parametrize("case", FAULTS)
def test_a_fault_inside_fadiag_leaves_training_bit_identical(case, monkeypatch, tmp_path, caplog):
    plain = run_model(steps=4)
    original_read, original_quick = ops.OPS[0].read, ops.OPS[0].quick
    try:
        overrides = _fault(monkeypatch, case, tmp_path)
        with caplog.at_level(logging.WARNING, logger="fadiag"):
            s = fadiag.attach(port=0, **overrides)
            losses, params = run_model(steps=4)
            s.flush(10)
    finally:
        object.__setattr__(ops.OPS[0], "read", original_read)
        object.__setattr__(ops.OPS[0], "quick", original_quick)
    assert losses == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(params, plain[1], strict=True))
    internal = [r for r in caplog.records if "internal error" in r.message]
    if case in ("nan_timing", "negative_timing", "inf_timing"):
        # bad timings are not errors: they are recorded as 0 and never reach a metric as NaN
        assert s.errors == 0
        assert all(c.forward_seconds == 0.0 for r in s.history() for c in r.calls)
        return
    assert s.errors >= 1
    assert len(internal) == 1  # logged once, not once per step
    text = urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics").read().decode()
    count = float(re.search(r'^fadiag_internal_errors_total\{rank="0"\} (\S+)$', text, re.M)[1])
    assert count == s.errors


def test_thousand_attach_detach_cycles_leak_nothing():
    proc = psutil.Process()
    sdpa = F.scaled_dot_product_attention
    hooks = len(_global_optimizer_post_hooks)
    for _ in range(20):  # warm-up: imports, first server
        fadiag.attach(port=0)
        fadiag.detach()
    threads, fds, rss = threading.active_count(), proc.num_fds(), proc.memory_info().rss
    for i in range(1000):
        # prometheus_client's server polls for shutdown every 0.5 s, so most cycles run without
        # it; every 50th cycle starts and stops a real endpoint.
        s = fadiag.attach(port=0, **{"exporter.enabled": i % 50 == 0})
        if i % 100 == 0:
            q = torch.randn(1, 1, 8, 4, requires_grad=True)
            F.scaled_dot_product_attention(q, q, q).sum().backward()
            fadiag.step()
            assert s.flush(10)
        fadiag.detach()
        assert F.scaled_dot_product_attention is sdpa
    time.sleep(0.2)
    assert threading.active_count() == threads
    assert proc.num_fds() == fds
    assert len(_global_optimizer_post_hooks) == hooks
    assert proc.memory_info().rss - rss < 20 << 20


def test_hundred_thousand_steps_keep_memory_threads_and_files_flat():
    proc = psutil.Process()
    s = fadiag.attach(port=0)
    q = torch.randn(1, 1, 4, 4, requires_grad=True)

    def steps(n):
        for _ in range(n):
            F.scaled_dot_product_attention(q, q, q).sum().backward()
            fadiag.step()

    steps(10_000)
    assert s.flush(30)
    rss, threads, fds = proc.memory_info().rss, threading.active_count(), proc.num_fds()
    steps(90_000)
    assert s.flush(60)
    assert s.last_step().step == 100_000
    assert len(s.history()) == s.config.steps.history
    assert proc.memory_info().rss - rss < 10 << 20
    assert threading.active_count() == threads and proc.num_fds() == fds
    assert len(s.recorder.signatures) == 1 and s.errors == 0


RANK_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import fadiag
    from tests.models import GPT, train
    s = fadiag.attach(port={port})
    model = GPT(layers=1)
    print("ready", s.port, flush=True)
    while True:
        train(model, steps=1)
        time.sleep(0.05)
""")


def test_a_killed_rank_does_not_stop_the_other_from_exporting(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        base = sock.getsockname()[1]
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(root=str(ROOT), port=base))
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
    try:
        ports = [int(p.stdout.readline().split()[1]) for p in procs]
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)

        def steps_total():
            text = urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/metrics", timeout=5).read()
            return float(re.search(rb'^fadiag_steps_total\{rank="0"\} (\S+)$', text, re.M)[1])

        first = steps_total()
        deadline = time.monotonic() + 20
        while steps_total() <= first and time.monotonic() < deadline:
            time.sleep(0.2)
        assert steps_total() > first
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
            p.stdout.close()


EXIT_SCRIPT = textwrap.dedent("""
    import atexit, json, sys
    sys.path.insert(0, {root!r})


    def after_fadiag():  # registered before fadiag's own exit handler, so it runs after it
        print(json.dumps({{"resolver_alive": s.resolver.alive(), "reported": len(s.history())}}),
              flush=True)


    atexit.register(after_fadiag)
    import fadiag
    from tests.models import GPT, train

    s = fadiag.attach(port=0, native={native!r}, **{{"exporter.enabled": False}})
    train(GPT(layers=2), steps=5)
    # no detach(): a script that ends after training
""")


@pytest.mark.parametrize("native", ["on", "off"])
def test_a_script_that_ends_without_detach_exits_cleanly_with_every_step_reported(native, tmp_path):
    # At exit fadiag detaches before Python finalizes: a resolver thread still waiting in C++
    # (for a backward window, with native marks) when finalization began aborted the process
    # with status 134, "terminate called without an active exception", in ~half the runs.
    script = tmp_path / "train.py"
    script.write_text(EXIT_SCRIPT.format(root=str(ROOT), native=native))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "terminate called" not in run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"resolver_alive": False,
                                                                 "reported": 5}


SOURCES = sorted((ROOT / "fadiag").rglob("*.py"))


@pytest.mark.parametrize("pattern", [r"\byaml\.load\(", r"\bpickle\b", r"(?<![\w.])eval\(",
                                     r"(?<![\w.])exec\(", r"yaml\.unsafe_load", r"yaml\.Loader\b"])
def test_no_unsafe_loading_of_user_input(pattern):
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert hits == []


@pytest.mark.parametrize("argv, name", [
    (["demo", "--steps", "-1"], "--steps"),
    (["demo", "--device", "tpu"], "--device"),
    (["bench", "--seq-lens", "12x"], "--seq-lens"),
    (["bench", "--backends", "warp"], "--backends"),
    (["estimate", "--seq-len", "0", "--heads", "8", "--head-dim", "64", "--layers", "2"], "--seq-len"),
    (["estimate", "--seq-len", "8", "--heads", "8", "--head-dim", "64"], "--layers"),
    (["baseline", "save", "run.jsonl", "-o", "b.json", "--skip", "-3"], "--skip"),
    (["report"], "RUN"),
    (["nonsense"], "nonsense"),
])
def test_bad_cli_arguments_exit_2_and_name_the_argument(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert name in capsys.readouterr().err


def test_metrics_endpoint_binds_to_loopback_by_default():
    s = fadiag.attach(port=0)
    assert s.config.exporter.addr == "127.0.0.1"
    conns = [c for c in psutil.Process().net_connections(kind="tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == s.port]
    assert [c.laddr.ip for c in conns] == ["127.0.0.1"]


def test_a_mark_that_fails_inside_backward_never_reaches_backward(monkeypatch):
    # Python marks: the backward hooks run inside the user's backward(); a failing mark there
    # (e.g. an event recorded on another device's stream) is counted, not raised.
    s = fadiag.attach(port=0, native="off")
    q = torch.randn(1, 2, 32, 8, requires_grad=True)
    out = F.scaled_dot_product_attention(q, q, q)
    timer = s.devices.timer("cpu")

    def broken(since: object = None) -> None:
        raise RuntimeError("Event device 1 does not match recording stream's device 0")

    monkeypatch.setattr(timer, "mark", broken)
    out.sum().backward()  # must not raise
    assert q.grad is not None and s.errors >= 1
    monkeypatch.undo()
    fadiag.step()
    assert s.flush(10)
    assert s.recorder.in_backward == 0


def test_a_failed_start_mark_drops_that_call_not_the_step(monkeypatch):
    s = fadiag.attach(port=0, native="off", tap="off")  # the wrapper's marks
    q = torch.randn(1, 2, 32, 8, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q).sum().backward()  # learn the signature
    fadiag.step()
    timer = s.devices.timer("cpu")
    real = timer.mark
    fail = [True]

    def once(since: object = None) -> object:
        if fail.pop() if fail else False:
            raise RuntimeError("mark failed")
        return real(since)

    monkeypatch.setattr(timer, "mark", once)
    a = F.scaled_dot_product_attention(q, q, q)  # its start mark fails: not measured
    b = F.scaled_dot_product_attention(q, q, q)
    (a.sum() + b.sum()).backward()
    fadiag.step()
    assert s.flush(10)
    r = s.last_step()
    assert r.step == 2 and len(r.calls) == 1 and r.calls[0].forward_seconds > 0
    assert s.errors == 1


def test_torch_compile_traces_the_wrapper_once(monkeypatch):
    # dynamo traces fadiag's wrapper: reading any of fadiag's state there would put a guard on
    # it, and a counter bumped per call would recompile the graph at every call (with
    # fullgraph=True, up to the recompile limit, then an error in the user's code).
    fadiag.attach(port=0)
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def f(q):
        return F.scaled_dot_product_attention(q, q, q)

    q = torch.randn(1, 2, 16, 8)
    for _ in range(20):
        out = f(q)
    assert len(compiles) == 1
    assert torch.allclose(out, F.scaled_dot_product_attention(q, q, q))


def test_a_probed_call_without_backward_frees_its_graph():
    # The first call of a signature counts its saved bytes with saved-tensor hooks. Evaluation
    # with grad on runs no backward: the output and the graph behind it must still be freed.
    import gc
    import weakref

    fadiag.attach(port=0)
    q = torch.randn(1, 2, 64, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    x = q @ w
    out = F.scaled_dot_product_attention(x, x, x, is_causal=True)
    ref = weakref.ref(out)
    del out, x
    gc.collect()
    assert ref() is None


def test_a_forked_child_passes_attention_through_and_leaves_the_port():
    # DataLoader workers (fork): the child inherits the session without its threads. Its calls
    # pass through unmeasured, the metrics socket is no longer its own, and detach() there
    # returns at once (a server shutdown would wait for a serving thread that was not copied).
    s = fadiag.attach(port=0)
    q = torch.randn(1, 2, 16, 8)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        ok = False
        try:
            # As DataLoader's worker loop does: OpenMP's pool does not survive fork, and a
            # parallel op in the child would wait for threads that were not copied.
            torch.set_num_threads(1)
            child = fadiag.current_session()
            out = F.scaled_dot_product_attention(q, q, q)
            ok = (not child.recorder.enabled and child.recorder.calls == []
                  and child._server._server is None and out.shape == q.shape)
            fadiag.detach()
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done and os.waitstatus_to_exitcode(status) == 0
    # the parent still serves and measures
    with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=5) as r:
        assert b"fadiag_build_info" in r.read()
    assert s.recorder.enabled
