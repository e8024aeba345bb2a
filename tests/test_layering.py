"""The package order of docs/architecture.md, checked against every import in the package.

The doc's ``layers`` block lists, for each package, the packages it may import; this test reads
that block, walks every ``import`` in ``embedpipe/`` (module-level and inside functions: a late
import hides a dependency, it does not remove it) and fails on an import the block does not allow,
on any import cycle between modules, on a cycle among the packages the block allows (an edge to
``package.module`` counts as one to its package), and on an allowed edge no import uses.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "embedpipe"
DOC = ROOT / "docs" / "architecture.md"


def allowed_imports() -> dict[str, set[str]]:
    """``{package: what it may import}`` from the doc's ```` ```layers ```` block: package names,
    or ``package.module`` for one module of another package."""
    block = re.search(r"```layers\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert block, f"{DOC}: no ```layers block"
    table: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, below = line.partition(":")
            table[name.strip()] = set(below.split())
    return table


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported embedpipe module, line) for every import in the module, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                yield target, node.lineno


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "embedpipe"


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {t for t, _ in imports(name, path, known)} for name, path in known.items()}


def test_the_layers_block_names_every_package() -> None:
    packages = {package_of(m) for m in modules()}
    assert set(allowed_imports()) == packages


def test_no_package_imports_one_the_doc_puts_above_it() -> None:
    table, known = allowed_imports(), modules()
    upward = []
    for name, path in known.items():
        for target, line in imports(name, path, known):
            here, there = package_of(name), package_of(target)
            allowed = table.get(here, set())
            if here != there and there not in allowed and target.removeprefix("embedpipe.") not in allowed:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({here} may import: "
                              f"{' '.join(sorted(table.get(here, set()))) or 'nothing'})")
    assert upward == []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycles_between_modules() -> None:
    assert cycles(graph()) == []


def allowed_packages(table: dict[str, set[str]]) -> dict[str, set[str]]:
    """The block as package edges: ``model.layout`` is an edge to ``model``."""
    return {name: {entry.split(".", 1)[0] for entry in below} for name, below in table.items()}


def test_the_allowed_packages_form_no_cycle() -> None:
    """The block is an order, bottom to top: no package may reach itself through what it allows."""
    assert cycles(allowed_packages(allowed_imports())) == []


def unused_edges(table: dict[str, set[str]], edges: dict[str, set[str]]) -> list[str]:
    """``package: entry`` for each allowed entry no module of the package imports (an entry
    ``package.module`` is used only by an import of that module)."""
    used: set[tuple[str, str]] = set()
    for name, targets in edges.items():
        here = package_of(name)
        for target in targets:
            there, short = package_of(target), target.removeprefix("embedpipe.")
            used |= {(here, entry) for entry in table.get(here, ()) if entry in (there, short)}
    return sorted(f"{here}: {entry}" for here, below in table.items() for entry in below
                  if (here, entry) not in used)


def test_every_allowed_import_is_used() -> None:
    """An allowed edge nobody uses is a claim the code does not make: drop it from the block."""
    assert unused_edges(allowed_imports(), graph()) == []


def test_a_planted_package_cycle_and_an_unused_edge_are_caught() -> None:
    planted = {"core": {"export.formats"}, "export": {"core"}, "cli": {"core", "export"}}
    assert cycles(allowed_packages(planted)) == [["core", "export"]]
    edges = {"embedpipe.cli.commands": {"embedpipe.core.options"}, "embedpipe.export.run": {"embedpipe.core.x"},
             "embedpipe.core.options": {"embedpipe.export.run"}}
    assert unused_edges(planted, edges) == ["cli: export", "core: export.formats"]


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The check itself can fail: a planted ``core`` module importing ``store`` is reported."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from embedpipe.store.format import attr_to_python\n", encoding="utf-8")
    found = [t for t, _ in imports("embedpipe.core.planted", planted, modules())]
    assert found == ["embedpipe.store.format"]
    assert "store" not in allowed_imports()["core"] and "store.format" not in allowed_imports()["core"]


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(planted) == [["a", "b", "c"]]
