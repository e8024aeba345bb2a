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

from collections.abc import Collection, Iterator
from pathlib import Path

import h5py
import numpy as np
from h5py import h5a

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


class AttrsByName:
    """The attributes of the dataset ``name``, read without opening it (``H5Aopen_by_name``):
    opening a merged store's virtual dataset decodes its whole source mapping (~56 MiB at
    16,000 sources), which ``open_store`` never needs (docs/benchmarks.md)."""

    def __init__(self, f: h5py.File, name: str) -> None:
        self._loc, self._obj = f.id, name.encode()

    def get(self, key: str, default: object = None) -> object:
        """The raw value (bytes for strings: callers use ``attr_to_python``), or ``default``."""
        if not h5a.exists(self._loc, key.encode(), obj_name=self._obj):
            return default
        attr = h5a.open(self._loc, key.encode(), obj_name=self._obj)
        if attr.shape is None:  # an empty attribute
            return default
        value = np.zeros(attr.shape, dtype=attr.dtype)
        attr.read(value)
        return value[()]


def encoding_problem(obj: h5py.HLObject | AttrsByName, path: Path | str, name: str,
                     types: tuple[str, ...]) -> StoreError | None:
    """Why a reader cannot read ``obj`` (an object, or a dataset's :class:`AttrsByName`) by its
    tags (None when it can)."""
    what = "root group" if name == "/" else f"{'group' if isinstance(obj, h5py.Group) else 'dataset'} {name}"
    attrs = obj if isinstance(obj, AttrsByName) else obj.attrs
    etype = attr_to_python(attrs.get("encoding-type"))
    if etype is not None and etype not in types:
        return StoreError(
            f"{path}: {what} has encoding-type {etype!r}, which this embedpipe does not read "
            f"(expected {' or '.join(map(repr, types))}); upgrade embedpipe"
        )
    raw = attrs.get("encoding-version")
    if raw is None:
        return None
    version = major_version(raw)
    if version is None:
        return StoreError(f"{path}: {what} has unreadable encoding-version {attr_to_python(raw)!r}")
    if version > FORMAT_VERSION:
        return newer_version_error(path, version, f"{what} has encoding-version {version}: ")
    return None


def encoding_problems(f: h5py.File, path: Path | str, by_name: Collection[str] = ()) -> list[StoreError]:
    """Every tag problem of ``f``; the datasets ``by_name`` are not opened (:class:`AttrsByName`)."""
    out = []
    for name, types in expected_encodings(f):
        if name in f:
            obj = AttrsByName(f, name) if name in by_name else f[name]
            if problem := encoding_problem(obj, path, name, types):
                out.append(problem)
    return out


def check_encodings(f: h5py.File, path: Path | str, by_name: Collection[str] = ()) -> None:
    """Raise the first encoding problem of ``f`` (readers: ``open_store``, merge)."""
    problems = encoding_problems(f, path, by_name)
    if problems:
        raise problems[0]
