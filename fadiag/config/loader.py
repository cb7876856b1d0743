"""Loading a configuration: defaults, a YAML file, a mapping and overrides, merged and checked.

`load_config()` returns a valid `Config` or raises a `ConfigError` listing every problem, each
named by its dotted key (with the file and line when it came from a file); `fadiag check-config`
prints the same issues.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from ..errors import BaselineError, ConfigError
from .checks import _REPR, Check, _prefixes, _problems, _schema
from .keys import _defaults, _suggest
from .schema import Config

# --- loading ----------------------------------------------------------------------------------

ALIASES: Mapping[str, str] = {
    "port": "exporter.port",
    "addr": "exporter.addr",
    "jsonl": "jsonl.path",
    "device": "device",
    "native": "native",
    "tap": "tap",
    "enabled": "enabled",
    "every_n_steps": "sampling.every_n_steps",
    "per_site": "exporter.per_site",
}
"""Short override names (`attach(port=0)`) and the dotted keys they set."""

_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a configuration, located as precisely as it can be.

    ``str(issue)`` is the ``FILE:LINE: key: reason`` line `fadiag check-config` prints.
    """

    key: str
    """Dotted key, or "" for the file or document as a whole."""
    message: str
    """A sentence that names the key: "exporter.port must be an integer 0..65535, got -1"."""
    reason: str
    """The same without the key: "must be an integer 0..65535, got -1"."""
    source: str | None = None
    """The file the value came from; None for a dict, a Config or overrides."""
    line: int | None = None
    """1-based line in `source`, where known."""

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.source and self.line else self.source
        return ": ".join(part for part in (where, self.key, self.reason) if part)

    def describe(self) -> str:
        """The message, prefixed with FILE:LINE when the value came from a file."""
        if not self.source:
            return self.message
        return (
            f"{self.source}:{self.line}: {self.message}"
            if self.line
            else f"{self.source}: {self.message}"
        )


class _Layer(NamedTuple):
    data: object
    source: str | None = None
    lines: Mapping[str, int] = {}


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the Config that `attach(source, **overrides)` runs with.

    Lowest first: defaults, the YAML file named by $FADIAG_CONFIG (only when `source` is None),
    `source` (a YAML path, a mapping or a Config), then `overrides` (dotted keys, ``a__b`` keys or
    the short names in `ALIASES`). FADIAG_DISABLE=1 forces ``enabled: false``. Raises ConfigError
    listing every problem, the first on the first line.
    """
    config, issues = _resolve(
        _layers(source, overrides, os.environ if environ is None else environ)
    )
    if issues:
        raise ConfigError("\n".join(issue.describe() for issue in issues))
    assert config is not None
    return config


def config_issues(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> list[ConfigIssue]:
    """Every problem `load_config()` with the same arguments would raise for; [] when it loads."""
    return _resolve(_layers(source, overrides, os.environ if environ is None else environ))[1]


def validate_mapping(
    data: object, *, source: str | None = None, lines: Mapping[str, int] | None = None
) -> list[ConfigIssue]:
    """Every problem in one document (as `yaml.safe_load` returns it), read over the defaults.

    `lines` maps dotted keys to 1-based lines of `source`, to locate the issues.
    """
    return _resolve([_Layer(data, source, lines or {})])[1]


def _layers(source: object, overrides: object, environ: Mapping[str, str]) -> list[_Layer]:
    layers = []
    if source is None:
        if environ.get("FADIAG_CONFIG"):
            layers += _read_yaml(environ["FADIAG_CONFIG"], " (named by FADIAG_CONFIG)")
    elif isinstance(source, (str, os.PathLike)):
        layers += _read_yaml(source)
    elif isinstance(source, (Mapping, Config)):
        layers.append(_Layer(source))
    else:
        reason = f"must be a YAML path, a mapping or a Config, got {_REPR.repr(source)}"
        layers.append(_Layer(ConfigIssue("", f"the configuration {reason}", reason)))
    if isinstance(overrides, Mapping):
        layers += [_Layer(_override(key, value)) for key, value in overrides.items()]
    elif overrides is not None:
        reason = f"must be a mapping of keys to values, got {_REPR.repr(overrides)}"
        layers.append(_Layer(ConfigIssue("", f"overrides {reason}", reason)))
    if disabled_by_environment(environ):
        layers.append(_Layer({"enabled": False}))
    return layers


def disabled_by_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether FADIAG_DISABLE switches fadiag off (1, true, yes or on)."""
    return environ.get("FADIAG_DISABLE", "").strip().lower() in _TRUE


