"""The checks of a store's IDs that ``embedpipe validate`` and ``embedpipe export`` (and
``embedpipe index``) share: every ID's text, and ``id_index`` against the IDs. Export refuses a
store before it writes anything, without running the rest of validate, so these live apart
from validate's other checks. Memory is independent of N: IDs are decoded block by block and
the index is compared by an external sort (embedpipe.store.idsort)."""

from __future__ import annotations

from pathlib import Path

import h5py

from embedpipe.core.errors import StoreError
from embedpipe.core.idtext import bad_id_message
from embedpipe.store.format import decode_strings, open_h5
from embedpipe.store.idsort import index_problems_sorted

#: IDs decoded at a time (Python strings: ~70 B each)
ID_ROWS = 1 << 16


def id_text_problems(f: h5py.File) -> tuple[list[str], bool]:
    """IDs, aliases and skipped IDs block by block: UTF-8, no control characters, record IDs
    not empty (uniqueness and the index: embedpipe.store.idsort). Shared by validate and
    export. Returns (problems, whether ``ids`` could be read)."""
    problems: list[str] = []
    for name in ("ids", "aliases/id", "skipped/id"):
        if not isinstance(ds := f.get(name), h5py.Dataset) or ds.ndim != 1:
            continue
        try:
            for lo in range(0, ds.shape[0], ID_ROWS):
                values = decode_strings(ds[lo : lo + ID_ROWS], f"dataset {name}", lo)
                if (bad := bad_id_message(values, f"dataset {name}: id", lo)) is not None:
                    problems.append(bad)
                    break
                if name == "ids" and "" in values:
                    problems.append(f"ids contains an empty id (row {lo + values.index('')})")
                    break
        except StoreError as exc:  # not UTF-8: the dataset and row named
            problems.append(str(exc))
        except OSError as exc:
            if name == "ids":
                return [*problems, f"dataset ids: checksum mismatch or read error ({exc})"], False
            # the checksum pass names the dataset and rows
    return problems, True


def export_problems(path: Path) -> list[str]:
    """What ``embedpipe export`` checks before it writes anything (docs/exports.md): validate's
    ID checks (characters, empty, duplicates across records, aliases and skipped IDs, and
    ``id_index`` exactly the index they give, by an external sort: memory independent of N).
    ``embedpipe index`` makes them too (embedpipe.export.blocks). The layout is checked at open (``open_store``),
    non-finite vectors while streaming (embedpipe.export.blocks); the count attributes are not
    what export writes (its counts are the rows)."""
    with open_h5(path) as f:
        n = int(f["ids"].shape[0])
        problems, readable = id_text_problems(f)
        if readable:
            problems += index_problems_sorted(f, n, compare=True)  # id_index: what ids give
    return problems
