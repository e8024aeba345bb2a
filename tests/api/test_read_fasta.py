"""FASTA from Python: ``embedpipe.read_fasta`` gives the IDs and sequences ``embed`` stores for
the same file (the amino-acid rules, SaProt's pairs, ProstT5's case), plain or gzip, and
refuses a bad record in ``embed``'s words; ``Embedder.embed`` takes a FASTA path (a
``pathlib.Path``, or a str naming an existing ``.fasta`` file) and gives the store's numbers
bit for bit; any other str is refused as before."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_every_family_path import _result_view, _store_view  # the parity views of the every-family test

import embedpipe
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.store import open_store
from helpers.embed_helpers import embed_store, write_fasta
from helpers.family_models import FAMILIES


class _Models(dict):
    """Each family's test model, written when a test first asks for it."""

    def __init__(self, base: Path) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, family: str) -> Path:
        self[family] = FAMILIES[family][0](self.base / family)
        return self[family]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return _Models(tmp_path_factory.mktemp("read-fasta"))


def _stored_records(store: Path) -> list[tuple[str, str]]:
    with open_store(store) as st:
        return list(zip(st.ids, (str(s) for s in st.records(sequence=True)["sequence"])))


def _gzip(path: Path) -> Path:
    out = path.with_name(path.name + ".gz")
    with open(path, "rb") as src, gzip.open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


@pytest.mark.parametrize("family", FAMILIES)  # every family: one input path for all of them
def test_read_fasta_gives_what_embed_stores(family: str, models, tmp_path: Path) -> None:
    records = FAMILIES[family][1]
    store = embed_store(tmp_path, models[family], records, device="cpu")
    fasta = tmp_path / "out.fasta"  # the file embed_store embedded
    stored = _stored_records(store)
    assert embedpipe.read_fasta(fasta, models[family]) == stored
    assert embedpipe.read_fasta(str(fasta), str(models[family])) == stored
    with embedpipe.Embedder(models[family], device="cpu") as embedder:  # its rules, before any model loads
        assert embedpipe.read_fasta(fasta, embedder) == stored
    assert embedpipe.read_fasta(_gzip(fasta), models[family]) == stored  # gzip: the same records
    if family == "esm2":  # no model: the amino-acid rules (upper-cased), as the amino-acid families read
        assert embedpipe.read_fasta(fasta) == stored
        assert ("lower", "MKVLAAG") in stored


def test_read_fasta_applies_the_normalisations_of_embed(tmp_path: Path) -> None:
    fasta = tmp_path / "in.fa"
    fasta.write_bytes(b"\xef\xbb\xbf>P1 first protein\r\nmktay\r\nIAKJ*\r\n\r\n>P2\rMSTN PKPQ\r")
    assert embedpipe.read_fasta(fasta) == [("P1", "MKTAYIAKX"), ("P2", "MSTNPKPQ")]
    gz = _gzip(fasta)
    assert embedpipe.read_fasta(gz) == embedpipe.read_fasta(fasta)


BAD = [
    ("esm2", [("ok", "MKV"), ("gap", "MK-V")]),
    ("saprot", [("ok", "MdEv"), ("odd", "MdE")]),
    ("prostt5", [("ok", "MKV"), ("mixed", "MKvl")]),
]


@pytest.mark.parametrize("family,records", BAD, ids=[f for f, _ in BAD])
def test_a_bad_record_is_refused_in_the_words_of_embed(family, records, models, tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "in.fasta", records)
    with pytest.raises(EmbedpipeError) as by_embed:
        embed_fasta(fasta, model=str(models[family]), out=tmp_path / "out.h5", options=EmbedOptions(device="cpu"),
                    quiet=True)
    with pytest.raises(EmbedpipeError) as by_python:
        embedpipe.read_fasta(fasta, models[family])
    line = 4  # the offending character's line: write_fasta puts each record on two lines
    assert str(by_python.value) == str(by_embed.value)
    assert str(by_python.value).startswith(f"{fasta}:{line}: record '{records[-1][0]}': ")
    assert "\n" not in str(by_python.value)
    with pytest.raises(EmbedpipeError) as from_path:  # Embedder.embed(path): the same line, nothing embedded
        embedpipe.Embedder(models[family], device="cpu").embed(fasta)
    assert str(from_path.value) == str(by_embed.value)
    with pytest.raises(EmbedpipeError) as in_gzip:
        embedpipe.read_fasta(_gzip(fasta), models[family])
    assert str(in_gzip.value).startswith(f"{fasta}.gz:{line}: record '{records[-1][0]}': ")


