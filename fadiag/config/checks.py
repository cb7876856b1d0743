"""What a configuration value must be: each key's `Check`, the phrase its errors use and the test.

`_schema(cls)` gives each field of a config class its Check (or its nested section's class); the
schema's validation (schema.py) and the loader, which reports every problem of a file at once,
both read them.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
import reprlib
import sys
import typing
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple


class Check(NamedTuple):
    """What a value must be: the phrase used in error messages, and the test."""

    expected: str
    accepts: Callable[[Any], bool]
    entry: Check | None = None
    """For a mapping of names to values: what each value must be (its errors name the entry)."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    # Ints beyond float range would overflow when the field converts them to float.
    if _is_int(v):
        return abs(v) <= sys.float_info.max  # type: ignore[arg-type]
    return isinstance(v, float) and abs(v) <= sys.float_info.max  # False for nan and inf


def _integer(lo: int, hi: int | None = None) -> Check:
    text = f"an integer >= {lo}" if hi is None else f"an integer {lo}..{hi}"
    return Check(text, lambda v: _is_int(v) and lo <= v and (hi is None or v <= hi))


def _number(
    *, above: float | None = None, lo: float | None = None, hi: float | None = None
) -> Check:
    if above is not None:
        return Check(f"a number > {above:g}", lambda v: _is_number(v) and v > above)
    assert lo is not None
    if hi is None:
        return Check(f"a number >= {lo:g}", lambda v: _is_number(v) and v >= lo)
    return Check(f"a number {lo:g}..{hi:g}", lambda v: _is_number(v) and lo <= v <= hi)


_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _is_host(v: object) -> bool:
    """An IPv4/IPv6 address or an RFC 1123 host name (whose last label is not all digits, so a
    mistyped address such as 1.2.3 is not taken for a name)."""
    if not isinstance(v, str) or not v:
        return False
    try:
        ipaddress.ip_address(v)
        return True
    except ValueError:
        pass
    labels = v.rstrip(".").split(".")
    return len(v) <= 253 and all(_LABEL.fullmatch(x) for x in labels) and not labels[-1].isdigit()


def _mapping_of(what: str, entry: Check) -> Check:
    """A mapping of non-empty names to values that pass `entry`; each bad value is its own issue."""
    return Check(f"a mapping of {what}",
                 lambda v: isinstance(v, Mapping) and all(isinstance(k, str) and k for k in v),
                 entry)


def _one_of(*choices: str) -> Check:
    return Check("one of " + "|".join(choices), lambda v: isinstance(v, str) and v in choices)


_BY_TYPE = {
    bool: Check("a boolean (true or false)", lambda v: isinstance(v, bool)),
    int: Check("an integer", _is_int),
    float: Check("a number", _is_number),
    str: Check("a non-empty string", lambda v: isinstance(v, str) and v != ""),
}
_OPTIONAL_STR = Check("a non-empty string or null", lambda v: v is None or _BY_TYPE[str].accepts(v))


# --- validation -------------------------------------------------------------------------------

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _schema(cls: type) -> dict[str, Check | type]:
    """Each field of a config class: its Check, or the config class of its nested section."""
    hints = _hints(cls)
    schema: dict[str, Check | type] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            schema[f.name] = hint
        elif f.name in getattr(cls, "_checks", {}):
            schema[f.name] = cls._checks[f.name]  # type: ignore[attr-defined]
        elif hint == str | None:
            schema[f.name] = _OPTIONAL_STR
        else:
            schema[f.name] = _BY_TYPE[hint]
    return schema
