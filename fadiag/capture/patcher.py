"""Installs and removes wrappers around attention functions, restoring originals by identity.

Also rebinds names that modules imported before attach() (``from torch.nn.functional import
scaled_dot_product_attention``), so those call sites are measured too.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

_SKIP_MODULE_PREFIXES = ("torch.", "fadiag.", "_pytest", "numpy.")
_ABSENT = object()  # a replaced item whose key was not there before


class Patcher:
    """Remembers every (owner, attribute, original) it replaced, and puts them all back."""

    def __init__(self) -> None:
        self._patches: list[tuple[Any, str, Any, bool]] = []
        self._items: list[tuple[Any, Any, Any]] = []

    def replace(self, owner: Any, attr: str, new: Any) -> Any:
        """Set owner.attr = new; returns the original. Class attributes keep their own/inherited state."""
        own = isinstance(owner, type) and attr in owner.__dict__
        original = owner.__dict__[attr] if own else getattr(owner, attr)
        self._patches.append((owner, attr, original, own or not isinstance(owner, type)))
        setattr(owner, attr, new)
        return original

    def replace_item(self, mapping: Any, key: Any, new: Any) -> None:
        """mapping[key] = new, restored on restore() (removed again if it was absent)."""
        self._items.append((mapping, key, mapping.get(key, _ABSENT)))
        mapping[key] = new

    def alias_builtin(self, original: Any, new: Any) -> None:
        """Let TorchScript compile calls to `new` as the builtin op `original` is.

        TorchScript knows builtins by identity; without this, scripting any code that calls a
        wrapped op fails. Scripted code then runs the op itself, unmeasured, as without fadiag.
        """
        try:
            from torch.jit import _builtins

            table = _builtins._get_builtin_table()
        except Exception:  # a torch without TorchScript's table: nothing to alias
            return
        op = table.get(id(original))
        if op is not None:
            # restore() removes it before the wrappers can be freed and their ids reused.
            self.replace_item(table, id(new), op)

    def rebind_everywhere(self, original: Any, new: Any) -> int:
        """Point every module global that *is* `original` at `new`; returns how many."""
        count = 0
        for module, attr, value in user_globals():
            if value is original:
                self._patches.append((module, attr, original, True))
                vars(module)[attr] = new
                count += 1
        return count

    def restore(self) -> None:
        """Undo every replacement, newest first."""
        while self._items:
            mapping, key, original = self._items.pop()
            if original is _ABSENT:
                mapping.pop(key, None)
            else:
                mapping[key] = original
        while self._patches:
            owner, attr, original, own = self._patches.pop()
            if own:
                setattr(owner, attr, original)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(owner, attr)

    def __len__(self) -> int:
        return len(self._patches) + len(self._items)


def user_globals() -> Iterator[tuple[Any, str, Any]]:
    """(module, name, value) for each global of each imported module outside torch and fadiag."""
    for name, module in list(sys.modules.items()):
        if module is None or name.startswith(_SKIP_MODULE_PREFIXES):
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for attr, value in list(namespace.items()):
            yield module, attr, value
