"""``npy``: a memory-mappable matrix plus the IDs in the same order, the simplest input for
scikit-learn and FAISS (docs/exports.md).

``OUT.npy`` holds the vectors (N x D; with per-residue output, all records' rows
concatenated, and ``OUT.offsets.npy`` where input ID i's rows start); ``OUT.ids.txt`` one
input ID per line; ``OUT.provenance.json`` the store's provenance and the export's counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from embedpipe.core.atomic import atomic_paths
from embedpipe.core.output_guard import OutputKind, described_by
from embedpipe.export.blocks import ExportBlock


def companions(out: Path, per_residue: bool) -> dict[str, Path]:
    """The files an npy export writes next to ``OUT.npy``, by role."""
    stem = out.with_suffix("") if out.suffix == ".npy" else out
    names = {"ids": stem.with_name(stem.name + ".ids.txt"), "provenance": stem.with_name(stem.name + ".provenance.json")}
    if per_residue:
        names["offsets"] = stem.with_name(stem.name + ".offsets.npy")
    return names


def ours(out: Path) -> OutputKind:
    """What an npy export's files may replace: those of an earlier npy export, as its
    ``OUT.provenance.json`` (``export_format``) says."""
    return described_by("an npy export", companions(out, False)["provenance"], "export_format", "npy")


def write_npy(out: Path, blocks: Iterable[ExportBlock], attrs: Mapping[str, Any], *, rows: int, dim: int,
              dtype: np.dtype, per_residue: bool, outputs: int, on_block: Callable[[ExportBlock], None]) -> None:
    """Write every file atomically: the companions first, the matrix last (an old matrix is
    removed before the new IDs land, so IDs and vectors of two runs never pair up)."""
    extra = companions(out, per_residue)
    roles = list(extra)
    with atomic_paths(*[extra[r] for r in roles], out) as temps:
        tmp = dict(zip(roles, temps))
        matrix = np.lib.format.open_memmap(temps[-1], mode="w+", dtype=dtype, shape=(rows, dim))
        offsets = np.zeros(outputs + 1, dtype=np.int64)
        row = n = 0
        with open(tmp["ids"], "w", encoding="utf-8", newline="\n") as ids:
            for block in blocks:
                if per_residue:
                    values, block_offsets = block.gathered_residues()
                    offsets[n + 1 : n + len(block.ids) + 1] = block_offsets[1:] + row
                else:
                    values = block.vectors[block.source]  # type: ignore[index]
                matrix[row : row + len(values)] = values
                row, n = row + len(values), n + len(block.ids)
                ids.write("".join(f"{record_id}\n" for record_id in block.ids))
                on_block(block)
        matrix.flush()
        del matrix
        if per_residue:
            with open(tmp["offsets"], "wb") as fh:  # a file object: np.save would add ".npy" to a name
                np.save(fh, offsets)
        tmp["provenance"].write_text(json.dumps(dict(attrs), indent=1, sort_keys=True, default=str) + "\n",
                                     encoding="utf-8")
        out.unlink(missing_ok=True)


def export(out: Path, store: Any, blocks: Iterable[ExportBlock], attrs: Mapping[str, Any], per_residue: bool,
           on_block: Callable[[ExportBlock], None]) -> None:
    """The registry's entry point (``core/export_formats.py``): one row per input ID, or its residues."""
    outputs = len(store) + len(store.aliases)
    rows = _per_residue_rows(store) if per_residue else outputs
    write_npy(out, blocks, attrs, rows=rows, dim=store.dim, dtype=store.dtype, per_residue=per_residue,
              outputs=outputs, on_block=on_block)


def _per_residue_rows(store: Any) -> int:
    """Per-residue rows of all input IDs: each record's rows, once more for each alias."""
    offsets = store.offsets
    lengths = np.diff(offsets)
    alias_rows = np.fromiter((store.index(of) for of in store.aliases.values()), dtype=np.int64)
    return int(offsets[-1] + lengths[alias_rows].sum())
