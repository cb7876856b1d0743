"""The core: every attention call measured per step, on CPU, without changing training."""

from __future__ import annotations

import importlib
import re
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadiag
from fadiag import session as session_mod
from tests.models import GPT, SeedFlashAttention, train


def attach(**kw):
    kw.setdefault("exporter.enabled", False)
    return fadiag.attach(**kw)


def resolved(session):
    assert session.flush(10)
    report = session.last_step()
    assert report is not None
    return report


def test_public_api_is_pinned():
    assert sorted(fadiag.__all__) == [
        "CallRecord", "Config", "ConfigError", "FadiagError", "Flag", "Session", "StepReport",
        "__version__", "attach", "current_session", "detach", "instrument", "load_config", "step",
    ]


def test_gpt_training_records_one_call_per_layer_per_step():
    s = attach()
    train(GPT(layers=3, dim=64, heads=2), steps=5, seq=64)
    s.flush(10)
    history = s.history()
    assert [r.step for r in history] == [1, 2, 3, 4, 5]
    for r in history:
        assert len(r.calls) == 3
        assert len({c.site for c in r.calls}) == 3
        for c in r.calls:
            assert c.forward_seconds > 0 and c.backward_seconds > 0
            assert c.shape == (2, 2, 64, 64, 32)
            assert c.causal and c.dtype == "float32" and c.impl == "cpu_flash"
        assert r.forward_seconds == pytest.approx(sum(c.forward_seconds for c in r.calls))
    # Every field where it belongs (the resolver builds records positionally).
    c = history[-1].calls[0]
    assert (c.dropout, c.kv_heads, c.layout, c.device, c.recompute, c.interceptor,
            c.fallback_reason, c.probe, c.forward_only, c.sparsity, c.flex) == (
        0.0, 2, "BHSD", "cpu", False, "sdpa", None, False, False, None, None)
    assert c.kept_bytes == 2 * 2 * 64 * 32 * 4 + 2 * 2 * 64 * 4 and c.standard_bytes > c.kept_bytes
    assert c.peak_bytes is None and c.forward_host_seconds == c.backward_host_seconds == 0.0
    assert history[0].calls[0].probe  # the first step's call learned the signature
    # the same call site keeps its id every step
    assert [c.site for c in history[0].calls] == [c.site for c in history[-1].calls]


def test_cpu_flash_kernel_keeps_output_and_logsumexp_only():
    s = attach()
    b, h, n, d = 2, 4, 256, 32
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    fadiag.step()
    call = resolved(s).calls[0]
    assert call.impl == "cpu_flash"
    assert call.kept_bytes == b * h * n * d * 4 + b * h * n * 4  # O + fp32 logsumexp; q, k, v excluded
    assert call.memory_savings > 0.8


def test_math_path_reports_impl_math_and_keeps_a_full_matrix():
    s = attach()
    b, h, n, d = 2, 4, 256, 32
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    fadiag.step()
    call = resolved(s).calls[0]
    assert call.impl == "math"
    assert call.kept_bytes >= b * h * n * n * 4
    assert call.memory_savings < 0.8
    assert "disabled" in call.fallback_reason


def test_transformer_encoder_layer_is_measured():
    s = attach()
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(2):
        layer(torch.randn(2, 32, 64)).sum().backward()
        opt.step()
    r = resolved(s)
    assert len(r.calls) == 1
    assert r.calls[0].shape == (2, 4, 32, 32, 16)
    assert r.calls[0].backward_seconds > 0


def test_multihead_attention_without_weights_is_measured():
    s = attach()
    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    x = torch.randn(2, 16, 64)
    mha(x, x, x, need_weights=False)[0].sum().backward()
    fadiag.step()
    assert resolved(s).calls[0].shape == (2, 4, 16, 16, 16)


