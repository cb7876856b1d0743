"""Helpers that read and hook the autograd graph around an attention call.

The fused backward node of a call, the Python hooks that time its backward, whether a backward
may run under compiled autograd, whether a forward is checkpointing's reentrant replay, and the
saved-tensor hooks that count kept bytes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from ..memory import window_peak
from . import backends

if TYPE_CHECKING:
    from .calls import Call, Signature

_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_get_edge = torch.autograd.graph.get_gradient_edge
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class SavedBytes:
    """Saved-tensor hooks that add up what an op keeps for backward, chained to any outer hooks.

    Chaining matters: only the innermost pair of hooks applies, so replacing checkpointing's or
    offloading's hooks would keep alive the very tensors they exist to free.
    """

    def __init__(self, inputs: tuple[Any, ...]):
        self.exclude = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)
                        and not t.is_nested and t.layout == torch.strided}
        self.seen: dict[int, int] = {}
        outer = _top_hooks(False)
        self._outer_pack, self._outer_unpack = outer if outer is not None else (None, None)

    def pack(self, t: torch.Tensor) -> Any:
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self.exclude:
                self.seen[ptr] = storage.nbytes()
        except Exception:  # nested / sparse tensors have no plain storage
            pass
        if self._outer_pack is not None:
            return self._outer_pack(t)
        # Not `t`: a saved output would then hold itself through its own grad_fn, a cycle through
        # C++ that Python's collector cannot see, and the whole graph behind it would never be
        # freed when no backward runs. The detached alias shares storage and version counter.
        return t.detach()

    def unpack(self, packed: Any) -> Any:
        return self._outer_unpack(packed) if self._outer_unpack is not None else packed

    def total(self) -> int:
        return sum(self.seen.values())


def find_fused(node: Any, max_nodes: int = 8) -> tuple[str, tuple[int, ...]] | None:
    """The fused backward node near `node` and its path of next_functions indices."""
    frontier: list[tuple[Any, tuple[int, ...]]] = [(node, ())]
    seen = 0
    while frontier and seen < max_nodes:
        n, path = frontier.pop(0)
        if n is None:
            continue
        seen += 1
        impl = backends.impl_of_node(n)
        if impl is not None:
            return impl, path
        frontier.extend((fn, path + (i,)) for i, (fn, _) in enumerate(n.next_functions))
    return None


def follow(node: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        node = node.next_functions[i][0]
        if node is None:
            return None
    return node


def hook_backward(call: Call, sig: Signature, node: Any, qkv: tuple[Any, Any, Any], rec: Any,
                  on_error: Callable[[str, BaseException], None]) -> None:
    """Python hooks that take `call`'s backward marks: its start when the gradient of its output
    node arrives, its end after the fused backward node (or, where none was found, after the
    nodes that produce the gradients of q, k and v). `rec`: the recorder, whose `backward_seen`
    and `in_backward` the hooks keep (the wrapper reads them to tell passes apart)."""
    timer = call.timer
    probe = call.saved is not None and call.mem0 is not None

    # Run by the autograd engine inside the user's backward(): nothing may escape them.
    def on_backward_start(grad_outputs: Any) -> None:
        try:
            if call.bwd0 is None and call.remaining > 0:  # 0: done, or closed at a pass end
                rec.backward_seen = True
                rec.in_backward += 1
                if probe:
                    call.mem0 = timer.memory_stats()
                call.bwd0 = timer.mark()
                if call.bwd0 is None and timer.capturing():  # a graph captures the backward
                    call.graph_backward = True
                if call.remaining > 1:
                    _queue_callback(close_pass)
        except Exception as e:
            on_error("recorder.backward", e)

    def close_pass() -> None:
        # The end of the backward pass: a partial one (`autograd.grad(out, q)`) ran only
        # some of the ends. The call's backward is then not timed, and nothing stays open.
        try:
            if call.remaining > 0:
                call.remaining = 0
                rec.in_backward = max(0, rec.in_backward - 1)
                if call.bwd0 is not None and call.bwd1 is None:
                    timer.release(call.bwd0)
                    call.bwd0 = None
        except Exception as e:
            on_error("recorder.backward", e)

    def on_backward_end(*_: Any) -> None:
        try:
            if call.remaining <= 0:
                return
            call.remaining -= 1
            if call.remaining == 0:
                rec.in_backward = max(0, rec.in_backward - 1)
                call.bwd1 = timer.mark(call.bwd0)
                if probe and call.mem0 is not None and sig.peak_bytes is not None:
                    bwd_peak = window_peak(call.mem0, timer.memory_stats())
                    sig.peak_bytes = max(sig.peak_bytes, bwd_peak)
        except Exception as e:
            on_error("recorder.backward", e)

    node.register_prehook(on_backward_start)
    fused = follow(node, sig.fused_path) if sig.fused_path is not None else None
    if fused is not None:
        call.remaining = 1
        fused.register_hook(on_backward_end)
        return
    ends: list[Any] = []
    for t in qkv:
        if t.requires_grad:
            n = _get_edge(t).node
            if all(n is not e for e in ends):
                ends.append(n)
    nexts = [n for n, _ in node.next_functions]
    if not ends or all(any(e is n for n in nexts) for e in ends):
        # One node computes every input's gradient (a compiled function's backward): its end
        # is the call's. The ends' pre-hooks fire one after another as the engine runs them,
        # so the last of them would also time what the others ran (the gradient
        # accumulation into leaf q and k: 2 of 3 adds, +10 % of flex's backward at S=2048).
        call.remaining = 1
        node.register_hook(on_backward_end)
        return
    call.remaining = len(ends)
    for n in ends:
        n.register_prehook(on_backward_end)


def compiled_autograd_active() -> bool:
    """Whether compiled autograd is switched on now (its context manager), which only takes
    Python hooks: the C++ hooks cannot describe themselves to it (`compiled_args`), so those calls
    get Python hooks. A module global, cheap enough to read on every call.
    """
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(getattr(ca, "compiled_autograd_enabled", False))


def compiled_autograd_configured() -> bool:
    """Whether `torch._dynamo.config.compiled_autograd` asks compiled code to use it.

    A config read costs ~2 us (dynamo's config module), so it is not read on every call; and
    dynamo's config is per thread, so it is read on the training thread.
    """
    if "torch._dynamo.compiled_autograd" not in sys.modules:
        return False
    config = getattr(sys.modules.get("torch._dynamo"), "config", None)
    return bool(getattr(config, "compiled_autograd", False))


def in_reentrant_checkpoint(limit: int = 64) -> bool:
    """True inside torch.utils.checkpoint's reentrant forward (which runs under no_grad)."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(limit):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False