def test_read_fasta_refuses_a_missing_an_empty_and_a_malformed_file(tmp_path: Path) -> None:
    with pytest.raises(EmbedpipeError, match=r"missing\.fasta: no such file$"):
        embedpipe.read_fasta(tmp_path / "missing.fasta")
    (tmp_path / "empty.fasta").write_text("\n\n")
    with pytest.raises(EmbedpipeError, match=r"empty\.fasta: no records to embed$"):
        embedpipe.read_fasta(tmp_path / "empty.fasta")
    (tmp_path / "text.fasta").write_text("hello\n>a\nMKV\n")
    with pytest.raises(EmbedpipeError, match=r"text\.fasta:1: text before the first '>' header"):
        embedpipe.read_fasta(tmp_path / "text.fasta")
    (tmp_path / "dup.fasta").write_text(">a\nMKV\n>a\nMKV\n")
    with pytest.raises(EmbedpipeError, match=r"dup\.fasta:3: duplicate ID 'a': first seen at .*dup\.fasta:1"):
        embedpipe.read_fasta(tmp_path / "dup.fasta")


def _attrs(store: Path) -> dict:
    with h5py.File(store, "r") as f:
        return {k: f.attrs[k] for k in ("input_sha256", "config", "embed_identity")}


@pytest.mark.parametrize("family", FAMILIES)
def test_embedder_embed_of_a_path_equals_the_embed_store(family: str, models, tmp_path: Path) -> None:
    """Bit for bit: the vectors (both layers, per residue), the stored sequences with their
    case, the per-record provenance, the identity; and saved, the input the store records."""
    records = FAMILIES[family][1]
    options = dict(precision="fp32", layers=(0, -1), per_residue=True, device="cpu")
    store_path = embed_store(tmp_path, models[family], records, **options)
    fasta = tmp_path / "out.fasta"
    store = _store_view(store_path)
    with embedpipe.Embedder(models[family], **options) as embedder:
        for given in (fasta, str(fasta)):  # a Path, and a str naming an existing .fasta file
            result = embedder.embed(given)
            api = _result_view(result, store, tmp_path / "view.h5")
            assert store.keys() == api.keys()
            for key, value in store.items():
                if isinstance(value, np.ndarray):
                    assert value.dtype == api[key].dtype and value.tobytes() == api[key].tobytes(), f"{family}: {key}"
                else:
                    assert value == api[key], f"{family}: {key}"
        saved = _attrs(result.save(tmp_path / "saved.h5"))
    assert saved == _attrs(store_path)  # the file's sha256 and config.input, as embed records them


def test_a_str_is_a_fasta_only_when_it_names_an_existing_fasta_file(models, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_fasta(tmp_path / "q.faa.gz", [])  # a name is not enough: an empty non-gzip file, refused as read
    write_fasta(tmp_path / "seqs.txt", [("a", "MKV")])
    one_string = "sequences: give a list of sequences, (id, sequence) pairs or a dict, not one string"
    embedder = embedpipe.Embedder(models["esm2"], device="cpu")
    with pytest.raises(EmbedpipeError) as plain:
        embedder.embed("MKTAYIAK")  # a sequence, not a file: refused as before
    assert str(plain.value) == one_string
    with pytest.raises(EmbedpipeError) as missing:
        embedder.embed("missing.fasta")
    assert str(missing.value).startswith(one_string + " ('missing.fasta' names no file")
    with pytest.raises(EmbedpipeError) as other:
        embedder.embed("seqs.txt")
    assert str(other.value).startswith(one_string + " ('seqs.txt' is a file whose name does not end in")
    with pytest.raises(EmbedpipeError, match=r"q\.faa\.gz: no records to embed"):
        embedder.embed("q.faa.gz")
    with pytest.raises(EmbedpipeError, match=r"nothing\.txt: no such file"):
        embedder.embed(Path("nothing.txt"))  # a Path is always a file
    assert not embedder.loaded  # every refusal came before the model loaded
    assert embedpipe.read_fasta(Path("seqs.txt")) == [("a", "MKV")]


def test_read_fasta_is_exported_lazily() -> None:
    assert "read_fasta" in embedpipe.__all__
    from embedpipe.api.reading import read_fasta

    assert embedpipe.read_fasta is read_fasta
