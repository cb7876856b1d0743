"""Every key of the schema: the list the configuration reference is built from, each key's
default, and the suggestion an unknown key gets ("did you mean exporter.port?").
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, NamedTuple

from .checks import Check, _prefixes, _schema
from .schema import Config


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    default = cls()
    return {f.name: getattr(default, f.name) for f in dataclasses.fields(default)}


def _suggest(cls: type, name: str) -> str:
    """How to fix an unknown key: the key it was probably meant to be, or the keys allowed here."""
    prefix = _prefixes()[cls]
    if "." in name and prefix + name in _all_keys():
        section, _, rest = name.partition(".")
        return f"dotted keys work only as overrides; nest it: {section}: {{{rest}: ...}}"
    by_leaf: dict[str, list[str]] = {}
    for key in _all_keys():
        by_leaf.setdefault(key.rpartition(".")[2], []).append(key)
    misplaced = by_leaf.get(name, [])  # the right name in the wrong section: "port" at the top
    nearby = [key for key in misplaced if key.startswith(prefix)]
    if misplaced:
        return f"did you mean {' or '.join(nearby or misplaced)}?"
    close = difflib.get_close_matches(name, list(_schema(cls)), n=1)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    close = difflib.get_close_matches(name, list(by_leaf), n=1)
    if close:
        return f"did you mean {' or '.join(by_leaf[close[0]])}?"
    return "expected one of " + ", ".join(prefix + key for key in _schema(cls))


@functools.cache
def _all_keys() -> tuple[str, ...]:
    """Every dotted key in the schema, sections included."""
    return tuple(prefix + name for cls, prefix in _prefixes().items() for name in _schema(cls))


class ConfigKey(NamedTuple):
    """One leaf of the schema, for references and tools (see `config_keys()`)."""

    key: str
    """Dotted key: "exporter.port"."""
    owner: type
    """The config class that holds it: ExporterConfig."""
    type: str
    """As annotated: "int", "str | None"."""
    default: Any
    expected: str
    """What a value must be, as error messages say it: "an integer 0..65535"."""


def config_keys(cls: type = Config) -> list[ConfigKey]:
    """Every leaf key of the schema: a section's own keys first, then its subsections in order."""
    prefix, schema = _prefixes()[cls], _schema(cls)
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    keys = [
        ConfigKey(prefix + name, cls, types[name], _defaults(cls)[name], spec.expected)
        for name, spec in schema.items()
        if isinstance(spec, Check)
    ]
    for spec in schema.values():
        if isinstance(spec, type):
            keys += config_keys(spec)
    return keys
