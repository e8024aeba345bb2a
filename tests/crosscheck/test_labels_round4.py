"""Issue 30 (integrity round 4), ``crosscheck --labels``: a label file without its header line
is refused (its first label was silently read as the header and lost), and a user's value
quoted in an error is shortened (a 200 MB label was echoed whole in the "one-line" error)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embedpipe
from embedpipe import open_store
from embedpipe.core.errors import EmbedpipeError
from embedpipe.crosscheck.labels import LabelOptions, read_label_file, resolve_labels
from embedpipe.store import EmbeddedRecord
from helpers.stores import write_store

ROOT = Path(embedpipe.__file__).resolve().parents[1]
HUGE = 2_000_000  # characters: the principle of the 200 MB label, at a test's size


@pytest.fixture
def store(tmp_path: Path) -> Path:
    recs = []
    for i in range(20):
        mean = {2: np.sin(np.arange(4, dtype=np.float64) * (i + 1)).astype(np.float32)}
        recs.append(EmbeddedRecord(id=f"P{i:02d}", sequence="MKTAYIAK"[: 3 + i % 5], precision_used="fp32",
                                   fallback_reason="", mean=mean, per_residue=None, max_abs_activation=1.0,
                                   embedded_length=3 + i % 5))
    return write_store(tmp_path / "s.h5", recs, rows=None)


def labels(path: Path, rows: list[tuple[str, str]], header: str | None = "id\tlabel") -> Path:
    path.write_text("".join(f"{line}\n" for line in ([header] if header else []) + [f"{a}\t{b}" for a, b in rows]))
    return path


ROWS = [(f"P{i:02d}", "even" if i % 2 == 0 else "odd") for i in range(20)]


def resolve(store: Path, path: Path, **kw):
    with open_store(store) as st:
        return resolve_labels(LabelOptions(path, **kw), st)


# ----------------------------------------------------------------------------- 5: header


def test_a_label_file_without_its_header_is_refused(store, tmp_path):
    path = labels(tmp_path / "l.tsv", ROWS, header=None)
    with pytest.raises(EmbedpipeError) as info:
        resolve(store, path)
    assert str(info.value) == (f"{path} line 1: the header line is missing: the first line starts with 'P00', an ID "
                               "of the store, and would be read as the header (its label lost); the file needs a "
                               "header line first (id<TAB>label), then id<TAB>label lines")


def test_a_missing_header_is_one_line_from_the_cli(store, tmp_path):
    path = labels(tmp_path / "l.tsv", ROWS, header=None)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "embedpipe.cli", "crosscheck", str(store), "--out",
                             str(tmp_path / "cc"), "--labels", str(path)], capture_output=True, text=True, env=env)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("embedpipe: ")]
    assert lines == [f"embedpipe: error: {path} line 1: the header line is missing: the first line starts with 'P00', "
                     "an ID of the store, and would be read as the header (its label lost); the file needs a header "
                     "line first (id<TAB>label), then id<TAB>label lines"], result.stderr


@pytest.mark.parametrize("header", ["id\tlabel", "accession\tfamily", "ID\tLabel"])
def test_a_header_keeps_every_label(store, tmp_path, header):
    path = labels(tmp_path / "l.tsv", ROWS, header=header)
    labelled = resolve(store, path, folds=2)
    assert labelled.n_entries == 20 and labelled.lines[0] == 2 and labelled.labels[0] == "even"


def test_the_expected_header_names_are_a_header_even_when_id_is_a_stored_id(tmp_path):
    path = labels(tmp_path / "l.tsv", ROWS)
    assert len(read_label_file(path, is_id=lambda rid: True)) == 20


# ----------------------------------------------------------------------------- 6: shortened values


def test_a_huge_label_is_shortened_in_the_error(store, tmp_path):
    rows = [*ROWS[:4], ("P04", "x" * HUGE), *ROWS[5:]]
    path = labels(tmp_path / "l.tsv", [(a, str(i + 0.5)) if a != "P04" else (a, b) for i, (a, b) in enumerate(rows)])
    with pytest.raises(EmbedpipeError) as info:
        resolve(store, path, kind="numbers")
    message = str(info.value)
    assert message.startswith(f"{path} line 6: label {'x' * 80!r}... ({HUGE} chars) is not a finite number"), \
        message[:300]
    assert len(message) < 400 and "\n" not in message


def test_a_huge_unknown_id_is_shortened_in_the_error(store, tmp_path):
    path = labels(tmp_path / "l.tsv", [*ROWS, ("Q" * HUGE, "odd")])
    with pytest.raises(EmbedpipeError) as info:
        resolve(store, path)
    message = str(info.value)
    shown = f"{'Q' * 80!r}... ({HUGE} chars)"
    assert message.startswith(f"{path} line 22: ID {shown} is not in s.h5 (1 of 21 labelled IDs are not: {shown}); "), \
        message[:400]
    assert len(message) < 600


def test_a_huge_id_labelled_twice_is_shortened(store, tmp_path):
    path = labels(tmp_path / "l.tsv", [*ROWS, ("Z" * HUGE, "odd"), ("Z" * HUGE, "odd")])
    with pytest.raises(EmbedpipeError) as info:
        read_label_file(path)
    assert str(info.value) == f"{path} line 23: ID {'Z' * 80!r}... ({HUGE} chars) is labelled twice (also line 22)"
