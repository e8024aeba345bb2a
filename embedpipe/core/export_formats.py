"""The export formats, defined once: the ``--format`` name, the workflow's file, the module.

Plain data in ``core/`` (no numpy, h5py or pyarrow, nothing of ``export/``): ``core/options.py``
takes the names from here, and the workflow (``workflows/rules/common.smk``, ``export.smk``)
derives its file names and its wildcard constraint from it at start-up. ``embedpipe export``
(:func:`embedpipe.export.run.writer`) imports a format's module by its name only when it is
used; the module provides ``export(out, store, blocks, attrs, per_residue, on_block)``,
``ours(out) -> OutputKind`` (the existing files it may replace: an earlier export of its
format, embedpipe.core.output_guard), and, when it writes more than ``out``,
``companions(out, per_residue) -> {role: path}`` (checked as outputs too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ExportFormat:
    """One format: ``name`` (``--format``, the config key ``exports``), ``file`` (what the
    workflow writes under ``{outdir}/exports/``), the ``module`` that writes it and ``what``
    the ``--format`` help says of it (none: the name says it)."""

    name: str
    file: str
    module: str  # the writer's module, imported by name when used (embedpipe.export.run.writer)
    what: str = ""
    #: added to ``--out`` when it does not end with it (``npy``: ``OUT.npy``, as ``numpy.save``
    #: names a file and docs/exports.md promises); none: ``--out`` as given
    suffix: str = ""

    def output(self, out: Path) -> Path:
        """The file ``--out OUT`` writes: ``OUT``, or ``OUT`` + :attr:`suffix` when it lacks it."""
        return out if not self.suffix or out.name.endswith(self.suffix) else out.with_name(out.name + self.suffix)

    @property
    def ext(self) -> str:
        """The workflow's ``{ext}`` wildcard: ``file`` after ``embeddings.``."""
        return self.file.split(".", 1)[1]


#: the registered formats (``NAMES`` are their ``--format`` names)
REGISTRY: tuple[ExportFormat, ...] = (
    ExportFormat("h5-per-id", "embeddings.h5", "embedpipe.export.h5_per_id", "one dataset per ID"),
    ExportFormat("parquet", "embeddings.parquet", "embedpipe.export.parquet"),
    ExportFormat("npy", "embeddings.npy", "embedpipe.export.npy", "matrix + IDs", suffix=".npy"),
)
#: the ``--format`` names, in the order the help lists them
NAMES: tuple[str, ...] = tuple(f.name for f in REGISTRY)
BY_NAME: dict[str, ExportFormat] = {f.name: f for f in REGISTRY}


def workflow_files() -> dict[str, str]:
    """Format name -> the file the workflow's export rule writes (``common.smk``)."""
    return {f.name: f.file for f in REGISTRY}


def ext_pattern() -> str:
    """The export rule's wildcard constraint for ``{ext}``: ``h5|parquet|npy``."""
    return "|".join(f.ext.replace(".", r"\.") for f in REGISTRY)
