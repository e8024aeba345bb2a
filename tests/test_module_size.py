"""Size limits the project keeps: every module of the package at most 450 lines (small modules
with one job each), and docs/benchmarks.md at most 600 lines (detail belongs in the page of
the subject it measures)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES = 450
BENCHMARKS_LINES = 600


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_every_module_is_at_most_450_lines() -> None:
    modules = sorted((ROOT / "embedpipe").rglob("*.py"))
    assert len(modules) > 100  # the package, not an empty glob
    over = {str(p.relative_to(ROOT)): n for p in modules if (n := _lines(p)) > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines (split them along a seam): {over}"


def test_the_benchmarks_page_is_at_most_600_lines() -> None:
    lines = _lines(ROOT / "docs" / "benchmarks.md")
    assert lines <= BENCHMARKS_LINES, f"docs/benchmarks.md has {lines} lines, more than {BENCHMARKS_LINES}"
