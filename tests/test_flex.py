"""FlexAttention: eager (unfused) and torch.compile(flex_attention) calls, measured and judged;
flex inside a compiled model, counted per step.

torch 2.13 has no flex backward on CPU (eager or compiled: inputs that require grad raise), so
on CPU every flex call is forward-only. Inductor compiles one C++ kernel per shape (~30 s on two
cores), so the compiled tests share one S=512 callable.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.attention.flex_attention as fam
from prometheus_client import CollectorRegistry

import fadiag
from fadiag.capture import flex
from fadiag.capture.ops import OPS
from fadiag.steps.records import CallRecord, StepReport

S = 512
_PRECOMPILED = torch.compile(fam.flex_attention)
"""Made before attach(), as modules that compile flex at import time do."""


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def qkv(s, b=1, h=2, d=16, kv_heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    kvh = kv_heads or h
    return (torch.randn(b, h, s, d, generator=g), torch.randn(b, kvh, s, d, generator=g),
            torch.randn(b, kvh, s, d, generator=g))


@pytest.fixture(scope="module")
def causal_mask():
    return fam.create_block_mask(causal, None, None, S, S, device="cpu")


@pytest.fixture(scope="module")
def compiled(causal_mask):
    """torch.compile(flex_attention), compiled once for the module at S=512 with a causal mask."""
    fn = torch.compile(fam.flex_attention)
    fn(*qkv(S), block_mask=causal_mask)
    return fn


def steps(fn, n, *args, **kwargs):
    outs = []
    for _ in range(n):
        outs.append(fn(*args, **kwargs))
        fadiag.step()
    return outs


def flex_calls(session):
    assert session.flush(20)
    return [c for r in session.history() for c in r.calls if c.impl.startswith("flex")]


def sample(session, name, **labels):
    """A metric's value as a scrape would read it (counters are refreshed twice a second)."""
    registry = CollectorRegistry()
    registry.register(session.metrics)
    deadline = time.monotonic() + 5
    while True:
        value = registry.get_sample_value(name, {"rank": "0", **labels})
        if value is not None or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_flex_attention_is_one_entry_in_the_op_table_with_its_import_path():
    eager = [op for op in OPS if "torch.nn.attention.flex_attention:flex_attention" in op.targets]
    assert [(op.impl, op.config_key) for op in eager] == [("flex_unfused", "flex")]
    assert [op.impl for op in OPS if op.name == "flex_attention_compiled"] == ["flex"]


def test_reader_gives_shape_gqa_mask_options_and_sparsity():
    q, k, v = qkv(256, b=2, h=4, d=16, kv_heads=2)
    mask = fam.create_block_mask(causal, None, None, 256, 256, device="cpu")
    options = {"BLOCK_M": 64}
    args, kwargs = (q, k, v), {"block_mask": mask, "enable_gqa": True, "kernel_options": options}
    info = flex.read_flex(args, kwargs)
    assert info.shape == (2, 4, 256, 256, 16) and info.kv_heads == 2
    assert any(t is mask.kv_num_blocks for t in info.others)  # excluded from kept bytes
    assert flex.quick_flex(args, kwargs)[3] == (False, True, True, (("BLOCK_M", 64),))
    figures = flex.flex_figures(args, kwargs).resolve()
    assert figures["sparsity"] == pytest.approx(mask.sparsity() / 100)
    assert figures["flex"] == {"score_mod": False, "block_mask": True, "enable_gqa": True,
                               "kernel_options": options}


def test_eager_flex_is_measured_as_flex_unfused_and_forward_only_on_cpu():
    s = fadiag.attach(port=0)
    mask = fam.create_block_mask(causal, None, None, 128, 128, device="cpu")
    steps(fam.flex_attention, 3, *qkv(128), block_mask=mask)
    calls = flex_calls(s)
    assert calls and {c.impl for c in calls} == {"flex_unfused"}
    assert all(c.forward_seconds > 0 and c.forward_only for c in calls)
    # No silent zero: the record says there was no backward, and claims no kept bytes.
    assert all(c.backward_seconds == 0.0 and c.kept_bytes is None for c in calls)


