"""torch.compile'd training, measured by the dispatcher tap like eager training (CPU inductor).

Compiled code calls the fused SDPA op and its backward op through the dispatcher, where no
Python wrapper runs; the tap (fadiag/capture/tap.py, capture/_native/tap.cpp) measures them there.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fadiag
from fadiag.capture.tap_ops import TAP_OPS, specs
from fadiag.steps.records import StepReport
from tests.metrics import sample
from tests.models import GPT, train
from tests.native_marks import NEEDS_TAP

SEQ, BATCH, DIM, HEADS, LAYERS = 64, 2, 32, 2, 2
ROOT = Path(__file__).resolve().parents[1]


pytestmark = NEEDS_TAP


def _model(checkpointing: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(layers=LAYERS, dim=DIM, heads=HEADS, checkpointing=checkpointing)


@dataclass
class Run:
    losses: list[float]
    counters: dict[str, dict[str, int]]
    """dynamo's graph, graph-break and recompile counters."""
    history: list[StepReport]
    steps_total: float | None


def _run(model: torch.nn.Module, steps: int, attached: bool) -> Run:
    """Compile `model` afresh and train it, with fadiag attached or not."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    session = fadiag.attach(port=0, tap="on") if attached else None
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        # Inductor's deterministic mode: no choice made by benchmarking on the machine, so two
        # compilations of one model make the same code whatever the machine's load. The compile
        # caches are off so that both runs compile the same way (one cold, one served from
        # the other's cache would not be compared like with like). Torch's deterministic
        # algorithms too: without them inductor lowers the embedding's backward (an index_put
        # that accumulates) to atomic adds, whose order on two threads follows the scheduler, so
        # a plain run alone is not bit-reproducible on a busy machine (a last-bit difference at
        # step 4 in one .ci/run of ~20).
        torch.use_deterministic_algorithms(True)
        with torch._inductor.config.patch(deterministic=True, fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            losses = train(torch.compile(model), steps, seq=SEQ, batch=BATCH)
        # What dynamo and AOTAutograd compiled (not whether a compile cache served it).
        counters = {k: {n: c for n, c in v.items() if "cache" not in n}
                    for k, v in torch._dynamo.utils.counters.items()
                    if k in ("stats", "graph_break", "recompiles", "aot_autograd")}
        if session is None:
            return Run(losses, counters, [], None)
        assert session.flush(10)
        return Run(losses, counters, session.history(), sample(session, "fadiag_steps_total"))
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        fadiag.detach()



@pytest.fixture(scope="module")
def plain():
    return _run(_model(), 4, attached=False)


@pytest.fixture(scope="module")
def measured():
    return _run(_model(), 4, attached=True)


def _out_plus_logsumexp() -> int:
    head_dim = DIM // HEADS
    return BATCH * HEADS * SEQ * head_dim * 4 + BATCH * HEADS * SEQ * 4  # fp32 out, fp32 lse


def test_compiled_training_reports_one_call_per_layer_every_step(measured):
    reports = measured.history
    assert [r.step for r in reports] == [1, 2, 3, 4]
    for r in reports:
        assert [c.site for c in r.calls] == [f"compiled#{i}" for i in range(LAYERS)]
        for c in r.calls:
            assert c.impl == "cpu_flash" and c.interceptor == "dispatcher"
            assert c.shape == (BATCH, HEADS, SEQ, SEQ, DIM // HEADS) and c.causal
            assert c.forward_seconds > 0 and c.backward_seconds > 0
            assert not c.recompute


def test_compiled_kept_bytes_are_exactly_the_output_and_logsumexp(measured):
    for r in measured.history:
        assert {c.kept_bytes for c in r.calls} == {_out_plus_logsumexp()}


def test_compiled_standard_bytes_and_savings_equal_eagers_for_the_same_shapes(measured):
    s = fadiag.attach(port=0, tap="on")
    train(_model(), 2, seq=SEQ, batch=BATCH)
    assert s.flush(10)
    eager = s.last_step()
    fadiag.detach()
    compiled = measured.history[-1]
    assert [c.interceptor for c in eager.calls] == ["sdpa"] * LAYERS  # measured by the wrapper
    assert compiled.standard_bytes == eager.standard_bytes
    assert compiled.kept_bytes == eager.kept_bytes
    assert compiled.memory_savings == pytest.approx(eager.memory_savings)


def test_steps_total_counts_every_compiled_optimizer_step(measured):
    assert measured.steps_total == 4


def test_attaching_changes_no_dynamo_graph_break_or_recompile_count(plain, measured):
    assert measured.counters == plain.counters
    assert plain.counters["stats"].get("unique_graphs", 0) >= 1


def test_compiled_losses_are_bit_identical_with_and_without_fadiag(plain, measured):
    assert measured.losses == plain.losses


class UntraceableAttention(torch.autograd.Function):
    """Attention whose forward dynamo cannot trace, as one calling a C++ extension does: under
    torch.compile each call runs eagerly, behind a graph break."""

    @staticmethod
    def forward(ctx, q, k, v):  # type: ignore[no-untyped-def]
        torch._dynamo.graph_break()
        p = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        q, k, v, p = ctx.saved_tensors
        dp = grad @ v.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
        return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad


class UntraceableModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, DIM)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(DIM, 3 * DIM) for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        b, t, c = x.shape
        for qkv in self.qkv:
            q, k, v = qkv(x).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
            x = x + UntraceableAttention.apply(q, k, v).transpose(1, 2).reshape(b, t, c)
        return self.head(x)


def _run_untraceable(attached: bool) -> Run:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = UntraceableModel()
    session = fadiag.attach(port=0) if attached else None
    if session is not None:
        fadiag.instrument(UntraceableAttention, name="untraceable")
    try:
        losses = train(torch.compile(model, backend="aot_eager"), 3, seq=SEQ, batch=BATCH)
        counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()
                    if k in ("stats", "graph_break", "recompiles", "frames")}
        if session is None:
            return Run(losses, counters, [], None)
        assert session.flush(10) and session.errors == 0
        return Run(losses, counters, session.history(), sample(session, "fadiag_steps_total"))
    finally:
        fadiag.detach()


def test_an_instrumented_function_left_eager_by_a_graph_break_is_measured_and_compiles_the_same():
    """A graph break inside an instrument()'d Function leaves each call to run eagerly, and
    dynamo compiled fadiag's wrapper frame on its own, where its test for tracing reads True: every
    call passed through unmeasured, and nothing said so. The wrapper's frames are never dynamo's
    own now: the calls are measured, and dynamo compiles what it compiles without fadiag."""
    plain, run = _run_untraceable(False), _run_untraceable(True)
    assert plain.counters["graph_break"]  # the Function's own break, with and without fadiag
    assert run.counters == plain.counters
    assert run.losses == plain.losses
    assert [r.step for r in run.history] == [1, 2, 3]
    for r in run.history:
        assert [c.impl for c in r.calls] == ["untraceable"] * LAYERS
        assert [c.site.rpartition("#")[2] for c in r.calls] == [str(i) for i in range(LAYERS)]
        assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in r.calls)
        assert not r.unmeasured


@pytest.mark.parametrize("mode", ["non_reentrant"])
def test_compiled_checkpointing_marks_recomputation_and_counts_each_call_once(mode):
    plain = _run(_model(mode), 3, attached=False)
    run = _run(_model(mode), 3, attached=True)
    assert run.losses == plain.losses
    for r in run.history:
        forwards = [c for c in r.calls if not c.recompute]
        assert [c.site for c in forwards] == [f"compiled#{i}" for i in range(LAYERS)]
        recomputed = [c for c in r.calls if c.recompute]
        assert {c.site for c in recomputed} <= {c.site for c in forwards}
        sites = r.sites()
        assert [s.calls for s in sites] == [1] * LAYERS  # a recomputation is not a second call
        assert all(s.backward_seconds > 0 and s.forward_seconds > 0 for s in sites)
        assert r.recompute_seconds == pytest.approx(sum(c.forward_seconds for c in recomputed))
        assert r.forward_seconds == pytest.approx(sum(c.forward_seconds for c in forwards))


def _kernels() -> dict[str, str]:
    return {op.name: torch._C._dispatch_dump(op.name) for op in TAP_OPS
            if any(s["name"] == op.name for s in specs())}


def test_detach_gives_every_op_back_its_kernel_after_200_cycles():
    before = _kernels()
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in before
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for _ in range(200):
        s = fadiag.attach(tap="on", **{"exporter.enabled": False})
        assert s.tap_status == "installed"
        fadiag.detach()
    assert _kernels() == before
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
    assert torch.equal(out, expected)


def _direct(q, k, v):
    """The fused CPU op called as compiled code calls it (no Python wrapper of fadiag's)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]


def test_a_tapped_op_called_directly_is_measured_with_its_backward_and_result_unchanged():
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    expected = _direct(q, k, v)
    expected.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    s = fadiag.attach(port=0, tap="on")
    out = _direct(q, k, v)
    out.sum().backward()
    fadiag.step()
    assert s.flush(10)
    (call,) = s.last_step().calls
    assert torch.equal(out, expected) and all(torch.equal(t.grad, g) for t, g in zip((q, k, v), grads, strict=True))
    assert call.site == "compiled#0" and call.forward_seconds > 0 and call.backward_seconds > 0


def test_a_backward_whose_tensors_name_two_waiting_forwards_pairs_with_the_latest():
    # As under checkpointing: the first pass's outputs are freed, the recomputation's go to the
    # backward, and one of them can sit where the first pass had its own. The first pass's
    # forward never gets a backward of its own; the recomputation's is the one the op serves.
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    s = fadiag.attach(port=0, tap="on")
    first_out, first_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, True)
    out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        torch.ones_like(out), q, k, v, out, first_lse, 0.0, True)
    fadiag.step()
    assert s.flush(10)
    (call,) = s.last_step().calls
    assert call.site == "compiled#1" and call.backward_seconds > 0
    assert s.recorder.unmeasured_totals()["no_grad"] == 1  # the first pass's, not trained
    del first_out


