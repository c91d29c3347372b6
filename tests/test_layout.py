"""The package's shape, as a newcomer relies on it: the data path shows in
the subpackages, dependencies run one way, integrations use public names,
and the README and docs stay a size one can read and name what exists."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memguard import _C
from memguard.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "memguard"
SUBPACKAGES = ("telemetry", "memory", "train", "integrations", "cli")
DOCS = ("telemetry", "allocator", "cuda", "throttle", "lightning", "pytest", "options",
        "design", "benchmarks", "platforms")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


MODULES = _modules()
EXTENSIONS = {"memguard._C"}                     # the C core: a leaf, imports nothing


def _imports(name: str) -> set[tuple[str, str | None]]:
    """(module, imported name or None) for every memguard import in a module,
    at any depth: an import inside a function is a dependency too; one under
    ``if TYPE_CHECKING:`` is not (it never runs)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {(a.name, None) for a in node.names if a.name.split(".")[0] == "memguard"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] == "memguard":
                found |= {(base, a.name) for a in node.names}
    return found


def _runtime_nodes(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in _runtime_nodes(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def _edges(name: str) -> set[str]:
    """The memguard modules a module depends on; ``from P import m`` where m
    is a module is an edge to P.m, not to the package P."""
    out = set()
    for module, what in _imports(name):
        known = MODULES.keys() | EXTENSIONS
        target = f"{module}.{what}" if f"{module}.{what}" in known else module
        if target in MODULES and target != name:
            out.add(target)
    return out


def test_the_data_path_shows_in_subpackages():
    for sub in SUBPACKAGES:
        assert (PACKAGE / sub / "__init__.py").is_file(), sub
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "_common.py", "_options.py",
                    "checkpoint.py", "lightning.py"], flat


def test_the_short_names_only_reexport():
    """memguard.lightning and memguard.checkpoint are the subpackages'
    modules under short names: nothing of their own."""
    for name in ("lightning", "checkpoint"):
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        kinds = {type(n).__name__ for n in tree.body}
        assert kinds <= {"Expr", "ImportFrom", "Assign"}, (name, kinds)


def test_common_imports_nothing_of_memguard():
    assert _edges("memguard._common") == set()


def test_no_runtime_module_imports_the_cli():
    runtime = [m for m in MODULES if not m.startswith("memguard.cli") and m != "memguard.__main__"]
    offenders = {m: sorted(e for e in _edges(m) if e.startswith("memguard.cli")) for m in runtime}
    assert {m: e for m, e in offenders.items() if e} == {}


def test_no_two_modules_import_each_other():
    """No cycle of any length, apart from a package re-exporting its own
    children (the children never import their package's __init__ back)."""
    graph = {m: _edges(m) for m in MODULES}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt):], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_integrations_use_public_names_only():
    allowed_private = {"memguard._common"}       # the leaf of shared helpers
    for name in (m for m in MODULES if m.startswith("memguard.integrations.")):
        for module, what in _imports(name):
            if module in allowed_private:
                continue
            private = [p for p in module.split(".") if p.startswith("_")]
            if what is not None and what.startswith("_"):
                private.append(what)
            assert not private, f"{name} imports {module}:{what}"
        source = MODULES[name].read_text()
        reached = re.findall(r"\b(?:guard|memguard|g)\.(_(?!common\b)[a-z]\w*)", source)
        assert not reached, f"{name} reaches into {reached}"


def test_the_guard_class_is_short_enough_to_read():
    tree = ast.parse((PACKAGE / "train" / "guard.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Guard")
    assert cls.end_lineno - cls.lineno + 1 <= 300


def test_readme_is_the_pitch_and_links_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in DOCS:
        assert (ROOT / "docs" / f"{page}.md").is_file(), page
        assert f"docs/{page}.md" in readme, page
    assert "make demo" in readme and "make test" in readme


def test_readme_architecture_names_every_subpackage():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    for sub in (*SUBPACKAGES, "_common"):
        assert f"{sub}/" in section or f"{sub}.py" in section, sub


def test_docs_name_every_option_and_command():
    options = (ROOT / "docs" / "options.md").read_text()
    for name in _C.option_names():
        assert name in options, name
    docs = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    for command in (m.__name__.rpartition(".")[2] for m in COMMANDS):
        assert f"memguard {command}" in docs, command


def test_docs_links_resolve():
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links {target}"


def test_the_options_table_states_the_defaults():
    """docs/options.md's table: every option with its variable and the
    default the C table holds (read in a fresh process, no MEMGUARD_* set)."""
    rows = re.findall(r"^\| `(\w+)` \| `(MEMGUARD_\w+)` \| `?([^|`]+?)`? \|",
                      (ROOT / "docs" / "options.md").read_text(), re.MULTILINE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_")}
    code = "import json, memguard; print(json.dumps(memguard.options()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    defaults = json.loads(out)
    assert {name for name, _, _ in rows} == set(defaults)
    for name, variable, default in rows:
        assert variable == f"MEMGUARD_{name.upper()}", name
        want = defaults[name]
        assert (float(default) if isinstance(want, float) else default) == want, name


def _docs(*pages: str) -> str:
    return "".join((ROOT / "docs" / f"{p}.md").read_text() for p in pages)


def test_docs_name_every_sample_field_and_event():
    from memguard.telemetry import Event, Sample
    text = _docs("telemetry")
    for field in dataclasses.fields(Sample):
        assert f"`{field.name}`" in text, field.name
    for event in Event:
        assert f"`{event.value}`" in text, event.value


def test_docs_name_every_guard_option():
    from memguard.train.config import GuardConfig
    text = _docs("throttle")
    for field in (f for f in dataclasses.fields(GuardConfig) if f.init):
        assert f"`{field.name}`" in text, field.name


def test_docs_flags_are_the_parsers_flags():
    """Every flag of every subcommand is documented, and every
    ``memguard CMD ... --flag`` the docs show is one the parser knows."""
    from memguard.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = _docs(*DOCS, "examples") + (ROOT / "README.md").read_text()
    for command, p in sub.choices.items():
        actions = [a for a in p._actions if a.option_strings and a.dest != "help"]
        for action in actions:
            assert any(re.search(rf"{s}\b", text) for s in action.option_strings), \
                f"memguard {command} {action.option_strings}"
        flags = {s for a in p._actions for s in a.option_strings}
        for shown in re.findall(rf"memguard {command}\b([^`\n]*)", text):
            for flag in re.findall(r"(--[a-z][\w-]*)", shown.split(" -- ")[0]):
                assert flag in flags, f"docs show memguard {command} {flag}"