def test_memory_flag_fires_for_eager_flex_naming_the_cause_and_the_fix():
    s = fadiag.attach(port=0)
    mask = fam.create_block_mask(causal, None, None, 128, 128, device="cpu")
    steps(fam.flex_attention, 3, *qkv(128), block_mask=mask)
    flex_calls(s)
    flags = [f for r in s.history() for f in r.flags if f.rule == "memory_savings"]
    assert len(flags) == 1 and flags[0].impl == "flex_unfused" and flags[0].value < 0.8
    assert "flex_attention ran without torch.compile, so it materializes [B,H,Sq,Sk] scores" \
        in flags[0].message
    assert "wrap it with torch.compile" in flags[0].message


def test_a_call_during_which_dynamo_compiled_is_counted_as_compiling_not_timed():
    s = fadiag.attach(port=0)
    q, k, v = qkv(64, d=8)  # a shape no other test uses: its first call compiles
    steps(fam.flex_attention, 2, q, k, v)
    calls = flex_calls(s)
    assert len(calls) == 1  # the second call; the first one's seconds were compiling
    assert s.recorder.unmeasured == {"compiling": 1}
    assert sample(s, "fadiag_attention_uninstrumented_calls_total", reason="compiling") == 1.0


def test_compiled_flex_is_measured_as_flex_with_its_block_mask_sparsity(compiled, causal_mask):
    s = fadiag.attach(port=0)
    fn = torch.compile(fam.flex_attention)
    steps(fn, 3, *qkv(S), block_mask=causal_mask)
    calls = flex_calls(s)
    assert len(calls) == 3 and {c.impl for c in calls} == {"flex"}
    assert all(c.forward_seconds > 0 for c in calls)
    assert calls[0].sparsity == pytest.approx(causal_mask.sparsity() / 100)  # 6 of 16 blocks
    site = s.last_step().sites()[0]
    assert site.sparsity == pytest.approx(0.375)
    assert site.dense_forward_seconds == pytest.approx(site.forward_seconds / 0.625)


def test_compiled_flex_on_cpu_claims_no_kept_bytes_or_savings_since_it_has_no_backward(
        compiled, causal_mask):
    s = fadiag.attach(port=0)
    steps(torch.compile(fam.flex_attention), 2, *qkv(S), block_mask=causal_mask)
    calls = flex_calls(s)
    assert calls and all(c.forward_only and c.kept_bytes is None for c in calls)
    assert all(c.memory_savings is None for c in calls)
    assert not [f for r in s.history() for f in r.flags]


def test_compiled_flex_outputs_are_bit_identical_with_and_without_fadiag(compiled, causal_mask):
    args = qkv(S, seed=3)
    plain = [compiled(*args, block_mask=causal_mask) for _ in range(2)]
    fadiag.attach(port=0)
    measured = steps(torch.compile(fam.flex_attention), 2, *args, block_mask=causal_mask)
    assert all(torch.equal(a, b) for a, b in zip(plain, measured, strict=True))


def test_eager_flex_outputs_are_bit_identical_with_and_without_fadiag():
    args = qkv(128, seed=4)
    plain = fam.flex_attention(*args)
    fadiag.attach(port=0)
    assert torch.equal(plain, steps(fam.flex_attention, 1, *args)[0])


def test_compiling_flex_under_fadiag_adds_no_graph_break_and_no_recompile(compiled, causal_mask):
    from torch._dynamo.utils import counters

    before = {k: dict(v) for k, v in counters.items()}
    fadiag.attach(port=0)
    steps(torch.compile(fam.flex_attention), 3, *qkv(S), block_mask=causal_mask)
    steps(torch.compile(fullgraph=True)(fam.flex_attention), 1, *qkv(S), block_mask=causal_mask)
    after = {k: dict(v) for k, v in counters.items()}
    assert after.get("stats", {}).get("unique_graphs") == before.get("stats", {}).get("unique_graphs")
    assert after.get("graph_break", {}) == before.get("graph_break", {})
    assert after.get("recompiles", {}) == before.get("recompiles", {})


