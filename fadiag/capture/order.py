"""Eager steps named by their order: what a bypassed step's tapped calls are called.

A training step's eager attention calls repeat step after step: the same sites, in the same order,
with the same ops and shapes. Once the wrapper has measured such a step (every call linked to the
dispatcher tap's record), later steps are *bypassed*: SDPA's eager builtin counts each call and
calls the original, the tap times it as it times compiled code's, and the resolver names the n-th
forward of each pass (a recomputation: the forward it replays) by the n-th call of the learned
order. Every `steps.verify_every`-th step the wrapper measures again, and the order is checked.

Example::

    order = learn(batch.rows(linked=True), step.calls, step.index, tap.order)  # a wrapper's step
    site, sig = name(order, n, key(row))                                        # a bypassed step
"""

from __future__ import annotations

from typing import Any

from .calls import Signature

SITE = "eager"
"""A bypassed call no order names: `eager#n` is the n-th forward of its pass."""

Entry = tuple[Any, str, Signature]
"""A call of the order: its record key (`key`), site and signature."""


def key(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """What names a record apart from its marks, from its row (tap.cpp's `rows()`, as
    Tap._compiled reads it): (op, (B, H, Sq, Sk, D), Dv, kv heads, dtype, device, causal,
    dropout)."""
    return (row[0], row[5], row[6], row[7], row[8], row[9], row[11], row[12])


class EagerOrder:
    """The attention calls of one pass of a step the wrapper measured, in forward order."""

    __slots__ = ("entries", "step", "broken")

    def __init__(self, entries: tuple[Entry, ...], step: int):
        self.entries = entries
        self.step = step
        """The step it was learned (or last verified) from."""
        self.broken = False
        """A bypassed step did not match it (set by the resolver; the recorder stops bypassing)."""

    def same(self, other: EagerOrder) -> bool:
        return len(self.entries) == len(other.entries) and all(
            a[0] == b[0] and a[1] == b[1] and a[2] is b[2]
            for a, b in zip(self.entries, other.entries, strict=True))


def same_layer(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two record keys (op, (B, H, Sq, Sk, D), Dv, kv heads, dtype, device, causal,
    dropout) can be one call site's: all alike but the batch size and sequence lengths, which the
    data decides (variable-length batches)."""
    return a[0] == b[0] and a[1][1] == b[1][1] and a[1][4] == b[1][4] and a[2:] == b[2:]


def name(order: EagerOrder, n: int, here: tuple[Any, ...]) -> tuple[str, Signature | None]:
    """The site of a bypassed step's n-th forward of its pass (with record key `here`) and the
    order's signature for it, where it is that call's: its key the same (a changed batch size or
    sequence length: the site, and None for a signature of its own). Any other call is
    `eager#n`, and the order is broken."""
    entries = order.entries
    entry = entries[n] if n < len(entries) else None
    if entry is None or not same_layer(entry[0], here):
        order.broken = True
        return f"{SITE}#{n}", None
    return entry[1], entry[2] if entry[0] == here else None


def learn(rows: list[Any], calls: list[Any], step: int, old: EagerOrder | None,
          op: str = "sdpa") -> EagerOrder | None:
    """The order of a step the wrapper measured (`rows`: its cut's `rows(linked=True)`, read
    before the cut was consumed; `calls`: the step's calls, joined to their records), where every
    record is a
    linked call of the wrapper of `op` (the one a bypassed step's builtin serves), measured, and
    every pass of the step is alike; else None. `old`, where the step repeats it, verified at
    `step`."""
    by_link = {c.link: c for c in calls if c.link}
    if not rows or len(by_link) != len(calls):
        return None  # calls measured in Python (no fused op ran), or none
    passes: dict[int, list[Entry]] = {}
    for r in rows:
        c = by_link.get(r[18])
        if (c is None or c.sig is None or c.aborted or c.probe or c.fwd0 is None
                or c.sig.op.name != op):
            return None  # compiled code's record, a call not measured, another op's call
        if not r[14]:  # not a recomputation
            passes.setdefault(r[15], []).append((key(r), c.site, c.sig))
    orders = [tuple(p) for p in passes.values()]
    if not orders or any(o != orders[0] for o in orders):
        return None
    new = EagerOrder(orders[0], step)
    if old is not None and not old.broken and old.same(new):
        old.step = max(old.step, step)
        return old
    return new