def test_seed_style_autograd_function_is_measured_after_instrument():
    fadiag.instrument(SeedFlashAttention, name="seed_flash")
    s = attach()
    q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
    SeedFlashAttention.apply(q, k, v, 0.25, True).sum().backward()
    fadiag.step()
    r = resolved(s)
    assert [c.impl for c in r.calls] == ["seed_flash"]  # the SDPA inside is not counted twice
    call = r.calls[0]
    assert call.forward_seconds > 0 and call.backward_seconds > 0
    assert call.kept_bytes == 1 * 2 * 128 * 16 * 4  # it saves q, k, v and O: O is what it keeps


class _OneNode(torch.autograd.Function):
    """Attention in one autograd node of a name fadiag does not know (as a compiled function's)."""

    @staticmethod
    def forward(ctx, q, k, v):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), g)


def _seed_attention(q, k, v):
    """A user's attention function: one autograd node computes its backward."""
    return _OneNode.apply(q, k, v)


def test_a_single_node_backward_ends_where_that_node_ends_not_after_the_inputs_gradients():
    # The Function's one backward node yields q's, k's and v's gradients at once. What autograd
    # runs next for each input (here: each leaf's gradient hook, slow on purpose; in a model, the
    # gradient accumulation into leaves or the q/k/v projections' backward) is not the call's.
    fadiag.instrument(_seed_attention, name="seed_fn")
    s = attach()  # rebinds this module's `_seed_attention` to the measuring wrapper
    for slow in (False, True):  # the first backward also pays the kernels' first-call set-up
        q, k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(3))
        for t in (q, k, v) if slow else ():
            t.register_hook(lambda g: time.sleep(0.2))
        _seed_attention(q, k, v).sum().backward()
        fadiag.step()
    call = resolved(s).calls[0]
    assert call.impl == "seed_fn"
    assert 0 < call.backward_seconds < 0.2


def test_instrument_after_attach_and_detach_restores_apply():
    s = attach()
    assert "apply" not in SeedFlashAttention.__dict__
    fadiag.instrument(SeedFlashAttention)
    q = torch.randn(1, 1, 8, 4, requires_grad=True)
    SeedFlashAttention.apply(q, q, q, 0.5).sum().backward()
    fadiag.step()
    assert resolved(s).calls[0].impl == "SeedFlashAttention"
    fadiag.detach()
    assert "apply" not in SeedFlashAttention.__dict__


def test_gradient_accumulation_of_four_micro_batches_is_one_step():
    s = attach()
    train(GPT(layers=2), steps=3, micro_batches=4)
    s.flush(10)
    assert [len(r.calls) for r in s.history()] == [8, 8, 8]
    sites = [c.site for c in s.history()[-1].calls]
    assert len(set(sites)) == 2  # the micro-batches share the layers' sites


def test_steps_without_an_optimizer_fall_back_to_forward_after_backward():
    s = attach(**{"steps.fallback_after": 3})
    model = GPT(layers=1)
    for _ in range(6):
        model(torch.randint(0, 64, (2, 16))).sum().backward()
    model(torch.randint(0, 64, (2, 16)))  # the forward that closes the sixth pass
    s.resolver.flush(10)
    history = s.history()
    assert [len(r.calls) for r in history] == [1] * 6
    assert all(r.backward_seconds > 0 for r in history)


@pytest.mark.parametrize("mode", [None, "reentrant", "non_reentrant"])
def test_training_is_bit_identical_with_and_without_fadiag(mode):
    def run():
        torch.manual_seed(0)
        model = GPT(layers=2, checkpointing=mode)
        losses = train(model, steps=5)
        return losses, [p.detach().clone() for p in model.parameters()]

    plain_losses, plain_params = run()
    s = attach()
    losses, params = run()
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    r = resolved(s)
    if mode is None:
        assert not any(c.recompute for c in r.calls)
        return
    recomputed = [c for c in r.calls if c.recompute]
    assert len(recomputed) == 2 and len(r.calls) == 4
    assert r.forward_seconds == pytest.approx(sum(c.forward_seconds for c in r.calls
                                                  if not c.recompute))
    assert r.backward_seconds > 0
    assert {c.site for c in recomputed} == {c.site for c in r.calls if not c.recompute}


