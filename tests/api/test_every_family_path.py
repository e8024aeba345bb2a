"""Every family, every path: a record gets the same numbers whichever way it enters embedpipe.

For each family's own on-disk test model (tests/helpers/family_models.py), ``embedpipe.embed``
equals the store ``embed`` writes for the same records bit for bit (vectors, the stored
sequence with its case, per-record provenance); ``search`` of the store's own records finds
each record itself first; and the Python API refuses what ``embed`` refuses in a FASTA, in the
same words (SaProt's broken pairs, ProstT5's mixed case)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import embedpipe
from embedpipe.core.errors import InputError
from embedpipe.inputs.fasta import read_sequences
from embedpipe.neighbours.build import build_index
from embedpipe.store import open_store
from helpers.embed_helpers import embed_store, write_fasta
from helpers.family_models import FAMILIES

PER_RECORD = ("precision_used", "fallback_reason", "length", "embedded_length", "long_handling", "windows")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("families")
    return {family: write(base / family.replace("+", "p")) for family, (write, _) in FAMILIES.items()}


def _store_view(path: Path) -> dict:
    """What a store holds for its records, read through the reader, in row order."""
    with open_store(path) as store:
        table = store.records(sequence=True)
        view = {"ids": list(store.ids), "sequence": [str(s) for s in table["sequence"]],
                "identity": store.provenance["embed_identity"]}
        view |= {name: [str(v) for v in table[name]] for name in PER_RECORD if name in table}
        for layer in store.layers:
            view[("mean", layer)] = np.asarray(store.mean(layer).compute())
            view |= {("residues", layer, rid): store.per_residue(rid, layer) for rid in view["ids"]}
    return view


def _result_view(result: embedpipe.Result, keys: dict, saved: Path) -> dict:
    """What the result holds, in the keys of the store's view; the per-record columns the
    Result does not carry (lengths, long-sequence handling) from the store it saves."""
    view = {"ids": list(result.ids), "sequence": list(result.sequences), "identity": result.identity}
    columns = {"precision_used": list(result.precision_used), "fallback_reason": list(result.fallback_reason)}
    stored = _store_view(result.save(saved))
    columns |= {name: stored[name] for name in PER_RECORD if name not in columns and name in stored}
    view |= {name: columns[name] for name in PER_RECORD if name in keys}
    for layer in result.layers:
        view[("mean", layer)] = result.mean(layer)
        view |= {("residues", layer, rid): result.per_residue(rid, layer) for rid in result.ids}
    return view


@pytest.mark.parametrize("family", FAMILIES)
def test_the_api_equals_the_embed_store_for_every_family(family: str, models, tmp_path: Path) -> None:
    records = FAMILIES[family][1]
    options = dict(precision="fp32", layers=(0, -1), per_residue=True, device="cpu")
    store = _store_view(embed_store(tmp_path, models[family], records, **options))
    api = _result_view(embedpipe.embed(records, models[family], **options), store, tmp_path / "saved.h5")
    assert store.keys() == api.keys()
    for key, value in store.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == api[key].dtype and value.tobytes() == api[key].tobytes(), f"{family}: {key} differs"
        else:
            assert value == api[key], f"{family}: {key}"
    # the stored sequence is the record as the family reads it: case kept where case is input
    expected = {rid: seq if family in ("saprot", "saprot-pt", "prostt5") else seq.upper() for rid, seq in records}
    assert dict(zip(store["ids"], store["sequence"])) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_search_finds_each_stored_record_itself_first(family: str, models, tmp_path: Path) -> None:
    records = FAMILIES[family][1]
    store = embed_store(tmp_path, models[family], records, precision="fp32", device="cpu")
    build_index(store, tmp_path / "idx")
    hits = embedpipe.search(records, tmp_path / "idx", k=len(records))
    assert [row[0] for row in hits.hits] == [rid for rid, _ in records], family
    np.testing.assert_allclose(hits.scores[:, 0], 1.0, rtol=0, atol=1e-5)


REFUSED = [
    ("saprot", [("ok", "MdEv"), ("upper", "MDEV")]),  # an amino acid in a 3Di place
    ("saprot", [("ok", "MdEv"), ("odd", "MdE")]),
    ("prostt5", [("ok", "MKV"), ("mixed", "MKvl")]),  # amino acids and 3Di in one record
    ("esm2", [("ok", "MKV"), ("gap", "MK-V")]),
]


@pytest.mark.parametrize("family,records", REFUSED, ids=[f"{f}-{r[-1][0]}" for f, r in REFUSED])
def test_the_api_refuses_what_embed_refuses_in_the_same_words(family, records, models, tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "in.fasta", records)
    limits = embedpipe.Embedder(models[family]).limits  # the family's reading rules, as embed sets them
    with pytest.raises(InputError) as in_file:
        list(read_sequences(fasta, limits))
    with pytest.raises(InputError) as in_memory:
        embedpipe.embed(records, models[family])
    bad = len(records)
    # the same reason and record; the place is the file's line there, the record's position here
    assert str(in_memory.value).startswith(f"sequences:{bad}: record '{records[-1][0]}': ")
    assert str(in_memory.value).split(": ", 1)[1] == str(in_file.value).split(": ", 1)[1]
    # search's queries: the same refusal, before anything is embedded
    build_index(embed_store(tmp_path, models[family], records[:-1], device="cpu"), tmp_path / "idx")
    with pytest.raises(InputError) as as_query:
        embedpipe.search(records, tmp_path / "idx")
    assert str(as_query.value) == str(in_memory.value)


@pytest.mark.parametrize("family", ["saprot", "saprot-pt", "prostt5"])
def test_the_search_command_reads_queries_by_the_family_rules(family: str, models, tmp_path: Path) -> None:
    """``embedpipe search QUERIES.fasta``: the queries keep their case and pairs, as the store's
    records did, so each finds itself first, and the TSV holds what ``embedpipe.search`` finds."""
    from embedpipe.api.querying import search_fasta

    records = FAMILIES[family][1]
    build_index(embed_store(tmp_path, models[family], records, device="cpu"), tmp_path / "idx")
    queries = write_fasta(tmp_path / "queries.fasta", records)
    hits = search_fasta(queries, tmp_path / "idx", tmp_path / "hits.tsv", k=2, quiet=True)
    assert [row[0] for row in hits.hits] == [rid for rid, _ in records]
    assert hits.hits == embedpipe.search(records, tmp_path / "idx", k=2).hits
    firsts = [line.split("\t")[:2] for line in (tmp_path / "hits.tsv").read_text().splitlines()[1:]
              if line.split("\t")[3] == "1"]
    assert firsts == [[rid, rid] for rid, _ in records]
