"""A store written while embedpipe had ``--attention``, ``--batch-layout``, ``--attention-inputs``,
``--fallback-device``, ``--compile`` and ``--compile-cache`` (their values in ``config``, what
compile resolved to in ``computed_as.compiled`` and the ``compiled`` root attributes: docs/store-format.md)
validates, and its index is searched with the store's options as the queries': the removed
options are ignored there, and are no keyword of the Embedder or field of its options."""

from __future__ import annotations

import json
import shutil

import h5py
import pytest

import embedpipe
from embedpipe.api.querying import query_options, search_fasta
from embedpipe.core import options
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.neighbours.build import build_index
from embedpipe.neighbours.index_file import read_meta
from embedpipe.store.validate import validate_store
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.stores import as_format2

RECORDS = random_sequences(8, (8, 40), seed=41)
QUERIES = random_sequences(3, (8, 40), seed=42)
#: what an older embedpipe wrote into ``config`` (its defaults)
OLDER_CONFIG = {"attention": "sdpa", "batch_layout": "auto", "attention_inputs": "auto", "fallback_device": "auto",
                "compile": "auto", "compile_cache": None}


def _as_the_older_writer_wrote_it(store) -> None:
    """The removed options in ``config``, ``computed_as.compiled`` in the identity (a store that
    ran compiled), and the ``compiled`` root attributes, in store format 2 (the format of the
    embedpipe that had those options: no record parts in ``row_digest``, no ``attr_digests``)."""
    with h5py.File(store, "r+") as f:
        config = json.loads(f.attrs["config"])
        assert not set(OLDER_CONFIG) & set(config)  # this embedpipe records none of them
        f.attrs["config"] = json.dumps(config | OLDER_CONFIG, sort_keys=True)
        identity = json.loads(f.attrs["embed_identity"])
        identity["computed_as"]["compiled"] = "true"
        f.attrs["embed_identity"] = json.dumps(identity, sort_keys=True)
        f.attrs["compiled"], f.attrs["compile_reason"], f.attrs["compile_s"] = True, "on", 12.5
        as_format2(f)


def test_an_older_stores_index_is_searched_as_the_current_stores_is(tmp_path, tiny_model_path):
    now = tmp_path / "now.h5"
    embed_fasta(write_fasta(tmp_path / "s.fasta", RECORDS), model=str(tiny_model_path), out=now, quiet=True,
                options=EmbedOptions(device="cpu"))
    older = tmp_path / "older.h5"
    shutil.copyfile(now, older)
    _as_the_older_writer_wrote_it(older)
    assert validate_store(older) == []
    build_index(now, tmp_path / "now.idx")
    build_index(older, tmp_path / "older.idx")
    meta = read_meta(tmp_path / "older.idx")
    assert set(OLDER_CONFIG) <= set(meta.options)  # the index carries the store's config
    assert not set(query_options(meta, {})) & set(OLDER_CONFIG)
    queries = write_fasta(tmp_path / "q.fasta", QUERIES)
    found = search_fasta(queries, tmp_path / "older.idx", tmp_path / "older.tsv", k=4, quiet=True, device="cpu")
    expected = search_fasta(queries, tmp_path / "now.idx", tmp_path / "now.tsv", k=4, quiet=True, device="cpu")
    assert found.hits == expected.hits
    assert (found.scores == expected.scores).all()


def test_a_removed_option_is_no_parameter_of_the_embedder_or_a_field_of_its_options(tiny_model_path):
    """The Embedder takes named keywords and ``options=EmbedOptions(...)``: a removed option is
    an unexpected keyword to both (mypy reports it before the script runs)."""
    assert set(OLDER_CONFIG) == set(getattr(options, "REMOVED_OPTIONS", ()))
    for name, value in OLDER_CONFIG.items():
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            embedpipe.Embedder(tiny_model_path, device="cpu", **{name: value})
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            EmbedOptions(**{name: value})
