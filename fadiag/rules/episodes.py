"""Rule episodes: a flag when a condition starts or grows graver, a cleared flag when it ends.

The rules (engine.py) say, each evaluation, which (rule, site) conditions hold and the flag each
would raise; `Episodes` turns that into what a sink hears: once per episode, not once per step.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..steps.records import Flag

CLEAR_AFTER = 3
"""Calm evaluations (steps, or hang checks) before an open episode is cleared."""
_RANK = {"info": 0, "warning": 1, "critical": 2}
"""Severities in order: a condition above its open episode's raises a flag at once."""


class Episodes:
    """The open episodes of one process's rules, by (rule, site).

    Example::

        episodes = Episodes(rank=0)
        episodes.update({("hang", "*"): flag}, rules=("hang",), step=7)   # [flag]
        episodes.update({}, rules=("hang",), step=8)                      # [] (calm 1 of 3)
    """

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.active: dict[tuple[str, str], Flag] = {}
        self._calm: dict[tuple[str, str], int] = {}

    def update(self, conditions: dict[tuple[str, str], Flag], rules: Iterable[str],
               step: int) -> list[Flag]:
        """Flags raised and cleared by this evaluation of `rules`, whose holding conditions are
        `conditions`.

        A condition of higher severity than its open episode raises a flag at once (a healthy
        cuDNN job on an H200 holds an `info` ratio episode open for good; its backward turning
        1.5x slow must still raise the warning). A lower one ends the episode only after
        CLEAR_AFTER such evaluations, and then opens its own, so a value at a band's edge is one
        episode, not a flag every other step."""
        out = []
        for key, flag in conditions.items():
            old = self.active.get(key)
            if old is None or _RANK.get(flag.severity, 0) > _RANK.get(old.severity, 0):
                self.active[key] = flag
                out.append(flag)
        rules = tuple(rules)
        for key in list(self.active):
            if key[0] not in rules:
                continue
            holding = conditions.get(key)
            old = self.active[key]
            if holding is not None and _RANK.get(holding.severity, 0) >= _RANK.get(old.severity, 0):
                self._calm.pop(key, None)
                continue
            # An episode ends after CLEAR_AFTER calm (or milder) evaluations, so a value hovering
            # at the threshold is one episode, not a flag every other step.
            self._calm[key] = self._calm.get(key, 0) + 1
            if self._calm[key] < CLEAR_AFTER:
                continue
            del self._calm[key]
            del self.active[key]
            out.append(Flag(rule=old.rule, value=old.value, threshold=old.threshold, step=step,
                            site=old.site, message=f"cleared: {old.rule} at {old.site}",
                            impl=old.impl, shape=old.shape, rank=self.rank, cleared=True,
                            severity=old.severity, band=old.band))
            if holding is not None:  # milder, and lasting: its own episode from here
                self.active[key] = holding
                out.append(holding)
        return out
