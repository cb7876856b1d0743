"""Bypassed eager steps: SDPA's calls run no fadiag Python, named by a learned order.

Inside a launch-bound training step, what the eager wrapper does per call (its checks, the call's
record, its site) costs several times what it does in a loop (BENCHMARKS.md, runs 97-114), and
the dispatcher tap can time every call without it. So once the resolver has learned the order of
a step the wrapper measured (capture/order.py), the recorder bypasses later steps: SDPA's eager
builtin counts each call and calls the original; the tap times it; the resolver names it by its
place in the order. Only measured steps an optimizer (or fadiag.step()) ends are bypassed, and
after every `steps.verify_every - 1` of them the wrapper measures one, so that the order is
checked. A bypassed
step whose calls and the tap's records differ in number (a call with no fused op: SDPA's math
path; compiled code beside the eager calls) or whose records do not match the order is named
`eager#n`, and the wrapper measures until a new order is learned.
"""

from __future__ import annotations

import logging
from typing import Any

from ..capture.order import EagerOrder

log = logging.getLogger("fadiag")

MISSES = 3
"""Bypassed steps that did not match their order, close together, before bypassing ends."""


class Bypass:
    """The recorder's bypassing: SDPA's builtins, their call counts, and the order in use."""

    def __init__(self, verify_every: int, on_error: Any):
        self.verify_every = verify_every
        """steps.verify_every: of this many steps in a row, one is the wrapper's (0 or 1: none
        bypassed)."""
        self.order: EagerOrder | None = None
        """The order the open step is bypassed with (None: the wrapper measures it)."""
        self.steps = 0
        """Steps bypassed (cumulative)."""
        self._on_error = on_error
        self._ext: Any = None
        self._builtins: list[Any] = []
        self._seen = 0  # the builtins' calls counted when the open step began
        self._captured = 0  # the tap's captured calls, when bypassing began or last looked
        self._tap: Any = None
        self._after = 0  # step index before which no learned order is used (the last miss)
        self._misses = 0
        self._since_miss = 0
        self._in_row = 0  # steps bypassed since the last the wrapper measured
        self._verify = False  # the open step is the wrapper's, to check the order

    def use(self, ext: Any, builtins: list[Any]) -> None:
        """SDPA's eager builtins (capture/eager.py): set where they replace the Python wrapper,
        cleared where they stop serving."""
        self.set(None)
        self._ext, self._builtins = ext, list(builtins)

    def next_order(self, rec: Any) -> EagerOrder | None:
        """The order the recorder's next step is bypassed with, or None."""
        tap = self._tap = rec.tap
        order = tap.order if tap is not None else None
        self._verify = False
        if (not self._usable(order) or not self._builtins
                or self.verify_every <= 0 or not rec.measuring or not rec.optimizer_seen
                or rec.fallback_mode or rec.python_hooks or rec.compiled_autograd_configured
                or rec.pending is not None):
            return None
        if self._in_row >= self.verify_every - 1:  # this one the wrapper measures: a check
            self._in_row, self._verify = 0, True
            return None
        self._in_row += 1
        return order

    def set(self, order: EagerOrder | None) -> None:
        """Bypass the open step with `order`, or stop (None)."""
        was, self.order = self.order, order
        if (was is None) == (order is None):
            return
        try:
            if order is not None:
                self._seen = self._calls()
                self._captured = self._tap_captured()
            for fn in self._builtins:
                self._ext.eager_bypass(fn, order is not None)
        except Exception as e:
            self.order = None
            self._on_error("recorder.bypass", e)

    @property
    def seen(self) -> int:
        """The builtins' calls counted when the open step began (cumulative)."""
        return self._seen

    def quiet_budget(self) -> int:
        """Steps that may still close bypassed in C++ (steps/quiet.py) after the open one before
        the wrapper measures one to verify the order: each opens the next bypassed."""
        return self.verify_every - 1 - self._in_row

    def closed_quietly(self, steps: int, seen: int) -> None:
        """`steps` bypassed steps closed in C++, each matching its order as `closing` finds, and
        the next opened bypassed as `next_order` does; `seen`: the builtins' calls counted at the
        last."""
        self.steps += steps
        self._since_miss += steps
        self._in_row += steps
        self._seen = seen

    def learns(self, rec: Any) -> tuple[bool, bool]:
        """Whether the resolver learns the order of the closing step, which the wrapper measured
        (no order in use, or a step that verifies it), and whether the step verifies one."""
        tap = rec.tap
        if not self._builtins or self.verify_every <= 0 or tap is None:
            return False, False
        return self._verify or not self._usable(tap.order), self._verify

    def closing(self, rec: Any, batch: Any, recorded: int, total: int) -> EagerOrder | None:
        """The bypassed step closing with the tap's cut `batch`, `recorded` of its records not
        the wrapper's calls, and `total` the builtins' calls (`_calls()`, read in the cut's C++
        call): its calls counted into the recorder's, and the order that names them (an empty
        one where they cannot be named)."""
        order = self.order
        assert order is not None
        calls, self._seen = total - self._seen, total
        rec.calls_since_boundary += calls
        if calls or recorded:  # else a boundary with nothing in the step (a flush)
            self.steps += 1
            self._since_miss += 1
        if calls != recorded or rec.calls:
            # Calls no fused op served (the math path: the tap saw none), calls a CUDA graph
            # captured (the tap counts their replays), records of compiled code beside them, or
            # calls through the Python wrapper: the records cannot be matched to the order by
            # place, and none is named by it.
            captured = self._tap_captured()
            untapped = calls - recorded - (captured - self._captured)
            self._captured = captured
            if untapped > 0:
                rec.unmeasured["untapped"] = rec.unmeasured.get("untapped", 0) + untapped
            self._missed(rec.step_index)
            return EagerOrder((), rec.step_index)
        if order.broken:
            self._missed(rec.step_index)
        return order

    def _usable(self, order: EagerOrder | None) -> bool:
        """Whether `order` may name bypassed steps: learned, unbroken, since the last miss."""
        return order is not None and not order.broken and order.step >= self._after

    def _tap_captured(self) -> int:
        return int(self._tap.captured()) if self._tap is not None else 0

    def _calls(self) -> int:
        """Calls SDPA's builtins passed to the original while bypassing (cumulative)."""
        return int(self._ext.eager_bypassed())

    def _missed(self, step: int) -> None:
        """A bypassed step did not match its order: the wrapper measures until a new one is
        learned; a third miss with fewer than verify_every bypassed steps since the one before
        ends bypassing for the process (a step whose calls change from step to step)."""
        self._after = step + 1
        self._misses = self._misses + 1 if self._since_miss <= self.verify_every else 1
        self._since_miss = 0
        if self._misses >= MISSES:
            self.verify_every = 0
            log.info("fadiag: eager attention calls did not repeat in the same order from step to "
                     "step (%d times); every call is measured through the wrapper from step %d",
                     MISSES, step)
