"""docs/architecture.md names every module of the package (issue 21): a newcomer finds each one there."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_is_named_on_the_architecture_page() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "embedpipe"
    unnamed = []
    for path in sorted(package.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        parts = path.relative_to(package).parts
        # named by its path from any package down (`report/page.py` inside the crosscheck/ row)
        if not any(f"`{'/'.join(parts[i:])}`" in page for i in range(len(parts))):
            unnamed.append("/".join(parts))
    assert not unnamed, f"docs/architecture.md does not name: {unnamed}"


def test_at_most_twelve_modules_sit_directly_under_the_package() -> None:
    top = [p.name for p in (ROOT / "embedpipe").glob("*.py")]
    assert len(top) <= 12, top
