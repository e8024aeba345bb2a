"""The export format registry (embedpipe/core/export_formats.py): the names are defined once, the
workflow derives its file names and wildcard from it, and it is read without h5py or pyarrow."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from embedpipe.core import export_formats as formats
from embedpipe.core import options
from embedpipe.export.run import writer

ROOT = Path(__file__).resolve().parents[2]


def test_the_names_are_the_registry_s():
    assert options.EXPORT_FORMATS is formats.NAMES
    assert list(formats.BY_NAME) == list(formats.NAMES) == ["h5-per-id", "parquet", "npy"]
    assert formats.workflow_files() == {"h5-per-id": "embeddings.h5", "parquet": "embeddings.parquet",
                                        "npy": "embeddings.npy"}
    # the export rule's {ext} constraint matches each file and nothing else
    pattern = re.compile(rf"embeddings\.({formats.ext_pattern()})")
    assert all(pattern.fullmatch(f.file) for f in formats.REGISTRY)
    assert not pattern.fullmatch("embeddings.h5.tmp") and not pattern.fullmatch("embeddings.csv")


def test_every_format_module_has_the_entry_point():
    for fmt in formats.REGISTRY:
        assert callable(writer(fmt).export), fmt.module


def test_the_workflow_spells_no_format_name():
    """A new format is one registry entry: the rules take names and files from it."""
    for rule in ("common.smk", "export.smk"):
        text = (ROOT / "workflows" / "rules" / rule).read_text(encoding="utf-8")
        code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
        for fmt in formats.REGISTRY:
            assert f'"{fmt.name}"' not in code and f'"{fmt.file}"' not in code and f"|{fmt.ext}" not in code, (rule, fmt.name)


def test_reading_the_registry_imports_no_writer():
    code = ("import sys; import embedpipe.core.options, embedpipe.core.export_formats; "
            "print(sorted(m for m in ('h5py', 'pyarrow', 'numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_format_help_lists_the_registry(monkeypatch):
    """The ``--format`` help is built from the entries: a new one is listed with no CLI change."""
    import importlib

    from typer.testing import CliRunner

    from embedpipe.cli import commands

    def help_text() -> str:
        out = CliRunner().invoke(commands.app, ["export", "--help"], terminal_width=400, env={"COLUMNS": "400"}).output
        return " ".join(out.split())

    assert "h5-per-id (one dataset per ID), parquet or npy (matrix + IDs)." in help_text()
    extra = formats.ExportFormat("zarr", "embeddings.zarr", "embedpipe.export.zarr", "chunked arrays")
    monkeypatch.setattr(formats, "REGISTRY", (*formats.REGISTRY, extra))
    monkeypatch.setattr(formats, "NAMES", (*formats.NAMES, "zarr"))
    try:
        importlib.reload(commands)
        assert "parquet, npy (matrix + IDs) or zarr (chunked arrays)." in help_text()
    finally:
        monkeypatch.undo()
        importlib.reload(commands)
