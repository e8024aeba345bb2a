"""A record's stored numbers depend on its sequence, the model and the options, never on its
batch (issue 32; docs/precision.md, "Reproducibility").

The same records are embedded in many batchings (``tokens_per_batch``, shards, input order,
subsets, other batch-mates, one record alone, one thread or two) and every value each store
holds for a record (every layer's pooled mean and BOS, per-residue rows, the largest
activation, the precision used, the fp32 fallback's re-run) is compared bit for bit with
the store of one batch of them all: ESM-2 (fair-esm .pt, both layouts; Hugging Face ESM-2)
SaProt (structure-aware records), T5 (ProtT5, Ankh, ProstT5 with amino-acid and 3Di records;
padded) and ESM C (both layouts)
under fp32, bf16-mixed and int8-mixed.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedpipe.model.random_hf import make_hf_test_model
from helpers.embed_helpers import bitwise_differences, embed_store, random_sequences, stored_values, structure_aware

RECORDS = random_sequences(12, [5, 260, 33, 120, 9, 77, 200, 14, 150, 61, 3, 98], seed=32)
#: other batch-mates: longer records the reference batch never held
MATES = [(f"mate{i}", seq) for i, (_, seq) in enumerate(random_sequences(3, [400, 310, 180], seed=33))]
LAYERS = (0, 1, 2)
#: what every batching computes: every layer, BOS (where the family has one) and per-residue rows
WHAT = dict(layers=LAYERS, per_residue=True)
POOLING = {"esm2-pt": ("mean", "bos"), "esm1b-pt": ("mean", "bos"), "hf-esm": ("mean", "bos"), "prot-t5": ("mean",),
           "ankh": ("mean",), "esmc": ("mean", "bos"), "prostt5": ("mean", "bos"), "saprot": ("mean", "bos")}


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory) -> dict[str, Path]:
    """Small random models of each family: 2 layers, width 64."""
    root = tmp_path_factory.mktemp("invariance-models")
    paths = {"esm2-pt": model_factory(layers=2, dim=64, heads=4, seed=32),
             "esm1b-pt": model_factory(layers=2, dim=64, heads=4, seed=32, family="esm1b")}
    for family in ("hf-esm", "prot-t5", "ankh", "esmc", "prostt5", "saprot"):
        paths[family] = make_hf_test_model(root / family, family=family, layers=2, dim=64, heads=4, seed=32)
    return paths


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    """``threads`` sets torch's process-wide thread count: put it back after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


#: (family, precision, layout): ESM-2 and ESM-1b in both layouts, T5 families padded (their only layout)
CASES = [
    ("esm2-pt", "fp32", "packed"), ("esm2-pt", "bf16-mixed", "packed"), ("esm2-pt", "int8-mixed", "packed"),
    ("esm2-pt", "fp32", "padded"), ("esm2-pt", "bf16-mixed", "padded"), ("esm2-pt", "int8-mixed", "padded"),
    ("hf-esm", "fp32", "packed"), ("hf-esm", "bf16-mixed", "padded"),
    ("esm1b-pt", "fp32", "packed"), ("esm1b-pt", "bf16-mixed", "padded"), ("esm1b-pt", "int8-mixed", "packed"),
    ("prot-t5", "fp32", "padded"), ("prot-t5", "bf16-mixed", "padded"), ("prot-t5", "int8-mixed", "padded"),
    ("ankh", "fp32", "padded"), ("ankh", "bf16-mixed", "padded"), ("ankh", "int8-mixed", "padded"),
    ("prostt5", "fp32", "padded"), ("prostt5", "bf16-mixed", "padded"),
    ("saprot", "fp32", "packed"), ("saprot", "bf16-mixed", "padded"),
    ("esmc", "fp32", "packed"), ("esmc", "bf16-mixed", "packed"), ("esmc", "int8-mixed", "packed"),
    ("esmc", "fp32", "padded"), ("esmc", "bf16-mixed", "padded"), ("esmc", "int8-mixed", "padded"),
]


def embed_values(tmp: Path, model: Path, records: Sequence[tuple[str, str]], name: str,
                 **options: object) -> dict[str, dict[str, np.ndarray]]:
    """Embed ``records`` into ``tmp/NAME.h5`` and read every record's values back (BOS too
    where the model's family has one)."""
    pooling = POOLING[model.name] if model.name in POOLING else ("mean", "bos")
    return stored_values(embed_store(tmp, model, records, name, pooling=pooling, **WHAT, **options))


def shards(records: Sequence[tuple[str, str]], tokens_per_shard: int) -> list[list[tuple[str, str]]]:
    """Consecutive records cut where a shard would pass ``tokens_per_shard`` (residues + 2
    special tokens each), as ``embedpipe shard`` cuts a FASTA; each shard is embedded alone."""
    out: list[list[tuple[str, str]]] = [[]]
    used = 0
    for record in records:
        if out[-1] and used + len(record[1]) + 2 > tokens_per_shard:
            out.append([])
            used = 0
        out[-1].append(record)
        used += len(record[1]) + 2
    return out


def _text(value: np.ndarray) -> str:
    item = value.item()
    return item.decode() if isinstance(item, bytes) else str(item)


def assert_same(reference: dict, other: dict, what: str) -> None:
    problems = bitwise_differences(reference, other)
    assert problems == [], f"{what}: " + "; ".join(problems[:6])
    assert set(other) - {rid for rid, _ in MATES} <= set(reference)


