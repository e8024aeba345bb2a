"""No dead definitions: every top-level function and class of the package is named somewhere
else (the package, tests, benchmarks, the workflow, scripts). ruff finds unused imports and
variables; a function nothing calls is found here."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READ = ("embedpipe", "tests", "benchmarks", "workflows", "scripts")


def _texts() -> dict[Path, str]:
    texts = {p: p.read_text(encoding="utf-8") for d in READ for p in (ROOT / d).rglob("*")
             if p.is_file() and p.suffix in (".py", ".smk", ".sh")}
    texts[ROOT / "Snakefile"] = (ROOT / "Snakefile").read_text(encoding="utf-8")
    return texts


def unused_definitions(texts: dict[Path, str]) -> list[str]:
    """``file:line name`` of each top-level def or class whose name appears only where it is defined."""
    words = Counter(word for text in texts.values() for word in re.findall(r"\w+", text))
    out = []
    for path, text in texts.items():
        if path.suffix != ".py" or ROOT / "embedpipe" not in path.parents:
            continue
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if words[node.name] <= 1:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return out


def test_no_top_level_definition_is_unused() -> None:
    assert unused_definitions(_texts()) == []


def test_an_unused_definition_is_found() -> None:
    name = "_".join(("nothing", "calls", "this"))  # spelt so that this file does not name it
    planted = ROOT / "embedpipe" / "planted_for_the_test.py"
    texts = {**_texts(), planted: f"def {name}():\n    return 1\n"}
    assert unused_definitions(texts) == [f"embedpipe/planted_for_the_test.py:1 {name}"]