def test_flex_compiled_before_attach_is_measured_and_restored_at_detach(compiled, causal_mask):
    original = globals()["_PRECOMPILED"]
    s = fadiag.attach(port=0)
    steps(lambda *a, **kw: globals()["_PRECOMPILED"](*a, **kw), 2, *qkv(S),
          block_mask=causal_mask)
    assert {c.impl for c in flex_calls(s)} == {"flex"}
    fadiag.detach()
    assert globals()["_PRECOMPILED"] is original


def test_measured_compiled_flex_is_not_counted_again_as_flex_compiled(compiled, causal_mask):
    s = fadiag.attach(port=0)
    steps(torch.compile(fam.flex_attention), 2, *qkv(S), block_mask=causal_mask)
    assert {c.impl for c in flex_calls(s)} == {"flex"}
    assert "flex_compiled" not in s.recorder.unmeasured_totals()


def test_detach_restores_torch_compile_and_flex_attention():
    compile_fn, flex_fn = torch.compile, fam.flex_attention
    fadiag.attach(port=0)
    assert torch.compile is not compile_fn and fam.flex_attention is not flex_fn
    fadiag.detach()
    assert torch.compile is compile_fn and fam.flex_attention is flex_fn


def test_flex_records_keep_sparsity_and_forward_only_through_the_run_log():
    c = CallRecord(site="m.py:1#0", impl="flex", shape=(1, 2, 512, 512, 16), dtype="float32",
                   causal=False, forward_seconds=1e-3, forward_only=True, sparsity=0.375,
                   flex={"score_mod": False, "block_mask": True, "enable_gqa": False})
    report = StepReport(step=1, forward_seconds=1e-3, backward_seconds=0.0, kept_bytes=None,
                        standard_bytes=0, peak_bytes=None, calls=[c])
    back = StepReport.from_dict(report.to_dict()).calls[0]
    assert (back.forward_only, back.sparsity, back.flex) == (True, 0.375, c.flex)


def test_report_site_table_shows_sparsity_and_dense_forward_time_for_flex_sites():
    from fadiag.cli.report.summary import site_table, summarize

    c = CallRecord(site="m.py:1#0", impl="flex", shape=(1, 2, 512, 512, 16), dtype="float32",
                   causal=False, forward_seconds=1e-3, sparsity=0.5)
    report = StepReport(step=1, forward_seconds=1e-3, backward_seconds=0.0, kept_bytes=None,
                        standard_bytes=0, peak_bytes=None, calls=[c])
    rows = site_table(summarize([report]))
    header = rows[0]
    assert rows[1][header.index("impl")] == "flex"
    assert rows[1][header.index("sparsity")] == "0.500"
    assert rows[1][header.index("fwd ms dense")] == "2.00"


def test_flex_calls_are_exported_under_their_impl_label(compiled, causal_mask):
    s = fadiag.attach(port=0)
    steps(torch.compile(fam.flex_attention), 2, *qkv(S), block_mask=causal_mask)
    flex_calls(s)
    assert sample(s, "fadiag_attention_calls_total", impl="flex") == 2.0


# ---- flex inside a compiled model ------------------------------------------------------------

LM_SEQ, LM_DIM, LM_HEADS, LM_LAYERS, LM_VOCAB, LM_STEPS = 256, 32, 2, 2, 64, 3


