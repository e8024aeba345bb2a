"""Hostile input to shard (issue 30): a duplicate ID is reported as it is met, not after the
whole input has been read and its ID hashes sorted; one the in-memory window misses is still
found by the sort."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import pytest

from embedpipe.core.errors import InputError
from embedpipe.shard import index as shard_index
from embedpipe.shard.passes import shard_fasta
from embedpipe.shard.spill import CHUNK


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the records shard's first pass takes from the reader."""
    taken = [0]
    real = shard_index.iter_fasta

    def counted(*args, **kwargs) -> Iterator:
        for record in real(*args, **kwargs):
            taken[0] += 1
            yield record

    monkeypatch.setattr(shard_index, "iter_fasta", counted)
    return taken


def _fasta(path: Path, ids: list[str]) -> Path:
    path.write_bytes(gzip.compress("".join(f">{rid}\nMK{'V' * (k % 7)}\n" for k, rid in enumerate(ids)).encode(),
                                   compresslevel=1))
    return path


def test_a_duplicate_at_line_3_stops_the_pass_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _fasta(tmp_path / "in.fa.gz", ["r0", "r0", *(f"r{k}" for k in range(1, 200_000))])
    taken = _counting(monkeypatch)
    with pytest.raises(InputError) as err:
        shard_fasta([src], out=tmp_path / "out", tokens_per_shard=1000, quiet=True)
    assert str(err.value) == f"{src}:3: duplicate ID 'r0': first seen at {src}:1, again at {src}:3"
    assert taken[0] == 2  # was all 200,001: the duplicate was found only by the sort after the pass
    assert not (tmp_path / "out").exists()


def test_a_duplicate_of_the_previous_record_after_the_first_chunk_stops_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [f"r{k}" for k in range(CHUNK + 10)]
    ids += [ids[-1]] + [f"s{k}" for k in range(CHUNK)]
    src = _fasta(tmp_path / "in.fa.gz", ids)
    taken = _counting(monkeypatch)
    with pytest.raises(InputError) as err:
        shard_fasta([src], out=tmp_path / "out", tokens_per_shard=1000, quiet=True)
    first, again = 2 * (CHUNK + 9) + 1, 2 * (CHUNK + 10) + 1
    assert str(err.value) == (f"{src}:{again}: duplicate ID 'r{CHUNK + 9}': first seen at {src}:{first}, "
                              f"again at {src}:{again}")
    assert taken[0] == CHUNK + 11


def test_a_duplicate_outside_the_window_is_still_found_by_the_sort(tmp_path: Path) -> None:
    """Record 2*CHUNK+5 repeats record CHUNK+1: neither among the first chunk nor the current one."""
    ids = [f"r{k}" for k in range(2 * CHUNK + 5)] + [f"r{CHUNK + 1}"] + ["last"]
    src = _fasta(tmp_path / "in.fa.gz", ids)
    with pytest.raises(InputError) as err:
        shard_fasta([src], out=tmp_path / "out", tokens_per_shard=1000, quiet=True)
    first, again = 2 * (CHUNK + 1) + 1, 2 * (2 * CHUNK + 5) + 1
    assert str(err.value) == (f"{src}:{again}: duplicate ID 'r{CHUNK + 1}': first seen at {src}:{first}, "
                              f"again at {src}:{again}")


def test_an_earlier_invalid_record_is_still_reported_first(tmp_path: Path) -> None:
    src = tmp_path / "in.fa"
    src.write_text(">a\nMK\n>b\nM-K\n>a\nMKV\n")
    with pytest.raises(InputError, match=rf"^{src}:4: record 'b': gap character '-'"):
        shard_fasta([src], out=tmp_path / "out", tokens_per_shard=1000, quiet=True)
