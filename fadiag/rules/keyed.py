"""State the rules keep per site or step key, bounded: a padded batch adds a key per length.

Shared by the ratio rule (engine.py) and the regression rule (regression.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TOTAL = "*"
"""The `site` of a flag about a whole step."""
KEYS = 4096
"""Site or step keys whose state a rule keeps, at most."""


def bounded(by_key: dict, key: object, make: Callable[[], Any]) -> Any:
    """`by_key[key]`, made if new, evicting the oldest key past KEYS."""
    value = by_key.get(key)
    if value is None:
        if len(by_key) >= KEYS:
            del by_key[next(iter(by_key))]
        value = by_key[key] = make()
    return value