class FlexLM(torch.nn.Module):
    """Causal flex_attention layers under a trained head, compiled whole. The attention layers
    are frozen: torch has no flex backward on CPU, so only the head gets gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(LM_VOCAB, LM_DIM).requires_grad_(False)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(LM_DIM, 3 * LM_DIM)
                                       for _ in range(LM_LAYERS)).requires_grad_(False)
        self.head = torch.nn.Linear(LM_DIM, LM_VOCAB)
        self.mask = fam.create_block_mask(causal, None, None, LM_SEQ, LM_SEQ, device="cpu")

    def forward(self, tokens):
        b, s = tokens.shape
        x = self.emb(tokens)
        for proj in self.qkv:
            q, k, v = proj(x).view(b, s, 3, LM_HEADS, -1).permute(2, 0, 3, 1, 4)
            y = fam.flex_attention(q, k, v, block_mask=self.mask)
            x = x + y.transpose(1, 2).reshape(b, s, LM_DIM)
        return self.head(x)


def _tokens(step):
    return torch.randint(0, LM_VOCAB, (1, LM_SEQ), generator=torch.Generator().manual_seed(step))


def _train_lm(model, steps):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for i in range(steps):
        tokens = _tokens(i)
        loss = torch.nn.functional.cross_entropy(model(tokens).view(-1, LM_VOCAB), tokens.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _compiled_run(attached, tmp_path=None):
    """FlexLM compiled afresh and trained LM_STEPS steps, with fadiag attached or not."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    run = {}
    session = fadiag.attach(port=0, jsonl=str(tmp_path)) if attached else None
    try:
        # Deterministic inductor, compile caches off: both runs compile the same way.
        with torch._inductor.config.patch(deterministic=True, fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            model = FlexLM()
            run["losses"] = _train_lm(torch.compile(model), LM_STEPS)
            run["head"] = model.head.weight.detach().clone()
        run["counters"] = {k: {n: c for n, c in v.items() if "cache" not in n}
                           for k, v in counters.items()
                           if k in ("stats", "graph_break", "recompiles", "aot_autograd")}
        if session is not None:
            assert session.flush(10)
            run["history"] = session.history()
            run["totals"] = session.recorder.unmeasured_totals()
            run["exported"] = _exported(session, "flex_compiled", run["totals"]["flex_compiled"])
    finally:
        fadiag.detach()
    return run


def _exported(session, reason, expected):
    """The uninstrumented counter a scrape reads, once it reached `expected` (it is refreshed
    from the recorder twice a second) or 10 s passed."""
    registry = CollectorRegistry()
    registry.register(session.metrics)
    deadline = time.monotonic() + 10
    while True:
        value = registry.get_sample_value("fadiag_attention_uninstrumented_calls_total",
                                          {"rank": "0", "reason": reason})
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    """The same compiled FlexLM trained without and with fadiag (its run log in `log`)."""
    log = tmp_path_factory.mktemp("flexlm")
    return {"plain": _compiled_run(False), "fadiag": _compiled_run(True, log), "log": log}


def test_flex_inside_a_compiled_model_is_counted_each_step_with_reason_flex_compiled(lm_runs):
    history = lm_runs["fadiag"]["history"]
    assert [r.unmeasured for r in history] == [{"flex_compiled": LM_LAYERS}] * LM_STEPS
    assert all(not r.calls for r in history)  # counted, not timed: its kernels are generated


def test_totals_and_the_exporter_count_every_run_of_a_compiled_models_flex_calls(lm_runs):
    run = lm_runs["fadiag"]
    assert run["totals"]["flex_compiled"] == LM_LAYERS * LM_STEPS
    assert run["exported"] == LM_LAYERS * LM_STEPS
    assert "flex_compiled_backward" not in run["totals"]  # no flex backward ran (CPU)


def test_compiling_a_model_with_flex_under_fadiag_compiles_the_same_graphs(lm_runs):
    counters = lm_runs["fadiag"]["counters"]
    assert counters == lm_runs["plain"]["counters"]
    assert counters["stats"]["unique_graphs"] >= 1 and not counters.get("graph_break")


def test_a_compiled_model_with_flex_trains_bit_identically_under_fadiag(lm_runs):
    plain, measured = lm_runs["plain"], lm_runs["fadiag"]
    assert measured["losses"] == plain["losses"]
    assert torch.equal(measured["head"], plain["head"])


def test_fadiag_report_names_the_compiled_models_flex_calls_as_not_measured(lm_runs):
    from fadiag.cli.report.summary import format_summary, run_logs, summarize_run
    from fadiag.export.jsonl import read_run

    (log,) = run_logs(lm_runs["log"])
    text = format_summary(summarize_run(read_run(log)))
    assert f"not measured     flex_compiled ({LM_LAYERS * LM_STEPS} calls)" in text


@pytest.fixture(scope="module")
def inference_lm():
    """FlexLM compiled for forwards under no_grad (one inference graph)."""
    model = torch.compile(FlexLM())
    with torch.no_grad():
        model(_tokens(0))
    return model


def test_forward_only_steps_under_no_grad_each_count_their_flex_calls(inference_lm):
    s = fadiag.attach(port=0)
    with torch.no_grad():
        for i in range(3):
            inference_lm(_tokens(i))
            fadiag.step()
    assert s.flush(10)
    assert [r.unmeasured for r in s.history()] == [{"flex_compiled": LM_LAYERS}] * 3


def test_a_manual_step_without_attention_is_still_not_reported(inference_lm):
    s = fadiag.attach(port=0)
    with torch.no_grad():
        inference_lm(_tokens(0))
    fadiag.step()
    fadiag.step()  # nothing ran since the last boundary
    assert s.flush(10)
    assert len(s.history()) == 1


def test_a_graph_compiled_before_attach_counts_its_flex_calls(inference_lm):
    s = fadiag.attach(port=0)  # inference_lm's graph was compiled and run before this
    with torch.no_grad():
        inference_lm(_tokens(1))
    assert s.recorder.unmeasured == {"flex_compiled": LM_LAYERS}


def test_an_error_counting_a_graphs_flex_calls_is_counted_and_the_graph_still_runs(
        inference_lm, monkeypatch):
    def unreadable(graph):
        raise RuntimeError("no graph text")

    with torch.no_grad():
        plain = inference_lm(_tokens(2))
    monkeypatch.setattr(flex, "flex_in", unreadable)
    s = fadiag.attach(port=0)
    with torch.no_grad():
        out = inference_lm(_tokens(2))
    assert torch.equal(out, plain)
    assert s.errors == 1


def test_a_graph_served_from_inductors_cache_counts_its_flex_calls(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    s = fadiag.attach(port=0)
    with torch._inductor.config.patch(fx_graph_cache=True), torch.no_grad():
        for _ in range(2):  # compiled cold, then again from the cache
            torch._dynamo.reset()
            counters.clear()
            torch.compile(FlexLM())(_tokens(0))
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
    assert s.recorder.unmeasured == {"flex_compiled": 2 * LM_LAYERS}


class _Graph:
    """What fadiag reads of an inductor graph: its post-grad graph's text and compile kwargs."""

    def __init__(self, forwards, backwards, graph_id, is_backward):
        self.inductor_post_grad_graph_str = flex._FORWARD * forwards + flex._BACKWARD * backwards
        self.fx_kwargs = {"graph_id": graph_id, "is_backward": is_backward}


def test_the_backward_graph_of_a_measured_compiled_flex_is_not_counted_but_others_are(
        monkeypatch):
    # CPU flex has no backward: the graphs are doubles of a forward / backward pair.
    s = fadiag.attach(port=0)
    measured_fwd, measured_bwd = _Graph(1, 0, 7, False), _Graph(0, 1, 7, True)
    monkeypatch.setattr(flex, "_inside", 1)  # inside a measured torch.compile(flex_attention)
    flex._ran(measured_fwd)
    monkeypatch.setattr(flex, "_inside", 0)
    flex._ran(measured_bwd)  # its backward, run by autograd after the call returned
    assert s.recorder.unmeasured == {}
    flex._ran(_Graph(2, 0, 8, False))
    flex._ran(_Graph(0, 2, 8, True))
    assert s.recorder.unmeasured == {"flex_compiled": 2, "flex_compiled_backward": 2}


def test_detach_restores_inductors_compiled_graph_call():
    from torch._inductor.output_code import CompiledFxGraph

    original = CompiledFxGraph.__call__
    fadiag.attach(port=0)
    assert CompiledFxGraph.__call__ is not original
    fadiag.detach()
    assert CompiledFxGraph.__call__ is original