def _override(key: object, value: object) -> object:
    """One override as a nested mapping: "exporter.port", "exporter__port" and "port" alike."""
    if not isinstance(key, str):
        return {key: value}
    path = key.replace("__", ".")
    if path in ALIASES and not isinstance(value, Mapping):  # jsonl={"path": ...} is the section
        path = ALIASES[path]
    for part in reversed(path.split(".")):
        value = {part: value}
    return value


def _read_yaml(path: str | os.PathLike[str], note: str = "") -> list[_Layer]:
    """The file's document as a layer, followed by a layer for each key given twice in it."""
    source = os.fsdecode(path)

    def failed(reason: str, line: int | None = None) -> list[_Layer]:
        return [_Layer(ConfigIssue("", reason, reason, source, line))]

    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        return failed(f"configuration file not found{note}")
    except UnicodeDecodeError as e:
        return failed(f"configuration file is not UTF-8 text: {e.reason} at byte {e.start}{note}")
    except OSError as e:
        return failed(f"cannot read the configuration file: {e.strerror or e}{note}")
    except ValueError as e:  # a name no file can have: a NUL byte in it
        return failed(f"not a configuration file name ({e}){note}")
    try:
        loader = yaml.SafeLoader(text)
    except yaml.YAMLError as e:  # a character YAML does not allow
        return failed(f"invalid YAML: {e}")
    lines: dict[str, int] = {}
    twice: list[ConfigIssue] = []
    try:
        node = loader.get_single_node()
        if node is not None:  # before constructing: merge keys (`<<`) rewrite the node in place
            lines[""] = node.start_mark.line + 1
            _key_lines(node, "", lines, twice, source)
        data = None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        if mark is None:
            return failed(f"invalid YAML: {e.problem or e.context}")
        return failed(
            f"invalid YAML at column {mark.column + 1}: {e.problem or e.context}", mark.line + 1
        )
    except yaml.YAMLError as e:
        return failed(f"invalid YAML: {e}")
    except RecursionError:
        return failed("invalid YAML: nested too deeply")
    finally:
        loader.dispose()
    return [_Layer(data, source, lines)] + [_Layer(issue) for issue in twice]


def _key_lines(
    node: yaml.Node, prefix: str, lines: dict[str, int], twice: list[ConfigIssue], source: str,
    depth: int = 0,
) -> None:
    """Each key's line, and an issue for each key given twice in one mapping: YAML would keep
    the last silently, and which of two values was meant is the user's to say."""
    # Deeper than the schema nothing needs a line: unknown keys are reported where they start.
    if not isinstance(node, yaml.MappingNode) or depth > 3:
        return
    seen: dict[str, int] = {}
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
            dotted, line = prefix + key.value, key.start_mark.line + 1
            if key.value in seen:
                reason = f"is given twice (lines {seen[key.value]} and {line}); keep one"
                twice.append(ConfigIssue(dotted, f"{dotted} {reason}", reason, source, line))
            seen[key.value] = lines[dotted] = line
            _key_lines(value, f"{dotted}.", lines, twice, source, depth + 1)


def _resolve(layers: list[_Layer]) -> tuple[Config | None, list[ConfigIssue]]:
    """Merge the layers key by key over the defaults, then check the result."""
    issues: list[ConfigIssue] = []
    merged: dict[str, Any] = {}
    origins: dict[str, tuple[str | None, int | None]] = {}
    for layer in layers:
        if isinstance(layer.data, ConfigIssue):
            issues.append(layer.data)
        else:
            _merge(Config, layer.data, merged, origins, layer, issues)
    _check(Config, merged, origins, issues)
    config = None if issues else _build(Config, merged)
    if config is not None and config.enabled:  # the kill switch must not fail on files it never opens
        issues += _file_issues(config, origins)
    issues.sort(key=lambda issue: issue.line or 0)  # stable: a file's issues in line order
    return (None, issues) if issues else (config, [])


