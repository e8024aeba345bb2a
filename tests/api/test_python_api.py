"""The Python API (``embedpipe.Embedder``, ``embedpipe.embed``): the numbers, per-record facts
and identity of ``embed --out``'s store for the same records and options, bit for bit; the
FASTA path's input checks; the model loaded once per Embedder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embedpipe
from embedpipe.core.errors import EmbedpipeError, InputError
from embedpipe.core.options import FastaLimits
from embedpipe.extraction import job as job_module
from embedpipe.inputs.fasta import read_sequences
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.store import open_store, validate_store
from helpers.embed_helpers import embed_store, random_sequences, write_fasta
from helpers.processes import ROOT, run_cli

RECORDS = random_sequences(7, (5, 60), seed=3)


def _store_values(path: Path, layers: list[int], poolings: tuple[str, ...], per_residue: bool) -> dict:
    """What the store holds, read through the reader, in row (input) order."""
    with open_store(path) as store:
        table = store.records()
        values = {"ids": list(store.ids), "precision_used": [str(v) for v in table["precision_used"]],
                  "fallback_reason": [str(v) for v in table["fallback_reason"]],
                  "identity": store.provenance["embed_identity"]}
        for layer in layers:
            for pooling in poolings:
                values[(pooling, layer)] = np.asarray(store.pooled(layer, pooling).compute())
            if per_residue:
                for rid in values["ids"]:
                    values[("residues", layer, rid)] = store.per_residue(rid, layer)
    return values


def _result_values(result: embedpipe.Result, poolings: tuple[str, ...], per_residue: bool) -> dict:
    values = {"ids": list(result.ids), "precision_used": list(result.precision_used),
              "fallback_reason": list(result.fallback_reason), "identity": result.identity}
    for layer in result.layers:
        for pooling in poolings:
            values[(pooling, layer)] = result.pooled(layer, pooling)
        if per_residue:
            for rid in result.ids:
                values[("residues", layer, rid)] = result.per_residue(rid, layer)
    return values


def _assert_bitwise(store: dict, api: dict) -> None:
    assert store.keys() == api.keys()
    for key, value in store.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == api[key].dtype and value.shape == api[key].shape, key
            assert value.tobytes() == api[key].tobytes(), f"{key} differs"
        else:
            assert value == api[key], key


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hf")
    return {family: make_hf_test_model(base / family, family=family, layers=2, dim=32, heads=4, seed=5)
            for family in ("prot-t5", "esmc")}


CASES = [
    ("esm2", dict(precision="fp32", layers=(0, -1), pooling=("mean", "bos"), per_residue=True)),
    ("esm2", dict(precision="bf16-mixed", storage_dtype="float16")),
    ("esm2", dict(precision="int8-mixed", per_residue=True)),
    ("prot-t5", dict(precision="bf16-mixed")),
    ("esmc", dict(precision="bf16-mixed", layers=(1, 2))),
    ("esm2", dict(precision="auto")),  # the first call's records are the job's input, as a FASTA's are
]


@pytest.mark.parametrize("family,options", CASES, ids=[f"{f}-{o['precision']}" for f, o in CASES])
def test_the_api_equals_the_cli_store_bit_for_bit(family, options, tiny_model_path, hf_models, tmp_path):
    model = tiny_model_path if family == "esm2" else hf_models[family]
    options = dict(options, device="cpu")
    poolings = tuple(options.get("pooling", ("mean",)))
    per_residue = bool(options.get("per_residue"))
    store = embed_store(tmp_path, model, RECORDS, **options)
    result = embedpipe.embed(RECORDS, model, **options)
    layers = result.layers
    expected = _store_values(store, layers, poolings, per_residue)
    _assert_bitwise(expected, _result_values(result, poolings, per_residue))
    assert result.mean().tobytes() == expected[("mean", max(layers))].tobytes()  # layer=-1: the highest
    # written as a store: the same datasets, the same checks as embed --out (validate passes)
    saved = result.save(tmp_path / "saved.h5")
    assert validate_store(saved) == []
    _assert_bitwise(expected, _store_values(saved, layers, poolings, per_residue))
    with open_store(saved) as a, open_store(store) as b:
        for key in ("model_sha256", "precision_policy", "platform", "attention_path", "batch_layout",
                    "fallback_count", "precision_requested"):
            assert a.provenance.get(key) == b.provenance.get(key), key


def test_fallback_and_provenance_per_record(overflow_model, overflow_records, tmp_path):
    """fp16-mixed overflows on 'C' (a 7e4 embedding row): those records fall back to fp32, and
    the API says so per record, as the store does."""
    options = dict(precision="fp16-mixed", device="cpu")
    store = embed_store(tmp_path, overflow_model, overflow_records, **options)
    with embedpipe.Embedder(overflow_model, **options) as embedder:
        result = embedder.embed(dict(overflow_records))
    expected = _store_values(store, result.layers, ("mean",), False)
    _assert_bitwise(expected, _result_values(result, ("mean",), False))
    with_c = [rid for rid, seq in overflow_records if "C" in seq]
    assert [rid for rid, used in zip(result.ids, result.precision_used) if used == "fp32"] == with_c
    assert all(result.fallback_reason[result.ids.index(rid)] for rid in with_c)
    assert sum(result.fallback_counts().values()) == len(with_c)
    assert result.provenance["precision_policy"] == "fp16-mixed"
    assert result.provenance["model_sha256"] == open_store(store).provenance["model_sha256"]


def _fasta_message(tmp_path: Path, records: list[tuple[str, str]]) -> str:
    """What the FASTA path says of the same records (the reason after the record's name)."""
    with pytest.raises(InputError) as caught:
        list(read_sequences(write_fasta(tmp_path / "bad.fasta", records)))
    return str(caught.value).split(": record ", 1)[1].split(": ", 1)[1]


@pytest.mark.parametrize("bad", ["MK*VL", "MK-VL", "MK1VL", ""], ids=["stop", "gap", "digit", "empty"])
def test_a_bad_sequence_is_refused_naming_the_record_as_the_fasta_path_does(bad, tiny_model_path, tmp_path):
    records = [("good", "MKVL"), ("bad_one", bad)]
    with embedpipe.Embedder(tiny_model_path, device="cpu") as embedder:
        with pytest.raises(InputError) as caught:
            embedder.embed(records)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("sequences:2: record 'bad_one': ")
    if bad:  # an empty record ends a FASTA file's record list differently: its own reason, same words
        assert message.endswith(_fasta_message(tmp_path, records))
    else:
        assert message.endswith("empty sequence")


@pytest.mark.parametrize("records,words", [
    ([("a", "MKV"), ("a", "MKL")], "sequences:2: duplicate ID 'a'"),
    ([("a b", "MKV")], "sequences:1: ID 'a b' must be one word"),
    ([("a\x07", "MKV")], "control character"),
    ([], "sequences: no records to embed"),
    ("MKV", "not one string"),
    ([("a", "M" * 50)], "sequences:1: record 'a' is longer than --max-record-length"),
])
def test_bad_input_is_one_line(records, words, tiny_model_path):
    with embedpipe.Embedder(tiny_model_path, device="cpu", limits=FastaLimits(40)) as embedder:
        with pytest.raises(InputError, match=words) as caught:
            embedder.embed(records)
    assert "\n" not in str(caught.value)


def test_inputs_are_normalised_and_ided_as_the_fasta_path_does(tiny_model_path, tmp_path):
    """Plain strings are IDed by position; lowercase, a trailing '*' and J are normalised as a FASTA's."""
    raw = ["mkvlj*", "ACDE"]
    fasta = write_fasta(tmp_path / "q.fasta", [(str(i), s) for i, s in enumerate(raw)])
    with embedpipe.Embedder(tiny_model_path, device="cpu") as embedder:
        plain = embedder.embed(raw)
        normalised = embedder.embed(list(read_sequences(fasta)))
    assert plain.ids == ("0", "1") and plain.sequences == ("MKVLX", "ACDE")
    assert plain.mean().tobytes() == normalised.mean().tobytes()


def test_the_model_is_loaded_once_across_calls(tiny_model_path, monkeypatch):
    loads: list[str] = []
    real = job_module.load_model

    def counting(spec, *args, **kwargs):
        loads.append(spec)
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(job_module, "load_model", counting)
    with embedpipe.Embedder(tiny_model_path, device="cpu") as embedder:
        first = embedder.embed(RECORDS[:3])
        second = embedder.embed(RECORDS[3:])
        again = embedder.embed(RECORDS[:3])
    assert loads == [str(tiny_model_path)]
    assert first.mean().tobytes() == again.mean().tobytes()
    assert second.ids == tuple(r for r, _ in RECORDS[3:])
    with pytest.raises(EmbedpipeError, match="closed"):
        embedder.embed(RECORDS[:1])
    embedpipe.embed(RECORDS[:1], tiny_model_path, device="cpu")  # the one-call form loads its own
    assert len(loads) == 2


def test_progress_is_off_by_default_and_unknown_options_are_named(tiny_model_path, capfd):
    embedpipe.embed(RECORDS, tiny_model_path, device="cpu")
    assert capfd.readouterr().err == ""
    with pytest.raises(TypeError, match="unexpected keyword argument 'precisoin'"):  # mypy names it too
        embedpipe.Embedder(tiny_model_path, precisoin="fp32")  # type: ignore[call-arg]
    with pytest.raises(EmbedpipeError, match="unknown precision policy 'fp64'"):
        embedpipe.Embedder(tiny_model_path, precision="fp64")


def test_import_embedpipe_stays_torch_free_and_the_api_is_exported():
    code = ("import sys, embedpipe; embedpipe.EmbedOptions(threads=2), embedpipe.FastaLimits(40); "
            "assert 'torch' not in sys.modules; assert callable(embedpipe.embed); "
            "from embedpipe import Embedder, search, Result; assert 'torch' in sys.modules; "
            "import embedpipe.extraction.run; assert callable(embedpipe.embed) and embedpipe.extraction.run.embed_fasta")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert (ROOT / "embedpipe" / "py.typed").is_file()


def test_a_missing_model_is_one_line_at_the_first_call(tmp_path):
    embedder = embedpipe.Embedder(tmp_path / "esm2_missing.pt", device="cpu")  # the model loads at the first call
    with pytest.raises(EmbedpipeError) as caught:
        embedder.embed(["MKV"])
    embedder.close()
    assert "esm2_missing.pt" in str(caught.value) and "\n" not in str(caught.value)


def test_the_api_equals_the_store_the_embed_command_writes(tiny_model_path, tmp_path):
    """The same through the command line itself (a process of its own): bf16-mixed, two layers, BOS."""
    fasta = write_fasta(tmp_path / "in.fasta", RECORDS)
    out = tmp_path / "cli.h5"
    proc = run_cli("embed", str(fasta), "--model", str(tiny_model_path), "--out", str(out), "--precision",
                   "bf16-mixed", "--layers", "1,2", "--pooling", "bos", "--device", "cpu", "-q")
    assert proc.returncode == 0, proc.stderr
    result = embedpipe.embed(RECORDS, tiny_model_path, precision="bf16-mixed", layers=[1, 2], pooling=["bos"],
                             device="cpu")
    poolings = ("mean", "bos")
    _assert_bitwise(_store_values(out, [1, 2], poolings, False), _result_values(result, poolings, False))


def test_the_apis_errors_are_embedpipe_errors(tiny_model_path):
    """Bad arguments are one EmbedpipeError (exported as embedpipe.EmbedpipeError), not a
    TypeError, ValueError or IndexError from inside."""
    assert embedpipe.EmbedpipeError is EmbedpipeError
    with pytest.raises(embedpipe.EmbedpipeError, match="not NoneType"):
        embedpipe.embed(None, tiny_model_path)  # type: ignore[arg-type]
    with pytest.raises(embedpipe.EmbedpipeError, match="set has no order"):
        embedpipe.embed({"MKV", "ACD"}, tiny_model_path)  # type: ignore[arg-type]
    result = embedpipe.embed([("a", "MKV"), ("b", "ACDE")], tiny_model_path, per_residue=True, device="cpu")
    assert result.per_residue("b").tobytes() == result.per_residue(1).tobytes() == result.per_residue(-1).tobytes()
    for bad, words in [("zz", "no record with ID 'zz'"), (5, "position 5 is out of range: this result holds 2"),
                       (-3, "position -3 is out of range"), (1.0, "not float"), (True, "not bool")]:
        with pytest.raises(embedpipe.EmbedpipeError, match=words):
            result.per_residue(bad)  # type: ignore[arg-type]