def test_a_tapped_forward_without_backward_is_counted_as_no_grad():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    s = fadiag.attach(port=0, tap="on")
    _direct(q, k, v)
    fadiag.step()
    assert s.flush(10)
    assert s.last_step() is None  # nothing measured: no step to report at fadiag.step()
    assert s.recorder.unmeasured_totals()["no_grad"] == 1


def test_a_new_process_measures_the_first_compiled_step_with_the_default_tap():
    """As a user runs it: a new interpreter, the default `tap: auto`, the extension built on an
    earlier run. The first step's compiled attention is measured (a tap installed only at the
    first step boundary missed it, and the step read as one without attention)."""
    from fadiag.capture import native

    assert native.load("cpu") is not None, native.status("cpu")  # the earlier run's build
    script = textwrap.dedent(f"""
        import torch
        import fadiag
        from tests.models import GPT, train
        torch.manual_seed(0)
        model = torch.compile(GPT(layers={LAYERS}, dim={DIM}, heads={HEADS}))
        session = fadiag.attach(port=0)
        print(session.tap_status)
        train(model, 2, seq={SEQ}, batch={BATCH})
        assert session.flush(30) and session.errors == 0
        for r in session.history():
            print(r.step, [(c.site, c.impl, c.forward_seconds > 0, c.backward_seconds > 0)
                           for c in r.calls], r.unmeasured)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = [(f"compiled#{i}", "cpu_flash", True, True) for i in range(LAYERS)]
    assert done.stdout.splitlines() == ["installed", f"1 {calls} {{}}", f"2 {calls} {{}}"]


def test_tap_off_leaves_compiled_attention_unmeasured_but_steps_counted():
    torch._dynamo.reset()
    s = fadiag.attach(port=0, tap="off")
    train(torch.compile(_model()), 2, seq=SEQ, batch=BATCH)
    assert s.flush(10)
    assert [r.calls for r in s.history()] == [[], []]
    assert sample(s, "fadiag_steps_total") == 2
    assert s.tap_status == "off"


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_with_fadiag_attached_records_no_call_and_exports_sdpa(strict):
    """The wrapper's first test lets the call pass untouched while dynamo traces it (strict
    export: is_dynamo_compiling) and while torch.export traces without dynamo (its compiling
    flag): nothing recorded, and the exported graph holds the attention op."""

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    s = fadiag.attach(port=0, tap="on")
    exported = torch.export.export(Attention(), (q, k, v), strict=strict)
    assert s.recorder.calls_since_boundary == 0
    assert s.recorder.calls == []
    assert "scaled_dot_product" in str(exported.graph)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(exported.module()(q, k, v), expected)


def test_every_tapped_mark_is_given_back_after_a_flush(measured):
    torch._dynamo.reset()
    s = fadiag.attach(port=0, tap="on")
    train(torch.compile(_model()), 3, seq=SEQ, batch=BATCH)
    assert s.flush(10)
    timers = s.recorder.tap.timers.values()
    assert sum(t.pool_size() for t in timers) > 0
    assert [t.marks_in_use() for t in timers] == [0] * len(timers)


def test_compiled_cpu_steps_carry_the_process_cpu_wait_the_rules_read(monkeypatch):
    # Their calls are the tap's, made on the resolver: the boundary still knows the step is on
    # the host clock and reads how long the process waited for a CPU, as for eager CPU steps.
    torch._dynamo.reset()
    s = fadiag.attach(port=0, tap="on")
    monkeypatch.setattr(s._cpu_wait, "read", lambda: 0.42)
    train(torch.compile(_model()), 3, seq=SEQ, batch=BATCH)
    assert s.flush(10)
    steps = s.history()
    assert [len(r.calls) for r in steps] == [LAYERS] * 3
    assert [r.cpu_wait for r in steps] == [0.42] * 3
