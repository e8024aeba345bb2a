"""The optional Hugging Face peer (benchmarks/hf_esm_peer.py) reproduces fair-esm's ESM-2.

transformers is in the ``test`` extra (not a dependency of embedpipe itself). Where it is
missing the tests skip, and under ``CI=true`` that skip fails the run (marker ``peer``).
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
pytestmark = [
    pytest.mark.peer,
    pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed (pip install -e '.[test]')"),
]

PEER = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_esm_peer.py"
AMINO = "ACDEFGHIKLMNPQRSTVWY"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("hf_esm_peer", PEER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _random_sequences(seed: int, lengths: list[int]) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(AMINO) for _ in range(n)) for n in lengths]


def check_matches_fair_esm(peer, fair_esm_reference, path: Path, seqs: list[str]) -> None:
    from embedpipe.model import load_model

    ref_model, ref_alphabet = fair_esm_reference(path)
    hf = peer.convert_to_hf(load_model(str(path)))
    assert peer.attention_implementation(hf) == "sdpa"
    assert hf.pooler is None

    _, _, toks = ref_alphabet.get_batch_converter()([(f"s{i}", s) for i, s in enumerate(seqs)])
    assert toks.eq(ref_alphabet.padding_idx).any(), "the batch must be padded"
    layers = ref_model.num_layers
    with torch.no_grad():
        want = ref_model(toks, repr_layers=[layers])["representations"][layers]
        got = hf(input_ids=toks, attention_mask=toks.ne(ref_alphabet.padding_idx).long()).last_hidden_state
    assert got.shape == want.shape
    real = toks.ne(ref_alphabet.padding_idx)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-4)


def test_converted_model_matches_fair_esm_on_padded_batch(peer, tiny_model_path, fair_esm_reference):
    seqs = _random_sequences(0, [7, 31, 18, 50])
    seqs[2] = seqs[2][:5] + "<mask>" + seqs[2][5:]  # exercises token dropout's rescaling
    check_matches_fair_esm(peer, fair_esm_reference, tiny_model_path, seqs)


def test_other_shape_matches_fair_esm(peer, model_factory, fair_esm_reference):
    path = model_factory(layers=3, dim=48, heads=6, seed=3)
    check_matches_fair_esm(peer, fair_esm_reference, path, _random_sequences(1, [12, 40, 3]))


def test_run_hf_writes_fair_esm_recipe_outputs(peer, tiny_model_path, fair_esm_reference, tmp_path):
    seqs = _random_sequences(2, [1030, 20, 45, 9])  # the first is truncated at 1022 residues
    ids = [f"sp|P{i:05d}|TEST_{i}" for i in range(len(seqs))]
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">{i} some description\n{s}\n" for i, s in zip(ids, seqs)))
    out = tmp_path / "out"
    peer.run_hf(tiny_model_path, fasta, out, threads=1)

    stats = json.loads((out / "_stats.json").read_text())
    assert 0 < stats["padding_efficiency"] <= 1
    assert stats["attention"] == "sdpa"

    ref_model, alphabet = fair_esm_reference(tiny_model_path)
    layers = ref_model.num_layers
    files = sorted(out.glob("*.pt"))
    assert len(files) == len(seqs)
    for ident, seq in zip(ids, seqs):
        data = torch.load(out / f"{ident.replace('|', '_')}.pt", weights_only=True)
        assert data["label"].split()[0] == ident
        n = min(1022, len(seq))
        _, _, toks = alphabet.get_batch_converter(1022)([(ident, seq)])
        with torch.no_grad():
            rep = ref_model(toks, repr_layers=[layers])["representations"][layers][0, 1 : n + 1].mean(0)
        torch.testing.assert_close(data["mean_representations"][layers], rep, rtol=0, atol=1e-4)