def test_checkpointing_still_frees_activations():
    """The kept-bytes probe chains to checkpoint's saved-tensor hooks instead of replacing them."""
    model = GPT(layers=2, dim=64, checkpointing="non_reentrant")
    tokens = torch.randint(0, 64, (2, 128))
    seen = []

    def pack(t):
        seen.append(t.numel())
        return t

    attach()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).sum().backward()
    # With checkpointing, the outer hooks see only the blocks' inputs, never attention internals.
    fadiag.detach()
    seen_with = sorted(seen)
    seen.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).sum().backward()
    assert seen_with == sorted(seen)


def test_names_imported_before_attach_are_measured(tmp_path, monkeypatch):
    (tmp_path / "early_import.py").write_text(textwrap.dedent("""
        from torch.nn.functional import scaled_dot_product_attention
        def attend(q, k, v):
            return scaled_dot_product_attention(q, k, v)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("early_import")
    original = mod.scaled_dot_product_attention
    s = attach()
    q = torch.randn(1, 1, 8, 4, requires_grad=True)
    mod.attend(q, q, q).sum().backward()
    fadiag.step()
    assert len(resolved(s).calls) == 1
    fadiag.detach()
    assert mod.scaled_dot_product_attention is original
    del sys.modules["early_import"]


def test_detach_restores_every_function_by_identity():
    before = F.scaled_dot_product_attention
    attach()
    assert F.scaled_dot_product_attention is not before
    fadiag.detach()
    assert F.scaled_dot_product_attention is before
    fadiag.detach()  # idempotent
    assert F.scaled_dot_product_attention is before


def test_attach_twice_returns_the_same_session():
    assert attach() is fadiag.attach()


def test_disabled_configuration_patches_nothing():
    before = F.scaled_dot_product_attention
    s = fadiag.attach(enabled=False)
    assert F.scaled_dot_product_attention is before
    assert s.last_step() is None


def test_no_grad_calls_are_not_measured_by_default():
    s = attach()
    q = torch.randn(1, 1, 8, 4)
    with torch.no_grad():
        F.scaled_dot_product_attention(q, q, q)
    qg = q.clone().requires_grad_()
    F.scaled_dot_product_attention(qg, qg, qg).sum().backward()
    fadiag.step()
    assert len(resolved(s).calls) == 1


def test_sampling_measures_one_step_in_n():
    s = attach(every_n_steps=3)
    train(GPT(layers=1), steps=9)
    s.flush(10)
    assert [r.step for r in s.history()] == [3, 6, 9]
    assert s.recorder.sampled_out == 6  # one call on each of the six skipped steps


def test_skipped_calls_are_exported_by_reason():
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    s = fadiag.attach(port=0, every_n_steps=2, **{"steps.max_calls_per_step": 1})
    train(GPT(layers=2), steps=4)
    assert s.flush(10)
    expected = {"sampling": 4, "per_step_cap": 2, "other_device": 0}
    deadline = time.monotonic() + 5
    while True:  # the counters are refreshed by the resolver's twice-a-second tick
        text = urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics").read().decode()
        samples = {smp.labels["reason"]: smp.value
                   for f in text_string_to_metric_families(text)
                   if f.name == "fadiag_attention_uninstrumented_calls" for smp in f.samples}
        # steps 1 and 3 are sampled out (2 calls each); on steps 2 and 4 the second call is over
        # the cap
        if all(samples.get(k) == v for k, v in expected.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert {reason: samples.get(reason) for reason in expected} == expected
    assert not any(samples[reason] for reason in samples.keys() - expected)  # nothing else missed


def test_compiled_regions_pass_through_unmeasured():
    s = attach()
    q = torch.randn(1, 2, 16, 8, requires_grad=True)

    @torch.compile(backend="eager", fullgraph=True)
    def f(q):
        return F.scaled_dot_product_attention(q, q, q)

    outs = [f(q) for _ in range(3)]
    assert s.recorder.calls == []  # inside the graph: nothing measured, nothing started
    for out in outs:
        assert torch.allclose(out, F.scaled_dot_product_attention(q, q, q))


@pytest.mark.parametrize("case", ["3d", "gqa", "bool_mask", "float_mask", "dropout",
                                  "non_contiguous", "zero_length", "nested"])
def test_unusual_inputs_are_recorded_and_never_raise(case):
    s = attach()
    torch.manual_seed(0)
    kwargs = {}
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k = v = torch.randn(2, 4, 16, 8, requires_grad=True)
    if case == "3d":
        q = k = v = torch.randn(2, 16, 8, requires_grad=True)
    elif case == "gqa":
        k = v = torch.randn(2, 2, 16, 8, requires_grad=True)
        kwargs["enable_gqa"] = True
    elif case == "bool_mask":
        kwargs["attn_mask"] = torch.ones(16, 16, dtype=torch.bool).tril()
    elif case == "float_mask":
        kwargs["attn_mask"] = torch.zeros(16, 16)
    elif case == "dropout":
        kwargs["dropout_p"] = 0.1
    elif case == "non_contiguous":
        q = torch.randn(2, 16, 4, 8, requires_grad=True).transpose(1, 2)
    elif case == "zero_length":
        q = k = v = torch.randn(2, 4, 0, 8, requires_grad=True)
    elif case == "nested":
        # (B, S*, H, D) jagged, transposed to (B, H, S*, D) as SDPA wants nested inputs
        q = k = v = torch.nested.as_nested_tensor(
            [torch.randn(5, 4, 8), torch.randn(7, 4, 8)], layout=torch.jagged).transpose(1, 2)
        with torch.no_grad():
            expected = F.scaled_dot_product_attention(q, k, v)
        fadiag.detach()
        s = attach(**{"steps.record_no_grad": True})
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q, k, v)
        assert torch.equal(out.values(), expected.values())
        fadiag.step()
        assert s.flush(10)
        assert s.errors == 0
        return
    torch.manual_seed(1)
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    out.sum().backward()
    fadiag.step()
    r = resolved(s)
    assert len(r.calls) == 1
    call = r.calls[0]
    if case == "3d":
        assert call.shape == (2, 1, 16, 16, 8)
    elif case == "gqa":
        assert call.shape[1] == 4 and call.kv_heads == 2
    elif case == "dropout":
        assert call.dropout == 0.1
    assert s.errors == 0


def test_outer_saved_tensor_hooks_still_see_what_attention_saves():
    """Offloading-style hooks (save_on_cpu and the like) still pack every tensor SDPA saves,
    also on a signature's first call, when fadiag measures kept bytes inside them."""
    packed = []

    def pack(t):
        packed.append((tuple(t.shape), t.dtype))
        return t

    def run():
        q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        seen = sorted(packed, key=str)
        packed.clear()
        return seen

    plain = run()
    s = attach()
    assert run() == plain  # the probe call
    assert run() == plain  # a cached call
    fadiag.step()
    assert resolved(s).calls[0].kept_bytes is not None


def test_the_quick_argument_reader_agrees_with_the_full_one_in_every_calling_style():
    """The hot path reads SDPA's arguments its own cheap way; the signature it keys on must not
    depend on how the caller spelled them, and must change with anything that changes the kernel."""
    from fadiag.capture.ops import quick_sdpa, read_sdpa

    q = torch.randn(1, 2, 8, 4)
    mask = torch.ones(8, 8, dtype=torch.bool)
    same = [((q, q, q, mask, 0.0, True), {}), ((q, q, q), {"attn_mask": mask, "is_causal": True}),
            ((q, q, q, mask), {"is_causal": True, "scale": None}),
            ((), {"query": q, "key": q, "value": q, "attn_mask": mask, "is_causal": True})]
    extras = set()
    for args, kwargs in same:
        a, b, c, extra = quick_sdpa(args, kwargs)
        info = read_sdpa(args, kwargs)
        assert a is b is c is q and info.q is q and info.causal is True and info.mask is mask
        extras.add(extra)
    assert len(extras) == 1
    different = [((q, q, q), {}), ((q, q, q, mask), {}), ((q, q, q), {"is_causal": True}),
                 ((q, q, q), {"dropout_p": 0.1}), ((q, q, q), {"enable_gqa": True})]
    seen = extras | {quick_sdpa(a, k)[3] for a, k in different}
    assert len(seen) == 1 + len(different)



def test_torchscript_still_scripts_code_that_calls_sdpa():
    # TorchScript knows F.scaled_dot_product_attention by identity; the wrapper is registered as
    # the same builtin, so scripting works and the scripted call runs the op itself.
    attach()

    class Attention(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    scripted = torch.jit.script(Attention())
    q = torch.randn(1, 2, 16, 8)
    assert torch.equal(scripted(q), Attention()(q))
    from torch.jit import _builtins

    wrapper = F.scaled_dot_product_attention
    assert _builtins._get_builtin_table()[id(wrapper)] == "aten::scaled_dot_product_attention"
    fadiag.detach()
    assert id(wrapper) not in _builtins._get_builtin_table()  # gone with the wrapper


class _OnCuda0(torch.Tensor):
    """A CPU tensor that says it is on cuda:0, to drive Recorder.begin's device check."""

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)


def _begin_on_cuda0(timer):
    """Recorder.begin for an SDPA call on "cuda:0" with `timer` as every device's timer."""
    from fadiag.capture.ops import OPS
    from fadiag.steps.recorder import Recorder

    class Devices:
        native_timers: list = []

        def timer(self, kind: str):
            return timer

    errors: list = []
    rec = Recorder(Devices(), on_error=lambda where, e: errors.append((where, e)), on_step=lambda s: None)
    q = torch.randn(1, 2, 16, 8, requires_grad=True).as_subclass(_OnCuda0)
    sdpa = next(op for op in OPS if op.name == "sdpa")
    return rec, rec.begin(sdpa, (q, q, q), {}), errors


def test_calls_on_a_device_that_is_not_current_are_counted_not_mistimed():
    # Several accelerators in one process (a model split across them): marks go on the current
    # device's stream, which would time unrelated work for a call on another device. Such calls
    # are left unmeasured and counted (uninstrumented, reason other_device), never mistimed.
    class Timer:
        kind = "cuda"

        def current_device(self) -> int:
            return 1

        def mark(self, since: object = None) -> None:
            raise AssertionError("a mark was taken")

    rec, call, errors = _begin_on_cuda0(Timer())
    assert call is None and rec.other_device == 1 and rec.calls == [] and errors == []


def _math_path_call():
    """A session with Python hooks and one math-path call whose q, k, v come from three weights."""
    s = attach(**{"native": "off"})
    x = torch.randn(1, 2, 32, 8, requires_grad=True)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*(x @ w for w in weights))
    return s, out, weights


def _step_resolves_at_once(s) -> None:
    fadiag.step()
    t0 = time.monotonic()
    assert s.flush(10)
    assert time.monotonic() - t0 < 2.0  # not the 5 s wait for a backward that never ends


def test_a_partial_backward_leaves_nothing_open():
    # On the math path the backward ends where q, k and v get their gradients; a backward that
    # asks for q's alone never reaches k's and v's producers. The pass's end closes the call:
    # its backward is not timed, the step resolves at once, and later recomputations are seen.
    s, out, (wq, _, _) = _math_path_call()
    (gq,) = torch.autograd.grad(out.sum(), wq)
    assert gq is not None and s.recorder.in_backward == 0
    _step_resolves_at_once(s)
    [call] = s.last_step().calls
    assert call.forward_seconds > 0 and call.backward_seconds == 0.0


def test_reentrant_checkpointing_learns_each_signature_once(monkeypatch):
    # The reentrant forward runs without grad: nothing is kept to measure, so its signature is
    # cached as it is, not learned again on every call.
    from fadiag.steps.recorder import Recorder
    from tests.models import GPT, train

    learned = []
    real = Recorder._learn
    monkeypatch.setattr(Recorder, "_learn", lambda self, *a: learned.append(1) or real(self, *a))
    s = attach()
    train(GPT(layers=3, checkpointing="reentrant"), steps=4)
    assert s.flush(10)
    assert s.last_step().step == 4
    assert len(learned) <= 2  # the forward's signature and the recomputation's


def test_a_partial_backward_then_a_full_one_on_the_retained_graph():
    # A gradient penalty: grad for one input with retain_graph, then the full backward. The call
    # closed at the first pass's end stays closed; nothing is left open for the step.
    s, out, (wq, wk, _) = _math_path_call()
    torch.autograd.grad(out.sum(), wq, retain_graph=True)
    out.sum().backward()
    assert s.recorder.in_backward == 0 and wk.grad is not None
    _step_resolves_at_once(s)


def test_a_host_clock_timer_measures_calls_on_any_device():
    # device: cpu times every call with the host clock, whatever the tensors' device: there is no
    # current device to compare with, and no call is counted as other_device.
    from fadiag.capture.device import CpuTimer

    rec, call, errors = _begin_on_cuda0(CpuTimer())
    assert call is not None and rec.other_device == 0 and errors == []


class _CausalByPosition(torch.autograd.Function):
    """A user Function whose causal flag comes by position: apply() takes no keywords."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):  # type: ignore[no-untyped-def]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g, g, g, None


class _MaskFlag(torch.autograd.Function):
    """Causal under another name, and a bool before it that is not causal."""

    @staticmethod
    def forward(ctx, q, k, v, return_lse, triangular):  # type: ignore[no-untyped-def]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=triangular)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g, g, g, None, None


def _causal_recorded(fn, call, **kw):
    fadiag.instrument(fn, name="mine", **kw)
    s = attach()
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    call(q, k, v).sum().backward()
    fadiag.step()
    assert s.flush(10)
    return [c.causal for c in s.last_step().calls]


@pytest.mark.parametrize(("call", "expected"), [
    (lambda q, k, v: _CausalByPosition.apply(q, k, v, True), [True]),
    (lambda q, k, v: _CausalByPosition.apply(q, k, v, False), [False]),
    (lambda q, k, v: _CausalByPosition.apply(q, k, v), [False]),  # its default
])
def test_causal_given_by_position_to_an_instrumented_function_is_recorded(call, expected):
    assert _causal_recorded(_CausalByPosition, call) == expected


def test_causal_arg_names_the_position_of_a_flag_with_another_name():
    call = lambda q, k, v: _MaskFlag.apply(q, k, v, False, True)  # noqa: E731
    assert _causal_recorded(_MaskFlag, call, causal_arg=4) == [True]
    fadiag.detach()
    session_mod._instrumented.clear()
    assert _causal_recorded(_MaskFlag, call, causal_arg="triangular") == [True]


@pytest.mark.parametrize(("causal_arg", "message"), [
    ("mask", "causal_arg 'mask' is not a parameter of"),
    (-1, "causal_arg must be a position (an integer >= 0) or a parameter name, got -1"),
    (True, "causal_arg must be a position (an integer >= 0) or a parameter name, got True"),
])
def test_a_bad_causal_arg_is_a_clear_error(causal_arg, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fadiag.instrument(_MaskFlag, causal_arg=causal_arg)
