"""shard at scale (issue 15): bounded open files, the on-disk index's chunked and collision
paths give the same output as the plain path, the first problem in input order is reported."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import embedpipe.shard.index
import embedpipe.shard.spill
from embedpipe.core.errors import InputError
from embedpipe.shard.passes import shard_fasta
from helpers.shard_helpers import write

ROOT = Path(__file__).resolve().parents[2]


def random_fasta(path: Path, records: int, seed: int) -> Path:
    """Short random sequences with many exact and case/stop-normalised duplicates, some invalid."""
    rng = random.Random(seed)
    pool = ["".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(1, 30))) for _ in range(records // 3)]
    parts = []
    for i in range(records):
        seq = rng.choice(pool)
        kind = rng.random()
        if kind < 0.1:
            seq = seq.lower() + "*"
        elif kind < 0.15:
            seq = seq[:1] + "-" + seq[1:]
        quoted = '"q' if i % 11 == 0 else ""  # IDs the manifest must quote
        parts.append(f">r{i}{quoted} d\n{seq}\n")
    return write(path, "".join(parts))


def unique_sequence(i: int) -> str:
    """A different sequence for every ``i`` (its digits in base 20, as residues)."""
    residues = "ACDEFGHIKLMNPQRSTVWY"
    digits = "A"
    while i:
        i, d = divmod(i, 20)
        digits += residues[d]
    return digits


def outputs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_thousands_of_shards_under_a_low_open_file_limit(tmp_path: Path) -> None:
    """3,000 shards with RLIMIT_NOFILE 64: finished shards wait for fsync in a bounded queue."""
    src = write(tmp_path / "in.fa", "".join(f">P{i}\n{unique_sequence(i)}\n" for i in range(3000)))
    script = textwrap.dedent(f"""
        import resource, sys
        from pathlib import Path
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        from embedpipe.shard.passes import shard_fasta
        summary = shard_fasta([Path({str(src)!r})], out=Path({str(tmp_path / 'out')!r}), tokens_per_shard=1, quiet=True)
        print(summary.n_shards)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == 3000
    assert len(list((tmp_path / "out").glob("shard-*.fasta"))) == 3000


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_small_chunks_and_colliding_first_words_change_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              seed: int) -> None:
    """Chunk boundaries everywhere, and every digest sharing its first word (so the exact
    full-digest grouping decides alone), give byte-identical shards and manifest."""
    src = random_fasta(tmp_path / "in.fa", 700, seed)
    plain = tmp_path / "plain"
    shard_fasta([src], out=plain, tokens_per_shard=97, on_invalid="skip", quiet=True)

    monkeypatch.setattr(embedpipe.shard.spill, "CHUNK", 7)
    monkeypatch.setattr(embedpipe.shard.index, "CHUNK", 7)
    monkeypatch.setattr(embedpipe.shard.index, "MANIFEST_ROWS", 5)
    chunked = tmp_path / "chunked"
    shard_fasta([src], out=chunked, tokens_per_shard=97, on_invalid="skip", quiet=True)
    assert outputs(chunked) == outputs(plain)

    def same_first_word(index: object):  # every record a candidate: only the full digest tells them apart
        for block in embedpipe.shard.spill.Spill.chunks(index.spill, "digest", index.n):  # type: ignore[attr-defined]
            yield np.zeros(len(block), dtype=np.uint64)

    monkeypatch.setattr(embedpipe.shard.index, "_first_words", same_first_word)
    colliding = tmp_path / "colliding"
    shard_fasta([src], out=colliding, tokens_per_shard=97, on_invalid="skip", quiet=True)
    assert outputs(colliding) == outputs(plain)


def test_colliding_id_hashes_are_not_duplicate_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ID check compares the text of records whose 64-bit hashes repeat."""
    src = write(tmp_path / "in.fa", ">A\nMK\n>B\nMKV\n>C\nMKVL\n")
    monkeypatch.setattr(embedpipe.shard.index, "hash", lambda _rid: 7, raising=False)
    summary = shard_fasta([src], out=tmp_path / "out", tokens_per_shard=100, quiet=True)
    assert summary.records == summary.unique == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # the duplicate ID comes first: it is reported, not the later invalid record
        (">P1\nMK\n>P2\nMK\n>P1\nWW\n>P3\nM-K\n", "in.fa:5: duplicate ID 'P1': first seen at {src}:1, again at {src}:5"),
        # the invalid record comes first
        (">P1\nMK\n>P3\nM-K\n>P1\nWW\n", "in.fa:4: record 'P3': gap character"),
        # a structural error after a duplicate ID: the duplicate ID
        (">P1\nMK\n>P1\nWW\n>\nMK\n", "duplicate ID 'P1': first seen at {src}:1, again at {src}:3"),
    ],
)
def test_first_problem_in_input_order_is_reported(tmp_path: Path, body: str, message: str) -> None:
    src = write(tmp_path / "in.fa", body)
    with pytest.raises(InputError) as err:
        shard_fasta([src], out=tmp_path / "out", tokens_per_shard=100, quiet=True)
    assert message.format(src=src) in str(err.value)
    assert "duplicate ID" not in message or str(err.value).count("duplicate ID") == 1


def test_shard_rule_asks_memory_by_input_size(tmp_path: Path) -> None:
    """The shard job's mem_mb grows with its input (a sparse 4 GB FASTA: ~20M records estimated)."""
    from helpers.workflow_helpers import demo_config, run_workflow

    big = tmp_path / "in.fasta"
    with open(big, "wb") as fh:
        fh.write(b">a\nMKV\n")
        fh.truncate(4 * 10**9)
    config = demo_config(tmp_path, input="in.fasta")
    out = run_workflow(tmp_path, config, "--dry-run", "--verbose")
    text = out.stdout + out.stderr
    match = re.search(r"(?:rule|checkpoint) shard:.*?mem_mb=(\d+)", text, re.S)
    assert match, text
    mem_mb = int(match[1])
    assert 1200 < mem_mb < 4096  # a fixed part + 20M records x a few dozen bytes, not a flat 4 GB
