"""One per-record check (embedpipe.store.row_checks.record_problem): ``embedpipe validate`` and
``embed --reuse`` (RowChecks, on the rows it copies) name the same problem of the same record.
The expectation is a plain loop over the records, written here from docs/store-format.md's
check 2, not embedpipe's code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedpipe.core.errors import StoreError
from embedpipe.store import EmbeddedRecord, open_store
from embedpipe.store.format import LONG_HANDLING
from embedpipe.store.row_checks import RowChecks, record_problem
from embedpipe.store.validate import validate_store
from helpers.stores import edit_store, set_row, write_store


def first_problem(length, embedded, chars, handling) -> tuple[int, str] | None:
    """Record by record: the first record with any problem, and its first problem in the doc's order."""
    for i in range(len(length)):
        if not 0 <= embedded[i] <= length[i]:
            return i, f"embedded_length {embedded[i]} outside 0..length {length[i]}"
        if chars[i] != length[i]:
            return i, f"length {length[i]} != len(sequence) {chars[i]}"
        if handling[i] not in LONG_HANDLING:
            return i, f"long_handling {handling[i]!r} is not known"
    return None


@pytest.mark.parametrize("seed", range(40))
def test_the_check_names_the_first_bad_record_as_a_loop_over_records_does(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 30))
    length = rng.integers(0, 50, n)
    embedded = np.where(rng.random(n) < 0.1, length + rng.integers(-60, 60, n), rng.integers(0, length + 1))
    chars = np.where(rng.random(n) < 0.1, length + 1, length)
    handling = [str(rng.choice([*LONG_HANDLING, "odd"])) if rng.random() < 0.1 else LONG_HANDLING[0] for _ in range(n)]
    want = first_problem(length, embedded, chars, handling)
    assert record_problem(length, embedded, chars, handling) == want


def _store(tmp_path: Path) -> Path:
    rng = np.random.default_rng(3)
    records = [EmbeddedRecord(id=f"r{i}", sequence="ACDEFG"[: i + 2], precision_used="fp32",
                              mean={1: rng.standard_normal(4).astype(np.float32)}) for i in range(4)]
    return write_store(tmp_path / "s.h5", records, rows=None)


@pytest.mark.parametrize(("edit", "what"), [
    (lambda f: f["embedded_length"].__setitem__(2, 9), "embedded_length 9 outside 0..length 4"),
    (lambda f: set_row(f, "long_handling", 1, b"odd"), "long_handling 'odd' is not known"),
])
def test_validate_and_reuse_name_the_same_problem(tmp_path: Path, edit, what: str) -> None:
    path = edit_store(_store(tmp_path), edit)
    row = 2 if "embedded" in what else 1
    problems = validate_store(path)
    if "long_handling" in what:  # validate counts a column's values once, over all its records
        assert "long_handling has unknown value(s) ['odd']" in problems, problems
    else:
        assert f"record 'r{row}': {what}" in problems, problems
    with open_store(path) as store, pytest.raises(StoreError) as info:
        RowChecks(store, path).check([row])
    assert f"record 'r{row}' (row {row}): {what};" in str(info.value)
    with open_store(path) as store:
        RowChecks(store, path).check([0, 3])  # rows not edited pass
