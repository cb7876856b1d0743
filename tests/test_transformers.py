"""HF transformers: a tiny randomly initialised Llama with attn_implementation="sdpa", and the
attention registry, each call counted once."""

from __future__ import annotations

import pytest
import torch

import fadiag

transformers = pytest.importorskip("transformers")


def tiny_llama(attn: str):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def train(model, steps=3):
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
