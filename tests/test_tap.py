"""The dispatcher tap's registrations: where its kernels sit, what they hand calls on to, and an
op registered from Python (as flash_attn registers its own) measured through the boxed kernel."""

from __future__ import annotations

import sys

import pytest
import torch

import fadiag
from fadiag.capture import tap_ops
from fadiag.capture.tap_ops import TapOp
from tests.native_marks import NEEDS_TAP

pytestmark = NEEDS_TAP

CPU_FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _lines(dump: str, key: str) -> list[str]:
    return [line for line in dump.splitlines() if line.startswith(f"{key}:")]


def test_the_tap_sits_at_backend_select_typed_and_leaves_the_backend_kernel_registered():
    before = torch._C._dispatch_dump(CPU_FLASH)
    s = fadiag.attach(tap="on", **{"exporter.enabled": False})
    during = torch._C._dispatch_dump(CPU_FLASH)
    assert s.recorder.tap.how[CPU_FLASH] == "typed"
    assert s.recorder.tap.how[CPU_FLASH + "_backward"] == "typed"
    assert _lines(during, "CPU") == _lines(before, "CPU")  # the backend's kernel, as it was
    assert not _lines(before, "BackendSelect")
    (tapped,) = _lines(during, "BackendSelect")
    assert "tap.cpp" in tapped
    fadiag.detach()
    assert torch._C._dispatch_dump(CPU_FLASH) == before


# An op pair shaped as flash_attn registers its own (flash_attn_interface.py): (B, S, H, D)
# tensors, `softmax_scale`, `causal`, the forward returning the output and its logsumexp, and a
# backward that writes dq, dk, dv in place (a custom op that mutates its arguments has a kernel of
# its own at ADInplaceOrView, which bumps their versions). The kernels are the CPU flash op's.
NS = "fadiag_tap_test"


@torch.library.custom_op(f"{NS}::_flash_attn_forward", mutates_args=(), device_types="cpu")
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                        softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p, causal,
        scale=softmax_scale)
    return out.transpose(1, 2).contiguous(), lse


@torch.library.custom_op(f"{NS}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor,
                         dk: torch.Tensor, dv: torch.Tensor, dropout_p: float,
                         softmax_scale: float, causal: bool) -> torch.Tensor:
    t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *t, softmax_lse, dropout_p, causal, scale=softmax_scale)
    for dst, g in zip((dq, dk, dv), grads, strict=True):
        dst.copy_(g.transpose(1, 2))
    return softmax_lse.clone()


class FlashAttnFunc(torch.autograd.Function):
    """flash_attn's FlashAttnFunc in miniature: the two ops above, linked by autograd."""

    @staticmethod
    def forward(ctx, q, k, v):
        scale = q.shape[-1] ** -0.5
        out, lse = torch.ops.fadiag_tap_test._flash_attn_forward(q, k, v, 0.0, scale, True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        torch.ops.fadiag_tap_test._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0,
                                                       q.shape[-1] ** -0.5, True)
        ctx.versions = [x._version for x in (dq, dk, dv)]
        return dq, dk, dv


@pytest.fixture
def flash_attn_like(monkeypatch):
    ops = (TapOp(f"{NS}::_flash_attn_forward", "flash_attn", bshd=True),
           TapOp(f"{NS}::_flash_attn_backward", "flash_attn", True, bshd=True))
    monkeypatch.setattr(tap_ops, "TAP_OPS", tap_ops.TAP_OPS + ops)


def _train(q, k, v):
    out = FlashAttnFunc.apply(q, k, v)
    out.sum().backward()
    return out


def test_an_op_registered_from_python_is_measured_boxed_with_its_kept_bytes(flash_attn_like):
    q, k, v = (torch.randn(2, 32, 4, 16, requires_grad=True) for _ in range(3))
    expected = _train(q, k, v)
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    s = fadiag.attach(port=0, tap="on")
    assert s.recorder.tap.how == {**s.recorder.tap.how, f"{NS}::_flash_attn_forward": "boxed",
                                  f"{NS}::_flash_attn_backward": "boxed"}
    out = _train(q, k, v)
    fadiag.step()
    assert s.flush(10)
    assert torch.equal(out, expected)
    assert all(torch.equal(x.grad, g) for x, g in zip((q, k, v), grads, strict=True))
    (call,) = s.last_step().calls
    assert call.impl == "flash_attn" and call.site == "compiled#0"
    assert call.shape == (2, 4, 32, 32, 16) and call.causal
    assert call.forward_seconds > 0 and call.backward_seconds > 0
    # What the backward op receives of the forward: the output and its logsumexp (not q, k, v,
    # the incoming gradient, or dq, dk, dv, which the backward writes).
    assert call.kept_bytes == out.nbytes + 2 * 4 * 32 * 4


def test_a_custom_op_that_mutates_its_arguments_still_bumps_their_versions(flash_attn_like):
    q, k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3))
    fadiag.attach(port=0, tap="on")
    out = FlashAttnFunc.apply(q, k, v)
    node = out.grad_fn
    out.sum().backward()
    assert all(n > 0 for n in node.versions)  # dq, dk, dv written in place, as autograd must see


def test_a_step_boundarys_cut_says_what_it_holds_in_the_same_call():
    """Tap.cut_step: the batch (None when empty), its records of calls not the wrapper's, whether
    anything in it trained, the count of reasons the tap counted, and the calls SDPA's builtins
    passed on while bypassing (what the boundary reads)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    s = fadiag.attach(tap="on", **{"exporter.enabled": False})
    try:
        tap = s.recorder.tap
        q = torch.randn(1, 2, 16, 8, requires_grad=True)
        batch, unlinked, trained, counted, bypassed = tap.cut_step()
        assert (batch, unlinked, trained) == (None, 0, False)
        with torch.no_grad():
            op(q, q, q)  # evaluation: recorded, nothing trained
        assert tap.cut_step()[1:] == (1, False, counted, bypassed)
        tap.cut_step()
        out, lse = op(q, q, q)[:2]
        out.sum().backward()  # the backward op's marks land in the forward's record
        batch, *rest = tap.cut_step()
        assert (len(batch), *rest) == (1, 1, True, counted, bypassed)
        tap.release(batch)
        # A backward op whose arguments name no forward the tap saw: unpaired, counted.
        x = q.detach()
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            torch.ones_like(x), x, x, x, torch.zeros_like(x), lse.detach().clone(), 0.0, False)
        assert tap.cut_step() == (None, 0, False, counted + 1, bypassed)
        # SDPA's builtin, bypassing (steps/bypass.py): each call counted, as the boundary reads.
        builtins = s.capture._builtins
        assert builtins or sys.version_info < (3, 11)  # the builtin needs Python 3.11
        if builtins:
            ext = s.recorder.bypass._ext
            for fn in builtins:
                ext.eager_bypass(fn, True)
            try:
                torch.nn.functional.scaled_dot_product_attention(q, q, q)
                torch.nn.functional.scaled_dot_product_attention(q, q, q)
            finally:
                for fn in builtins:
                    ext.eager_bypass(fn, False)
            batch, *rest = tap.cut_step()
            assert (len(batch), *rest) == (2, 2, False, counted + 1, bypassed + 2)
            tap.release(batch)
    finally:
        fadiag.detach()
    assert s.devices.timer("cpu").marks_in_use() == 0
