"""Readers use the encoding tags the writer puts on every object (as anndata dispatches on
``encoding-type`` / ``encoding-version``).

Each object a reader reads has the encoding types it may carry. An object tagged with an
encoding type this embedpipe does not know, or with an ``encoding-version`` newer than its
``FORMAT_VERSION``, is refused with one line naming the object; ``open_store`` and merge
raise it and ``embedpipe validate`` reports it. Objects without tags are read by name and
dtype; objects a reader does not know are ignored (the additive rule). docs/store-format.md,
"File level" and "Version rule".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import h5py

from embedpipe.core.errors import StoreError
from embedpipe.store.columns import COLUMNS
from embedpipe.store.format import (
    ALIASES,
    ARRAY,
    FORMAT,
    FORMAT_VERSION,
    ID_INDEX,
    OFFSETS,
    POOLED,
    POOLINGS,
    RAGGED,
    RAGGED_STRINGS,
    SKIPPED,
    STRINGS,
    VIRTUAL,
    attr_to_python,
    major_version,
    newer_version_error,
)


def expected_encodings(f: h5py.File) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(object name, encoding types it may carry) for every object of ``f`` that readers read."""
    yield "/", (FORMAT,)
    for column in COLUMNS.values():
        if column.name == "sequence":  # fixed-width strings (format 1) or ragged (format 2)
            yield "sequence", (column.encoding, RAGGED_STRINGS)
            yield from (("sequence/data", (ARRAY,)), ("sequence/offsets", (OFFSETS,)))
        else:
            yield column.name, (column.encoding,)
    groups = {**{p: (POOLED, (ARRAY,)) for p in POOLINGS}, "per_residue": (RAGGED, (ARRAY, VIRTUAL))}
    for group, (group_type, layer_types) in groups.items():
        if group in f:
            yield group, (group_type,)
            yield from ((f"{group}/{k}", layer_types) for k in f[group] if k.startswith("layer_"))
    yield "per_residue/offsets", (OFFSETS,)
    yield "id_index", (ID_INDEX,)
    yield from ((f"id_index/{name}", (STRINGS,)) for name in ("keys", "fences"))
    yield "id_index/rows", (ARRAY,)
    for group, group_type, names in (("aliases", ALIASES, ("id", "of")), ("skipped", SKIPPED, ("id", "reason"))):
        yield group, (group_type,)
        yield from ((f"{group}/{name}", (STRINGS,)) for name in names)


def encoding_problem(obj: h5py.HLObject, path: Path | str, name: str, types: tuple[str, ...]) -> StoreError | None:
    """Why a reader cannot read ``obj`` by its tags (None when it can)."""
    what = "root group" if name == "/" else f"{'group' if isinstance(obj, h5py.Group) else 'dataset'} {name}"
    etype = attr_to_python(obj.attrs.get("encoding-type"))
    if etype is not None and etype not in types:
        return StoreError(
            f"{path}: {what} has encoding-type {etype!r}, which this embedpipe does not read "
            f"(expected {' or '.join(map(repr, types))}); upgrade embedpipe"
        )
    raw = obj.attrs.get("encoding-version")
    if raw is None:
        return None
    version = major_version(raw)
    if version is None:
        return StoreError(f"{path}: {what} has unreadable encoding-version {attr_to_python(raw)!r}")
    if version > FORMAT_VERSION:
        return newer_version_error(path, version, f"{what} has encoding-version {version}: ")
    return None


def encoding_problems(f: h5py.File, path: Path | str) -> list[StoreError]:
    out = []
    for name, types in expected_encodings(f):
        if name in f and (problem := encoding_problem(f[name], path, name, types)):
            out.append(problem)
    return out


def check_encodings(f: h5py.File, path: Path | str) -> None:
    """Raise the first encoding problem of ``f`` (readers: ``open_store``, merge)."""
    problems = encoding_problems(f, path)
    if problems:
        raise problems[0]