def records_of(family: str, records: Sequence[tuple[str, str]] = RECORDS) -> list[tuple[str, str]]:
    """``records``; for ProstT5 every third one lower case (3Di: the other direction prefix); for
    SaProt structure-aware (a 3Di state or ``#`` after each residue)."""
    if family == "saprot":
        return structure_aware(records, seed=34)
    if family != "prostt5":
        return list(records)
    return [(rid, seq.lower() if n % 3 == 0 else seq) for n, (rid, seq) in enumerate(records)]


@pytest.mark.parametrize(("family", "precision", "layout"), CASES)
def test_every_batching_gives_bit_identical_records(models, tmp_path, family, precision, layout):
    options = dict(precision=precision, batch_layout=layout)
    records = records_of(family)
    reference = embed_values(tmp_path, models[family], records, "all", tokens_per_batch=4096, threads=2, **options)
    assert sorted(reference) == sorted(rid for rid, _ in records)
    batchings: dict[str, Callable[[], dict]] = {
        "tokens_per_batch 150, one thread": lambda: embed_values(
            tmp_path, models[family], records, "small", tokens_per_batch=150, threads=1, **options),
        "reversed, longer batch-mates": lambda: embed_values(
            tmp_path, models[family], records_of(family, MATES) + records[::-1], "mates", tokens_per_batch=700,
            threads=2, **options),
        "every other record": lambda: embed_values(
            tmp_path, models[family], records[1::2], "subset", tokens_per_batch=4096, threads=2, **options),
        "one record alone": lambda: embed_values(
            tmp_path, models[family], records[6:7], "alone", tokens_per_batch=4096, threads=1, **options),
    }
    for what, embed in batchings.items():
        assert_same(reference, embed(), what)
    sharded: dict = {}
    for n, shard in enumerate(shards(records, 300)):
        sharded |= embed_values(tmp_path, models[family], shard, f"shard{n}", tokens_per_batch=4096, **options)
    assert_same(reference, sharded, "tokens_per_shard 300")
    assert sorted(sharded) == sorted(reference)


def test_the_fp32_fallback_rerun_is_batch_invariant(overflow_model, overflow_records, tmp_path):
    """The records that overflow fp16 are re-run in fp32 in batches of their own: their numbers
    too are the same whichever records fell back beside them."""
    options = dict(precision="fp16-mixed", batch_layout="packed")
    reference = embed_values(tmp_path, overflow_model, overflow_records, "all", tokens_per_batch=4096, **options)
    fell_back = sorted(rid for rid, values in reference.items() if _text(values["precision_used"]) == "fp32")
    assert fell_back == sorted(rid for rid, seq in overflow_records if "C" in seq)
    for name, records, budget in (("small", overflow_records, 90), ("reversed", overflow_records[::-1], 4096),
                                  ("fallen", [r for r in overflow_records if r[0] in fell_back][1:], 4096)):
        assert_same(reference, embed_values(tmp_path, overflow_model, records, name, tokens_per_batch=budget,
                                            **options), name)


#: the property's cases: each policy once per layout and family kind
PROPERTY_CASES = [("esm2-pt", "fp32", "packed"), ("esm2-pt", "bf16-mixed", "padded"),
                  ("esm2-pt", "int8-mixed", "packed"), ("prot-t5", "fp32", "padded"),
                  ("prot-t5", "bf16-mixed", "padded"), ("ankh", "int8-mixed", "padded"),
                  ("esmc", "bf16-mixed", "packed"), ("esmc", "int8-mixed", "padded")]
_references: dict[tuple, dict] = {}


@pytest.mark.parametrize(("family", "precision", "layout"), PROPERTY_CASES)
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picked=st.lists(st.sampled_from(range(len(RECORDS))), min_size=1, max_size=len(RECORDS), unique=True),
       tokens_per_batch=st.sampled_from([40, 130, 600, 4096]), tokens_per_shard=st.sampled_from([200, 700, 10_000]),
       threads=st.sampled_from([1, 2]))
def test_any_subset_order_budget_and_thread_count_gives_the_same_records(models, family, precision, layout,
                                                                         picked, tokens_per_batch, tokens_per_shard,
                                                                         threads):
    options = dict(precision=precision, batch_layout=layout)
    key = (family, precision, layout)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        if key not in _references:
            _references[key] = embed_values(tmp, models[family], RECORDS, "all", tokens_per_batch=4096, **options)
        records = [RECORDS[i] for i in picked]
        got: dict = {}
        for n, shard in enumerate(shards(records, tokens_per_shard)):
            got |= embed_values(tmp, models[family], shard, f"s{n}", tokens_per_batch=tokens_per_batch,
                                threads=threads, **options)
    assert sorted(got) == sorted(rid for rid, _ in records)
    assert_same(_references[key], got, f"records {picked}, {tokens_per_batch} tokens a batch, {threads} threads")


def test_the_store_says_it_was_batch_invariant(models, tmp_path):
    from embedpipe.runtime.packed_linear import tile_rows

    path = embed_store(tmp_path, models["esm2-pt"], RECORDS[:3], "attrs", precision="bf16-mixed")
    with h5py.File(path, "r") as f:
        assert bool(f.attrs["batch_invariant"]) is True
        assert int(f.attrs["batch_tile_rows"]) == tile_rows(torch.device("cpu")) == 128
