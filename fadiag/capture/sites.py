"""Call sites: ``file:line#n``, the user's line that called attention and its n-th call this pass.

The line is the first frame outside torch and fadiag; n counts that line's calls in the current
pass (micro-batch), so the layers of a model called from one line are told apart. The C++ fast
path (FastBegin in _native/marks.cpp) reads and updates the same dicts.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

_INTERNAL_DIRS = (os.path.dirname(torch.__file__) + os.sep,
                  os.path.dirname(os.path.dirname(__file__)) + os.sep)  # torch's and fadiag's
_USER_FILES = (os.path.join("fadiag", "cli", "demo", "training.py"),)
"""fadiag's own files that are user code (the demo's model), so their call sites are named."""


class Sites:
    """Names the call sites of one recorder; `new_pass()` at each micro-batch and step.

    Example::

        sites = Sites()
        site = sites.name(recompute=False, depth=2)  # from the wrapper's caller's caller
    """

    def __init__(self) -> None:
        self.internal: dict[Any, bool] = {}
        """Code object -> whether it is torch's or fadiag's (skipped when naming)."""
        self.locations: dict[tuple[Any, int], str] = {}
        """(code, bytecode offset) -> "file:line"."""
        self.counts: dict[str, int] = {}
        """"file:line" -> its calls this pass."""
        self._recompute_counts: dict[str, int] = {}

    def name(self, recompute: bool, depth: int) -> str:
        """The site of the call `depth` frames above the caller of this method."""
        frame = sys._getframe(depth + 1)
        internal = self.internal
        while frame.f_back is not None:
            code = frame.f_code
            flag = internal.get(code)
            if flag is None:
                flag = internal[code] = (code.co_filename.startswith(_INTERNAL_DIRS)
                                         and not code.co_filename.endswith(_USER_FILES))
            if not flag:
                break
            frame = frame.f_back
        # Keyed by the bytecode offset: f_lineno decodes the line table on every read.
        lk = (frame.f_code, frame.f_lasti)
        loc = self.locations.get(lk)
        if loc is None:
            parts = frame.f_code.co_filename.replace(os.sep, "/").rsplit("/", 2)
            loc = self.locations[lk] = f"{'/'.join(parts[-2:])}:{frame.f_lineno}"
        if recompute:
            # Recomputation (checkpointing) replays a pass in reverse order of its forward.
            r = self._recompute_counts.get(loc, 0)
            self._recompute_counts[loc] = r + 1
            n = self.counts.get(loc, 0) - 1 - r
            return f"{loc}#{max(n, 0)}"
        n = self.counts.get(loc, 0)
        self.counts[loc] = n + 1
        return f"{loc}#{n}"

    def new_pass(self) -> None:
        """A new micro-batch or step: counts start again from 0."""
        self.counts.clear()  # in place: the C++ fast path holds this dict
        self._recompute_counts = {}
