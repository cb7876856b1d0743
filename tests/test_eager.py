"""SDPA's eager wrapper as a builtin (fadiag/capture/eager.py, capture/_native/eager.cpp)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fadiag
from fadiag.capture import eager, native
from tests.models import GPT, train
from tests.native_marks import NEEDS_TAP

pytestmark = [*NEEDS_TAP, pytest.mark.skipif(sys.version_info < (3, 11),
                                             reason="the builtin needs Python 3.11's frame API")]

ROOT = Path(__file__).resolve().parents[1]


def _original():
    # Not a module global: attach() rebinds every global that is the function it wraps.
    return torch._C._nn.scaled_dot_product_attention


def _kind() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _summary(session: fadiag.Session) -> list[list[tuple]]:
    return [[(c.site, c.impl, c.interceptor, c.shape, c.causal, c.kept_bytes, c.recompute,
              c.forward_seconds > 0, c.backward_seconds > 0) for c in r.calls]
            for r in session.history()]


def test_sdpa_is_a_builtin_while_the_tap_is_installed_and_the_original_after_detach():
    s = fadiag.attach(port=0, tap="on")
    fn = F.scaled_dot_product_attention
    assert eager.is_builtin(fn) and s.capture.eager_wrapper == "native"
    assert fn.__name__ == _original().__name__ and fn.__doc__ == _original().__doc__
    ext = native.load(_kind())
    assert ext.eager_bound(fn) and ext.eager_original(fn) is _original()
    fadiag.detach()
    assert F.scaled_dot_product_attention is _original()
    assert not ext.eager_bound(fn)  # a reference kept anywhere now calls the original
    q = torch.randn(1, 2, 8, 4)
    assert torch.equal(fn(q, q, q), _original()(q, q, q))


def test_the_builtin_is_made_once_and_reused_across_attach_detach_cycles():
    made = []
    for _ in range(20):
        fadiag.attach(port=0, tap="on")
        made.append(F.scaled_dot_product_attention)
        fadiag.detach()
    assert all(fn is made[0] for fn in made) and eager.is_builtin(made[0])
    assert F.scaled_dot_product_attention is _original()


def test_a_steady_eager_call_runs_no_python_frame():
    # The wrapper's steady call, linked to the tap's record; a bypassed step's calls run none
    # either (tests/test_bypass.py), and make no record of the wrapper's: verify_every 0.
    s = fadiag.attach(port=0, tap="on", native="on", **{"steps.verify_every": 0})
    model = GPT(layers=3)
    train(model, steps=3)  # learned and linked on native marks: the steady state
    frames: list[str] = []
    seen = {"sdpa": 0}

    def profile(frame, event, arg):
        if event == "call":
            frames.append(frame.f_code.co_name)
        elif event == "c_call" and arg is F.scaled_dot_product_attention:
            seen["sdpa"] += 1

    block = model.blocks[1]
    x = torch.randn(2, 64, 64)
    q, k, v = block.qkv(block.ln1(x)).view(2, 64, 3, 2, 32).permute(2, 0, 3, 1, 4)

    def attend():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    attend()  # the phase's first call, whose site Python names: Python's path
    attend()
    sys.setprofile(profile)
    try:
        for _ in range(3):
            attend()
    finally:
        sys.setprofile(None)
    assert seen["sdpa"] == 3 and frames == ["attend"] * 3
    assert [c.link > 0 for c in s.recorder.calls[-3:]] == [True] * 3  # timed by the tap


def _train_measured(builtin: bool, monkeypatch, every_n_steps: int = 1):
    torch.manual_seed(0)
    model = GPT(layers=2)
    with monkeypatch.context() as m:
        if not builtin:
            m.setattr(eager, "unavailable", lambda ext: "turned off for this test")
        s = fadiag.attach(port=0, tap="on", every_n_steps=every_n_steps)
        assert eager.is_builtin(F.scaled_dot_product_attention) is builtin
        losses = train(model, steps=6)
        assert s.flush(10) and s.errors == 0
        out = (losses, _summary(s), dict(s.recorder.unmeasured_totals()))
        fadiag.detach()
    return out


def test_eager_reports_and_losses_are_the_python_wrappers_with_the_builtin(monkeypatch):
    assert _train_measured(True, monkeypatch) == _train_measured(False, monkeypatch)


def test_sampled_out_steps_are_counted_the_same_through_the_builtin(monkeypatch):
    with_builtin = _train_measured(True, monkeypatch, every_n_steps=2)
    assert with_builtin == _train_measured(False, monkeypatch, every_n_steps=2)
    assert with_builtin[2]["sampling"] > 0


def test_a_frame_compiled_before_the_tap_arrives_keeps_the_python_wrapper():
    """The tap installed after dynamo traced code with the Python wrapper (a background build
    finishing late): a builtin in its place would recompile that code."""
    torch._dynamo.reset()
    s = fadiag.attach(port=0, tap="off")
    wrapper = F.scaled_dot_product_attention
    assert not eager.is_builtin(wrapper)
    q = torch.randn(1, 2, 8, 4)

    def f(x):
        return F.scaled_dot_product_attention(x, x, x)

    compiled = torch.compile(f, backend="eager")
    compiled(q)
    s.capture._install_tap(native.load(_kind()))  # as the build thread's callback would
    assert s.capture.tap_status == "installed"
    assert s.capture.eager_wrapper.startswith("python (torch.compile traced code")
    assert F.scaled_dot_product_attention is wrapper
    recompiles = dict(torch._dynamo.utils.counters["recompiles"])
    compiled(q)
    assert dict(torch._dynamo.utils.counters["recompiles"]) == recompiles


def _fresh_python(body: str, before: str = "") -> str:
    """Runs `body` in a new interpreter (dynamo not imported) after attach() and two eager steps,
    `before` ahead of attach(); its stdout."""
    script = textwrap.dedent("""
        import sys
        import torch
        import fadiag
        from fadiag.capture import eager
        from tests.models import GPT, train
        assert "torch._dynamo" not in sys.modules
    """) + textwrap.dedent(before) + textwrap.dedent("""
        session = fadiag.attach(port=0, tap="on")
        assert eager.is_builtin(torch.nn.functional.scaled_dot_product_attention)
        assert "torch._dynamo" not in sys.modules  # attach does not import it
        torch.manual_seed(0)
        model = GPT(layers=2)
        train(model, steps=2)  # eager, through the builtin
    """) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_dynamo_imported_after_attach_traces_the_builtin_as_sdpa_with_no_graph_break():
    out = _fresh_python("""
        import torch._dynamo
        from torch._dynamo.utils import counters
        assert not any(f is eager._finder for f in sys.meta_path)  # the import hook is gone
        train(torch.compile(model, backend="aot_eager"), steps=3)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] >= 1
        assert session.flush(10) and session.errors == 0
        last = session.history()[-1]
        print([(c.site, c.interceptor, c.backward_seconds > 0) for c in last.calls])
    """)
    assert out.strip() == "[('compiled#0', 'dispatcher', True), ('compiled#1', 'dispatcher', True)]"


def test_a_builtin_dynamo_refuses_gives_way_to_the_python_wrapper_before_any_trace():
    out = _fresh_python(before="""
        def refuse(*args, **kwargs):
            raise RuntimeError("no polyfills today")

        torch.compiler.substitute_in_graph = refuse
    """, body="""
        import torch._dynamo  # imported already by the optimizer's first step here
        from torch._dynamo.utils import counters
        fn = torch.nn.functional.scaled_dot_product_attention
        assert not eager.is_builtin(fn) and getattr(fn, "__wrapped_by_fadiag__", False)
        train(torch.compile(model, backend="aot_eager"), steps=2)
        assert not counters["graph_break"], dict(counters["graph_break"])
        print(session.capture.eager_wrapper)
    """)
    assert out.strip() == ("python (dynamo refused it (RuntimeError: no polyfills today))")
