"""The package's layout: docs/architecture.md against the tree, module sizes, what imports what."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fadiag"
DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
MAX_LINES = 400

STAGE_IMPORTS = {
    "capture": {"config", "memory", "errors", "version"},
    "steps": {"capture", "config", "memory", "errors", "version"},
    "rules": {"steps", "config", "memory", "errors", "version"},
    "export": {"steps", "config", "errors", "version"},
    "config": {"errors"},
    "memory": set(),
    "errors": set(),
    "version": set(),
    "testing": set(),
    "session": {"capture", "steps", "rules", "export", "config", "memory", "errors", "version"},
}
"""What each part of the package may import: the data path's direction (docs/architecture.md).
The command line, the integrations and the public API's __init__ may import anything."""
EXCEPTIONS = {
    ("fadiag.config.loader", "fadiag.rules.baseline"):
        "a rules.regression.baseline_file is read at load time by the reader the session uses",
}


def _section(title: str) -> str:
    return DOC.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _source_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package by its __init__.py)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, lazily or not; not those under TYPE_CHECKING
    (annotations only: nothing runs them)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "fadiag"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fadiag":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return found


def _stage(module: str) -> str:
    """capture, steps, rules, export, config, cli, integrations, or a top-level module's name."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_the_folders_the_architecture_page_names_are_the_package_s_folders():
    named = set(re.findall(r"^\| `fadiag/([\w/]+)/` \|", _section("Folders"), re.M))
    tree = {str(d.relative_to(PACKAGE)) for d in PACKAGE.rglob("*")
            if d.is_dir() and "__pycache__" not in d.parts and _source_files(d)}
    assert named == tree, f"named only in the doc: {named - tree}; only in the tree: {tree - named}"


def test_the_modules_the_architecture_page_names_at_the_top_are_the_package_s():
    named = set(re.findall(r"^\| `fadiag/(\w+\.py)` \|", _section("Folders"), re.M))
    tree = {p.name for p in PACKAGE.glob("*.py")}
    assert named == tree, f"named only in the doc: {named - tree}; only in the tree: {tree - named}"


@pytest.mark.parametrize("block", re.findall(r"```python\n(# fadiag/.*?)```", DOC, re.S),
                         ids=lambda block: block.splitlines()[1].strip()[:40])
def test_each_worked_example_of_the_architecture_page_is_in_the_file_it_names(block):
    first, *lines = block.rstrip("\n").split("\n")
    source = (ROOT / first.removeprefix("# ")).read_text(encoding="utf-8")
    assert "\n".join(lines) in source


def test_no_module_of_the_package_is_over_400_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in _modules().values()}
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


def test_the_session_does_not_import_the_package_s_init():
    modules = _modules()
    assert "fadiag" not in _imports("fadiag.session", modules["fadiag.session"], modules)


def test_no_part_of_the_data_path_imports_the_package_s_init():
    modules = _modules()
    upward = {name for name, path in modules.items()
              if _stage(name) in STAGE_IMPORTS and "fadiag" in _imports(name, path, modules)}
    assert upward == set()


def test_imports_between_the_package_s_parts_follow_the_data_path():
    modules = _modules()
    against = []
    for name, path in sorted(modules.items()):
        stage = _stage(name)
        if stage not in STAGE_IMPORTS:
            continue
        for target in sorted(_imports(name, path, modules)):
            other = _stage(target)
            if other != stage and other not in STAGE_IMPORTS[stage] \
                    and (name, target) not in EXCEPTIONS:
                against.append(f"{name} -> {target}")
    assert against == []


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) - {name} for name, path in modules.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []
