"""Helpers that read and hook the autograd graph around an attention call.

The fused backward node of a call, whether a backward may run under compiled autograd, whether a
forward is checkpointing's reentrant replay, and the saved-tensor hooks that count kept bytes.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import torch

from . import backends

_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks


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