def _file_issues(
    config: Config, origins: Mapping[str, tuple[str | None, int | None]]
) -> list[ConfigIssue]:
    """The files a configuration names, checked as the session will read them: a missing
    baseline or TLS file is a configuration error at load time, not a session lost later."""
    from ..rules import baseline  # the only module here that reads a file the user names

    found: list[tuple[str, str]] = []
    path = config.rules.regression.baseline_file
    if path:
        try:
            baseline.load(path)
        except BaselineError as e:
            found.append(("rules.regression.baseline_file",
                          f"must name a baseline written by `fadiag baseline save`: {e}"))
    for key in ("certfile", "keyfile"):
        path = getattr(config.exporter, key)
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            why = "not a file" if os.path.exists(path) else "no such file"
            found.append((f"exporter.{key}", f"must name a readable file, got {path!r} ({why})"))
    return [ConfigIssue(key, f"{key} {reason}", reason, *origins.get(key, (None, None)))
            for key, reason in found]


def _merge(
    cls: type,
    data: object,
    into: dict[str, Any],
    origins: dict[str, tuple[str | None, int | None]],
    layer: _Layer,
    issues: list[ConfigIssue],
) -> None:
    prefix = _prefixes()[cls]
    if isinstance(data, cls):  # a Config or a section: its fields, sections left to recurse
        data = {f.name: getattr(data, f.name) for f in dataclasses.fields(cls)}
    if data is None:  # an empty document or an empty section: the defaults
        return
    if not isinstance(data, Mapping):
        key = prefix.rstrip(".")
        reason = f"must be a mapping of keys to values, got {_REPR.repr(data)}"
        message = f"{key} {reason}" if key else f"the configuration {reason}"
        issues.append(ConfigIssue(key, message, reason, layer.source, layer.lines.get(key)))
        return
    schema = _schema(cls)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        line = layer.lines.get(dotted)
        spec = schema.get(key) if isinstance(key, str) else None
        if spec is None:
            hint = _suggest(cls, str(key))
            issues.append(
                ConfigIssue(
                    dotted,
                    f"unknown key {dotted}; {hint}",
                    f"unknown key; {hint}",
                    layer.source,
                    line,
                )
            )
        elif isinstance(spec, type):
            _merge(spec, value, into.setdefault(key, {}), origins, layer, issues)
        elif spec.entry is not None and isinstance(value, Mapping):
            # A mapping leaf (per_impl) merges entry by entry, so an override adds one impl.
            old = into.get(key)
            into[key] = {**(old if isinstance(old, Mapping) else {}), **value}
            origins[dotted] = (layer.source, line)
            for name in value:
                origins[f"{dotted}.{name}"] = (layer.source, layer.lines.get(f"{dotted}.{name}"))
        else:
            into[key] = value
            origins[dotted] = (layer.source, line)


def _check(
    cls: type,
    merged: dict[str, Any],
    origins: dict[str, tuple[str | None, int | None]],
    issues: list[ConfigIssue],
) -> None:
    prefix = _prefixes()[cls]
    schema = _schema(cls)
    given = {name: value for name, value in merged.items() if isinstance(schema[name], Check)}
    effective = {**_defaults(cls), **given}
    for name, reason in _problems(cls, given, effective):
        key = prefix + name
        issues.append(ConfigIssue(key, f"{key} {reason}", reason, *origins.get(key, (None, None))))
    for name, value in merged.items():
        spec = schema[name]
        if isinstance(spec, type):
            _check(spec, value, origins, issues)


def _build(cls: type, merged: Mapping[str, Any]) -> Any:
    schema = _schema(cls)
    return cls(
        **{
            name: _build(schema[name], value) if isinstance(schema[name], type) else value  # type: ignore[arg-type]
            for name, value in merged.items()
        }
    )
