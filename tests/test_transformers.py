"""HF transformers: a tiny randomly initialised Llama with attn_implementation="sdpa", and the
attention registry, each call counted once."""

from __future__ import annotations

import pytest
import torch

import fadiag
from tests.native_marks import NEEDS_TAP

transformers = pytest.importorskip("transformers")


def tiny_llama(attn: str):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def train(model, steps=3, session=None):
    """`steps` optimizer steps; with `session`, each flushed before the next begins."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 128, (2, 32), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if session is not None:
            assert session.flush(10)
    return losses


def test_llama_with_sdpa_is_measured_once_per_layer_per_step():
    model = tiny_llama("sdpa")
    s = fadiag.attach(port=0)
    train(model)
    assert s.flush(10)
    r = s.last_step()
    assert len(r.calls) == 2
    call = r.calls[0]
    assert call.shape == (2, 4, 32, 32, 16) and call.kv_heads == 2
    assert call.forward_seconds > 0 and call.backward_seconds > 0
    assert call.impl in ("cpu_flash", "math")


def test_llama_training_is_bit_identical_with_fadiag():
    plain = train(tiny_llama("sdpa"))
    fadiag.attach(port=0)
    assert train(tiny_llama("sdpa")) == plain


def test_a_registered_attention_function_is_measured_once_under_its_name():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def my_attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("my_attention", my_attention)
    model = tiny_llama("my_attention")
    s = fadiag.attach(port=0)
    train(model, steps=2)
    assert s.flush(10)
    r = s.last_step()
    assert [c.impl for c in r.calls] == ["my_attention", "my_attention"]
    assert r.calls[0].interceptor == "transformers:my_attention"
    fadiag.detach()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS["my_attention"] is my_attention


@pytest.mark.parametrize("checkpointing", [False, True])
@NEEDS_TAP[0]
@NEEDS_TAP[1]
def test_llama_steps_are_bypassed_and_report_as_the_wrapper_measures_them(checkpointing):
    # HF's "sdpa" entry calls the patched SDPA: once the wrapper has measured a step, later
    # steps are bypassed (steps/bypass.py) and report what the wrapper's steps report.
    def llama():
        model = tiny_llama("sdpa")
        if checkpointing:  # transformers 5 renamed it; 4.x has the old name only
            enable = (getattr(model, "activation_checkpointing_enable", None)
                      or model.gradient_checkpointing_enable)
            # Non-reentrant, whatever the version's default: a reentrant checkpoint's first
            # forward runs without grad, which the wrapper measures itself (never bypassed).
            enable({"use_reentrant": False})
        return model.train()

    plain = train(llama(), 12)
    s = fadiag.attach(port=0, tap="on", **{"steps.verify_every": 5})
    assert train(llama(), 12, s) == plain  # each step's order learned before the next boundary
    assert s.recorder.bypass.steps == 8  # 4-7 and 9-12 (step 8 the wrapper's check)
    reports = s.history()
    assert len(reports) == 12

    def rows(r):
        return sorted((c.site, c.impl, c.shape, c.kv_heads, c.recompute, c.kept_bytes,
                       c.standard_bytes) for c in r.calls)

    wrapper = rows(reports[2])  # step 3: the wrapper's, its calls linked to the tap's records
    assert len({row[0] for row in wrapper}) == 2  # one site per layer, in HF's sdpa entry
    assert all("sdpa_attention.py" in row[0] for row in wrapper)
    assert [row[4] for row in wrapper].count(False) == 2  # a forward per layer
    assert [row[4] for row in wrapper].count(True) == (2 if checkpointing else 0)
    for r in reports[2:]:
        assert rows(r) == wrapper
        # Every forward timed, and each layer's backward (paired with the recomputation where
        # the layer is checkpointed: its outputs are what the backward op receives).
        assert all(c.forward_seconds > 0 for c in r.calls)
        assert all(site.backward_seconds > 0 for site in r.sites())
        assert not r.unmeasured
