"""What a configuration value must be, and the validation every config class runs.

Each key's `Check` says what it accepts and how an error phrases it; `_validate()` (called by each
section's `__post_init__`) raises a `ConfigError` naming the dotted key, read from the root that
schema.py registers. The loader reuses the same checks to report every problem of a file at once.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
import reprlib
import sys
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from ..errors import ConfigError


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


_root: list[type] = []
"""The schema's root, whose fields are the top-level keys (schema.py registers its Config)."""


def set_root(cls: type) -> None:
    """Make `cls` the root every dotted key is read from; schema.py calls it once, after Config."""
    _root[:] = [cls]
    _prefixes.cache_clear()


@functools.cache
def _prefixes() -> dict[type, str]:
    """Each config class's dotted prefix: "" for Config, "rules.hang." for HangRuleConfig."""
    (root,) = _root
    prefixes: dict[type, str] = {root: ""}
    todo: list[type] = [root]
    while todo:
        cls = todo.pop()
        for name, spec in _schema(cls).items():
            if isinstance(spec, type):
                assert spec not in prefixes, f"{spec.__name__} appears twice in the schema"
                prefixes[spec] = f"{prefixes[cls]}{name}."
                todo.append(spec)
    return prefixes


def _problems(
    cls: type, given: Mapping[str, Any], effective: Mapping[str, Any]
) -> Iterator[tuple[str, str]]:
    """(field name, reason) for each bad leaf in `given` and each bad combination in `effective`."""
    schema = _schema(cls)
    bad = set()
    for name, value in given.items():
        check = schema[name]
        if isinstance(check, Check) and not check.accepts(value):
            bad.add(name)
            yield name, f"must be {check.expected}, got {_REPR.repr(value)}"
        elif isinstance(check, Check) and check.entry is not None:
            for key, item in value.items():
                if not check.entry.accepts(item):
                    bad.add(name)
                    yield f"{name}.{key}", f"must be {check.entry.expected}, got {_REPR.repr(item)}"
    for a, b in getattr(cls, "_together", ()):
        if a in bad or b in bad or (effective[a] is None) == (effective[b] is None):
            continue
        have, lack = (a, b) if effective[b] is None else (b, a)
        yield have, f"is set but {_prefixes()[cls]}{lack} is not; set both or neither"


def _validate(obj: Any) -> None:
    cls: type = type(obj)
    prefix = _prefixes()[cls]
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    for name, reason in _problems(cls, values, values):
        raise ConfigError(f"{prefix}{name} {reason}")
    for name, spec in _schema(cls).items():
        value = values[name]
        if isinstance(spec, type) and not isinstance(value, spec):
            raise ConfigError(
                f"{prefix}{name} must be of type {spec.__name__}, got {_REPR.repr(value)}; "
                "load_config() builds one from a mapping"
            )
        if _is_int(value) and _hints(cls)[name] is float:
            object.__setattr__(obj, name, float(value))  # floats accept ints, and store floats
