"""``embedpipe export``: a store in the layouts downstream tools read (docs/exports.md).

Formats (registered in ``core/export_formats.py``): ``h5-per-id`` (one dataset per input ID: bio_embeddings, ProtT5 embedder,
protspace, LightAttention, TMbed), ``parquet`` (pandas, polars, DuckDB, Hugging Face
``datasets``), ``npy`` (a memory-mappable matrix plus IDs: scikit-learn, FAISS). Every input
ID of the store is exported, aliases resolved; reading is streamed block by block, so memory
is bounded by a block whatever the store's size, and every output is written atomically.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from embedpipe.core import export_formats as formats
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.output_guard import Output, writing_outputs
from embedpipe.core.progress import progress_bar
from embedpipe.export.blocks import BLOCK_BYTES, ExportBlock, check_ids, iter_blocks
from embedpipe.store import Store, open_store
from embedpipe.store.sources import pinned_by


def writer(fmt: formats.ExportFormat) -> ModuleType:
    """The module that writes ``fmt``, imported only now (the registry in ``core/`` names it)."""
    return importlib.import_module(fmt.module)


@dataclass
class ExportSummary:
    out: Path
    format: str
    layer: int
    per_residue: bool
    pooling: str
    records: int
    aliases: int
    skipped: int
    seconds: float

    def render(self) -> str:
        what = "per-residue rows" if self.per_residue else f"{self.pooling} vectors"
        text = (f"exported {self.records + self.aliases} input IDs ({self.records} records, {self.aliases} aliases) "
                f"as {self.format} -> {self.out}: layer {self.layer} {what} in {self.seconds:.1f} s")
        if self.skipped:
            text += f"\n  {self.skipped} input IDs were skipped when sharding and have no vector (see the store's skipped table)"
        return text


def export_attrs(store: Store, fmt: str, layer: int, per_residue: bool, counts: dict[str, int],
                 pooling: str = "mean") -> dict[str, Any]:
    """Root attributes / metadata of an export: the store's provenance plus what was exported."""
    attrs = {k: v for k, v in store.provenance.items() if k not in ("complete", "json_attrs")}
    attrs.update(
        export_format=fmt, export_source=str(store.path), export_layer=layer,
        export_per_residue=per_residue, export_counts=counts,
    )
    if not per_residue:
        attrs["export_pooling"] = pooling
    return attrs


@contextlib.contextmanager
def _checked(store: Store, fmt: str, out: Path, per_residue: bool, pooling: str) -> Iterator[None]:
    """The export's checks; then its outputs guarded and locked while the block writes them."""
    if per_residue and pooling != "mean":
        raise EmbedpipeError("--pooling chooses a pooled vector; it does not apply with --per-residue")
    if not per_residue and pooling not in store.pooling:
        raise EmbedpipeError(f"{store.path}: has no {pooling} vectors (stored: {', '.join(store.pooling)}); "
                             "BOS vectors need embedpipe embed --pooling bos")
    if per_residue and not store.has_per_residue:
        raise EmbedpipeError(f"{store.path}: has no per-residue vectors (embedded without --per-residue)")
    if Path(out).resolve() == store.path.resolve():
        raise EmbedpipeError(f"{out}: the export would overwrite the store it reads")
    module = writer(formats.BY_NAME[fmt])
    ours = module.ours(out)  # an export replaces only an export of its format
    companions = getattr(module, "companions", None)
    extra: list[Output] = ([(f"the {role} file", p, ours) for role, p in companions(out, per_residue).items()]
                           if companions else [])
    with writing_outputs("export", [("--out", out, ours), *extra], [store.path], pinned=pinned_by([store.path])):
        yield


def _check_ids(store: Store) -> None:
    """validate's ID and count checks before anything is written (docs/exports.md): an ID with
    a newline gave ids.txt more lines than rows, a duplicate ID a traceback in h5-per-id."""
    check_ids(store, "export")


def export_store(store_path: Path, *, fmt: str, out: Path, layer: int = -1, per_residue: bool = False,
                 pooling: str = "mean", quiet: bool = False, block_bytes: int = BLOCK_BYTES) -> ExportSummary:
    """Export every input ID of the store at ``store_path`` to ``out`` in format ``fmt`` (the
    ``pooling`` vectors, or per-residue rows), reading about ``block_bytes`` of vectors at a time."""
    started = time.perf_counter()
    if fmt not in formats.BY_NAME:
        raise EmbedpipeError(f"--format must be one of {', '.join(formats.NAMES)}, not {fmt!r}")
    out = formats.BY_NAME[fmt].output(Path(out))  # npy: OUT.npy (docs/exports.md)
    with open_store(store_path) as store, _checked(store, fmt, out, per_residue, pooling):
        _check_ids(store)
        absolute = store.layer(layer)
        counts = {"records": len(store), "aliases": len(store.aliases), "skipped": len(store.skipped)}
        attrs = export_attrs(store, fmt, absolute, per_residue, counts, pooling)
        blocks = iter_blocks(store, layer=absolute, per_residue=per_residue, pooling=pooling,
                             block_bytes=block_bytes)
        with progress_bar(quiet=quiet, total=counts["records"] + counts["aliases"], unit="id",
                          unit_scale=True, desc=f"export {fmt}") as bar:
            def advance(block: ExportBlock) -> None:
                bar.update(len(block.ids))

            writer(formats.BY_NAME[fmt]).export(out, store, blocks, attrs, per_residue, advance)
    return ExportSummary(out, fmt, absolute, per_residue, pooling, counts["records"], counts["aliases"],
                         counts["skipped"], time.perf_counter() - started)


__all__ = ["ExportSummary", "export_store"]
