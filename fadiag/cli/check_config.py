"""`fadiag check-config [FILE]`: validate a configuration and print it resolved, or every problem.

`--reference` prints the configuration reference (docs/configuration.md) built from the schema.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
from typing import Any

import yaml

from ..config import Config
from ..config.keys import config_keys
from ..config.loader import ALIASES, config_issues, load_config
from . import _args


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check-config",
        help="validate a configuration file and print the resolved configuration",
        description=(
            "Validate FILE (default: the file named by $FADIAG_CONFIG, else the defaults) the way "
            "fadiag.attach(FILE) loads it. Prints the resolved configuration as YAML and exits 0, "
            "or prints every problem as FILE:LINE: key: message on stderr and exits 1. A FILE "
            "that does not exist exits 2, like every other bad argument."
        ),
    )
    parser.add_argument("file", nargs="?", metavar="FILE", type=_args.existing_file,
                        help="YAML configuration file")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="print the reference of every key (Markdown) and exit",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.reference:
        sys.stdout.write(reference_markdown())
        return 0
    path = None if args.file is None else str(args.file)
    issues = config_issues(path)
    if issues:
        for issue in issues:
            print(issue, file=sys.stderr)
        return 1
    resolved = load_config(path)
    sys.stdout.write(yaml.safe_dump(resolved.to_dict(), sort_keys=False))
    return 0


_INTRO = """\
# Configuration reference

<!-- Generated from fadiag/config/ by `fadiag check-config --reference`; edit the schema, not this file. -->

fadiag reads one configuration, a tree of sections. Every key has a default, so an empty file
(or none at all) is a valid configuration. Pass it to `fadiag.attach()`:

```python
fadiag.attach()                                   # defaults (+ $FADIAG_CONFIG)
fadiag.attach("fadiag.yaml")                      # a YAML file
fadiag.attach({"exporter": {"port": 0}})          # a dict, nested like the file
fadiag.attach(config, port=0, jsonl="/tmp/run")   # a Config, a file or a dict, plus overrides
```

## Precedence

Lowest first; each layer replaces only the keys it names, so a partial section such as
`rules: {hang: {timeout_seconds: 5}}` keeps the other defaults of `rules` and `rules.hang`.

1. the defaults listed below;
2. the YAML file named by `FADIAG_CONFIG` (read only when no configuration is passed);
3. the configuration passed to `attach()` / `load_config()`: a YAML path, a dict or a `Config`;
4. overrides: the keyword arguments of `attach()`, the `overrides` mapping of `load_config()`;
5. `FADIAG_DISABLE`, which forces `enabled: false`.

## Environment variables

| variable | effect |
|---|---|
| `FADIAG_CONFIG` | path of a YAML file used when `attach()` gets no configuration |
| `FADIAG_DISABLE` | `1`, `true`, `yes` or `on` (any case): `enabled` is false whatever the configuration says |

## Overrides

An override key is a dotted key (`"exporter.port": 0`), the same with double underscores
(`exporter__port=0`, usable as a keyword argument), a section with a mapping
(`exporter={"port": 0}`), or one of these short names:

| short name | key |
|---|---|
{aliases}

## Validation

Values are checked when the configuration is loaded, and again when a `Config` is built directly.
An integer key takes an integer (not `true`), a number key takes an integer or a float,
a boolean key takes only `true` or `false` (not `1`, not `"yes"`; YAML 1.1 itself reads a bare
`yes`, `no`, `on` and `off` as booleans). A section left empty (`exporter:`) keeps its defaults;
any other non-mapping is an error. A key given twice in one mapping is an error (YAML would keep
the last silently). Unknown keys are errors and the nearest valid key is suggested. The files a
configuration names are read as the session will read them: `rules.regression.baseline_file`
must load as a baseline, `exporter.certfile` and `exporter.keyfile` must be readable files.

```text
unknown key exporter.prot; did you mean exporter.port?
exporter.port must be an integer 0..65535, got -1
```

`fadiag check-config FILE` prints the resolved configuration (every key, defaults filled in) and
exits 0, or prints every problem with its line and exits 1:

```text
$ fadiag check-config fadiag.yaml
fadiag.yaml:3: exporter.prot: unknown key; did you mean exporter.port?
fadiag.yaml:7: rules.hang.timeout_seconds: must be a number > 0, got 0
```

## Keys
"""


def reference_markdown() -> str:
    """The configuration reference: precedence, environment, overrides, and a table per section."""
    docs = _field_docs()
    aliases = "\n".join(f"| `{alias}` | `{key}` |" for alias, key in ALIASES.items())
    out = [_INTRO.replace("{aliases}", aliases)]
    section = None
    for key in config_keys():
        if key.owner is not section:
            section = key.owner
            name = key.key.rpartition(".")[0]
            summary = (section.__doc__ or "").split("\n")[0]
            summary = summary.partition(": ")[2] if name else "keys at the top level."
            summary = summary[:1].upper() + summary[1:]
            out.append(f"\n### {f'`{name}`' if name else 'Top level'}\n\n{summary}\n\n")
            out.append("| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n")
        meaning = docs.get((key.owner.__name__, key.key.rpartition(".")[2]), "")
        cells = (f"`{key.key}`", key.type, f"`{json.dumps(key.default)}`", key.expected, meaning)
        out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |\n")
    out.append("\n## Every default, as a file\n\n```yaml\n")
    out.append(yaml.safe_dump(Config().to_dict(), sort_keys=False))
    out.append("```\n")
    return "".join(out)


def _field_docs() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the docstring under the field, in the module of each section."""
    docs = {}
    modules = {sys.modules[key.owner.__module__] for key in config_keys()}
    sources = [inspect.getsource(m) for m in sorted(modules, key=lambda m: m.__name__)]
    for node in (n for source in sources for n in ast.walk(ast.parse(source))):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[(node.name, stmt.target.id)] = " ".join(after.value.value.split())
    return docs
