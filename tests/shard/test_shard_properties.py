"""Issue 11's rule, end to end: every input header gets exactly one manifest row, and every
``ok`` or ``duplicate`` row resolves in the merged store to a record whose stored sequence has
that row's ``sequence_sha256`` (shard -> embed each shard -> merge with the manifest -> open).

Inputs mix LF, CRLF and lone-CR line ends, duplicate sequences (also after normalisation),
invalid records, and are sharded with ``--on-invalid skip``. The headers are counted from the
generated records, not by parsing the files, so a reader that drops or merges records fails.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedpipe
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.shard.passes import shard_fasta
from embedpipe.store import merge_stores
from helpers.shard_helpers import manifest

valid = st.text(alphabet="ACDEKLMNPQRSTVWYacdkj", min_size=1, max_size=9)
invalid = st.sampled_from(["MK-V", "AC1", "A*C", "", "*"])
sequence = st.one_of(valid, valid.map(lambda s: s + "*"), st.sampled_from(["MKV", "mkv", "MKV*"]), invalid)
line_end = st.sampled_from(["\n", "\r\n", "\r"])
# one record: its sequence, how many residues go on the first line, and the line ends used
record = st.tuples(sequence, st.integers(min_value=0, max_value=5), st.lists(line_end, min_size=3, max_size=3))


def fasta_text(records: list[tuple[str, int, list[str]]], prefix: str) -> tuple[str, list[str]]:
    """A FASTA text and the IDs of its headers, in order."""
    parts, ids = [], []
    for k, (seq, cut, ends) in enumerate(records):
        rid = f"{prefix}{k}"
        ids.append(rid)
        parts.append(f">{rid} desc{ends[0]}{seq[:cut]}{ends[1]}{seq[cut:]}{ends[2]}")
    return "".join(parts), ids


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    files=st.lists(st.lists(record, min_size=1, max_size=8), min_size=1, max_size=2),
    budget=st.integers(min_value=8, max_value=40),
)
def test_every_header_one_row_and_every_row_resolves_to_its_sequence(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path, files: list, budget: int
) -> None:
    tmp = tmp_path_factory.mktemp("rule")
    paths, headers = [], []
    for f, records in enumerate(files):
        text, ids = fasta_text(records, prefix=f"f{f}_")
        path = tmp / f"in{f}.fa"
        path.write_bytes(text.encode())
        paths.append(path)
        headers.extend(ids)

    out = tmp / "shards"
    summary = shard_fasta(paths, out=out, tokens_per_shard=budget, on_invalid="skip", quiet=True)
    rows = manifest(out)
    assert [r["id"] for r in rows] == headers  # every header, exactly once, in input order
    assert summary.records == len(headers)

    stores = []
    for info in summary.shards:
        store = tmp / "stores" / f"shard-{info.index:05d}.h5"
        embed_fasta(out / info.path, model=str(tiny_model_path), out=store,
                    options=EmbedOptions(device="cpu", threads=1), quiet=True)
        stores.append(store)
    resolvable = [r for r in rows if r["status"] in ("ok", "duplicate")]
    if not stores:
        assert resolvable == []
        return
    merged = tmp / "embeddings.h5"
    merge_stores(stores, out=merged, manifest=out / "manifest.tsv")
    with embedpipe.open_store(merged) as store:
        for row in resolvable:
            stored = store[row["id"]]["sequence"]
            assert hashlib.sha256(stored.encode()).hexdigest() == row["sequence_sha256"], row
        assert set(store.skipped) == {r["id"] for r in rows if r["status"].startswith("skipped:")}
