"""The family table (embedpipe/model/families.py) is the one list of families: every row is
recognised by the registry, make-test-model offers exactly its formats, each row's capabilities
are what a test model of each of its formats does when loaded (its tokens, whether its runner
takes packed batches), and no other module of the package lists family names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.model import describe, families, inspect, load_model, registry
from embedpipe.model.base import PackedRunner
from embedpipe.runtime.precision import POLICIES

ROOT = Path(__file__).resolve().parents[2]
WRITTEN = [fmt.name for fmt in families.written()]
#: every name the table gives a family or a format
NAMES = {row.name for row in families.FAMILY_TABLE} | {fmt.name for fmt in families.FORMATS}
_NAME = re.compile(r"(?<![\w+-])(" + "|".join(re.escape(n) for n in sorted(NAMES, key=len, reverse=True)) + r")(?![\w+-])")


def family_lists(source: str) -> list[tuple[int, list[str]]]:
    """(line, names) of each place ``source`` lists family names: a tuple, list, set or dict holding
    two or more (at any depth: ``[Family("esm2", ...), Family("esm1b", ...)]``), a function comparing
    a value with two or more, a string (not a docstring) naming two or more, a module constant
    that is one."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            names = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in NAMES}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            compared = [c for cmp in ast.walk(node) if isinstance(cmp, ast.Compare) for c in (cmp.left, *cmp.comparators)]
            names = {c.value for c in compared if isinstance(c, ast.Constant) and c.value in NAMES}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names = set(_NAME.findall(node.value))
        else:
            continue
        if len(names) >= 2:
            found.append((node.lineno, sorted(names)))
    for stmt in tree.body:
        value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Constant) and value.value in NAMES:
            found.append((stmt.lineno, [value.value]))
    return found


def test_no_other_module_of_the_package_lists_family_names() -> None:
    table = ROOT / "embedpipe" / "model" / "families.py"
    lists = {str(path.relative_to(ROOT)): found for path in sorted((ROOT / "embedpipe").rglob("*.py"))
             if path != table and (found := family_lists(path.read_text(encoding="utf-8")))}
    assert lists == {}


@pytest.mark.parametrize("planted", [
    'PT_FAMILIES = ("esm2", "esm1b", "saprot-pt")',
    'FAMILIES = [Family("esm2", claims), Family("esmc-pth", claims)]',
    'HUB = {"Rostlab/ProstT5": "prostt5", "ElnaggarLab/ankh-base": "ankh"}',
    'def pick(family):\n    if family == "esmc":\n        return 1\n    return 2 if family == "hf-esm1b" else 3',
    'HELP = "esm2 or esm1b (a fair-esm .pt), or a Hugging Face directory"',
    'FAMILY = "saprot"',
])
def test_a_second_list_of_families_is_found(planted: str) -> None:
    assert family_lists(planted) != []


def test_a_docstring_or_one_name_as_a_default_is_no_list() -> None:
    assert family_lists('"""Docstrings may name esm2 and esm1b."""\ndef f(family="esm2"):\n    return family') == []


def test_names_are_unique_and_a_format_named_as_a_family_is_that_family_s() -> None:
    rows = [row.name for row in families.FAMILY_TABLE]
    formats = [fmt.name for fmt in families.FORMATS]
    assert len(set(rows)) == len(rows) and len(set(formats)) == len(formats)
    for fmt in families.FORMATS:
        assert fmt.name not in rows or families.row_of(fmt).name == fmt.name, fmt.name
    registered = [name for fmt in families.FORMATS for name in fmt.names]
    assert len(set(registered)) == len(registered)


def test_make_test_model_offers_exactly_the_table_s_formats(tmp_path: Path) -> None:
    refused = CliRunner().invoke(app, ["make-test-model", str(tmp_path / "x"), "--family", "nope"])
    assert refused.exit_code == 1 and refused.stderr.count("\n") == 1, refused.stderr
    offered = refused.stderr.strip().split("; choose ")[1].split(", ")
    assert offered == WRITTEN
    assert all(fmt.reader in families.READERS for fmt in families.FORMATS)


@pytest.mark.parametrize("name", WRITTEN)
def test_each_row_s_capabilities_are_what_its_loaded_test_model_does(tmp_path: Path, name: str) -> None:
    """make-test-model writes the format with its row's writer; the registry's reader for it is
    the format's; facts and the loaded model say the row's capabilities, and the model does them:
    its tokens put the layout's specials around the residues, its runner packs as the row says."""
    fmt = families.format_named(name)
    assert fmt is not None and fmt.writer is not None
    row = families.row_of(fmt)
    out = tmp_path / (name + fmt.writer.suffix)
    result = CliRunner().invoke(app, ["make-test-model", str(out), "--family", name, "--layers", "1"])
    assert result.exit_code == 0, result.output
    spec = result.stdout.strip()
    assert Path(spec) == out and out.exists()
    assert registry.family_for(spec).name == fmt.reader.name
    declared = row.capabilities()
    assert inspect(spec).family == row.name
    loaded = load_model(spec)
    assert (loaded.family, loaded.token_layout, loaded.trained_window, loaded.batch_layouts) == (
        declared.family, declared.token_layout, declared.trained_window, declared.model_fields()["batch_layouts"])
    layout = row.layout
    pair = "d" if layout.chars_per_residue == 2 else ""  # SaProt: an amino acid and its 3Di state a residue
    first, second = ("".join(r + pair for r in residues) for residues in ("ACDEF", "FEDCA"))
    tokens = loaded.tokenize([first, second])
    assert tokens.shape == (2, 5 + layout.extra_tokens)
    assert bool(tokens[0, 0] == tokens[1, 0]) == layout.bos  # the same special first, else the first residue
    assert bool(tokens[0, -1] == tokens[1, -1]) == layout.eos
    runner = loaded.prepare(POLICIES["fp32"], torch.device("cpu"), "sdpa")
    assert isinstance(runner, PackedRunner) == row.packs


@pytest.mark.parametrize("fmt", [f for f in families.FORMATS if f.names], ids=lambda f: f.name)
def test_every_registered_name_is_recognised_by_the_registry(fmt: families.Format, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A name of the table, not cached (an empty hub cache), is its reader's and described, torch-free,
    as its row's."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    declared = families.row_of(fmt).capabilities()
    for name in fmt.names:
        assert registry.is_model_name(name) and registry.family_for(name).name == fmt.reader.name, name
        facts = describe(name)
        assert (facts.kind, facts.family, facts.token_layout, facts.trained_window, facts.packs) == (
            "name", declared.family, declared.token_layout, declared.trained_window, declared.packs), name
