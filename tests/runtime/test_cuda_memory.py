"""Device memory per token, measured by tracing the forward (issue 20, §2; issue 31: every family).

An ESM-2 of the 650M or 3B shape is built on a faked GPU (tests/helpers/fake_cuda.py), so no weights
exist; one batch is embedded and the peak of live device storage during it, less what was
live before (the weights), is the memory the batch needed. ``batch_budget.bytes_per_token``,
from the model's ``estimate_memory``, must match it within 10% for every policy. Three
layers of the real width stand in for the full depth: activations are freed layer by layer
and weights are not counted, so the peak per token does not depend on the depth (the full
650M depth gives the same 30.0 D for bf16-mixed; docs/benchmarks.md).

Every family is traced the same way (ESM-2 ``.pt``, HF ESM-2, ProtT5, Ankh) from its
``make-test-model`` directory, and the T5 encoders also at the ProtT5-XL and Ankh-large widths.
A T5's attention scores are quadratic: its estimate counts them at the longest window the
planner cuts (4096 residues and ``</s>``), so it must hold a batch of such windows within the
same 10% and never be below what any batch needs (shorter ones need less).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from esm.model.esm2 import ESM2

from embedpipe.core.options import POLICY_KINDS, POLICY_NAMES, EmbedOptions
from embedpipe.extraction import budget as batch_budget
from embedpipe.model import families, load_model
from embedpipe.model.esm2 import Esm2Model, esm2_alphabet, skip_random_init
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.model.t5 import T5Model
from embedpipe.model.t5_forward import T5Shape
from helpers.engine import embedder_for
from helpers.fake_cuda import fake_cuda

SHAPES = {"650M": (1280, 20), "3B": (2560, 40)}
DEPTH = 3
LENGTHS = [400, 1022, 700, 150, 300, 90]


def records_filling(tokens: int) -> list[tuple[str, str]]:
    """Protein-like records whose tokens (residues + 2) fill ``tokens``."""
    rng = np.random.default_rng(0)
    amino = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    out, used, i = [], 0, 0
    while used + LENGTHS[i % len(LENGTHS)] + 2 <= tokens:
        n = LENGTHS[i % len(LENGTHS)]
        out.append((f"r{i}", "".join(rng.choice(amino, n))))
        used, i = used + n + 2, i + 1
    return out


def fake_model(dim: int, heads: int, depth: int = DEPTH) -> Esm2Model:
    """An ESM-2 of this width, its parameters fake (call inside ``fake_cuda``)."""
    alphabet = esm2_alphabet()
    with skip_random_init():
        model = ESM2(num_layers=depth, embed_dim=dim, attention_heads=heads, alphabet=alphabet, token_dropout=True)
    return Esm2Model(model=model.eval().requires_grad_(False), alphabet=alphabet, name="fake", source="fake",
                     sha256="0" * 64, trained=False, num_layers=depth, embed_dim=dim, attention_heads=heads,
                     **families.ESM2.capabilities().model_fields())


def traced_bytes_per_token(shape: str, precision: str, *, tokens: int = 16384, **options) -> tuple[float, int]:
    """(peak device bytes per computed token of the largest batch, the model's estimate)."""
    return traced_embed(lambda: fake_model(*SHAPES[shape]), records_filling(tokens), precision, tokens=tokens, **options)


def traced_embed(make, records: list[tuple[str, str]], precision: str, *, tokens: int, **options) -> tuple[float, int]:
    """Embed ``records`` with the model ``make()`` returns on the faked GPU: (peak device bytes
    per computed token of the largest batch, ``bytes_per_token`` from the run the embedder resolved)."""
    with fake_cuda(track_memory=True) as trace:
        loaded = make()
        embedder = embedder_for(loaded, dict(precision=precision, device="cuda", tokens_per_batch=tokens, **options),
                                torch.device("cuda", 0))  # attention_inputs: the override
        plan = embedder.plan(records)
        embedder.runner(embedder.policy)
        trace.clear()
        before = trace.peak_bytes
        dict(embedder.embed(records, plan))
        computed = max(sum(p.tokens for p in b) if plan.packed else len(b) * max(p.tokens for p in b)
                       for b in plan.batches)
        run = embedder.run
        estimate = batch_budget.bytes_per_token(loaded, run.policy, embedder.layers, run.options.per_residue,
                                                attention_inputs=run.attention_inputs)
        return (trace.peak_bytes - before) / computed, estimate


#: policies that run on CUDA (int8-mixed is CPU only: refused there)
CUDA_POLICIES = [name for name in POLICY_NAMES if POLICY_KINDS[name][0] != "int8"]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("precision", CUDA_POLICIES)
def test_the_estimate_matches_the_traced_peak(shape, precision):
    traced, estimate = traced_bytes_per_token(shape, precision, per_residue=True)
    assert traced > 0
    assert abs(estimate - traced) <= 0.10 * traced, (traced / SHAPES[shape][0], estimate / SHAPES[shape][0])


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16-mixed", "amp-bf16"])
@pytest.mark.parametrize("per_residue", [False, True], ids=["pooled", "per-residue"])
def test_stored_layers_beside_the_last_are_counted(precision, per_residue):
    traced, estimate = traced_bytes_per_token("650M", precision, layers=(0, 1, 2, 3), per_residue=per_residue)
    assert abs(estimate - traced) <= 0.10 * traced, (traced / 1280, estimate / 1280)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_fp32_attention_inputs_are_counted(shape, precision):
    """--attention-inputs fp32 keeps v and the attention output in fp32 (and pads): 36 D, not 30 D."""
    traced, estimate = traced_bytes_per_token(shape, precision, per_residue=True, attention_inputs="fp32")
    assert abs(estimate - traced) <= 0.10 * traced, (traced / SHAPES[shape][0], estimate / SHAPES[shape][0])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_an_auto_budget_keeps_every_kernel_input_under_2_to_the_31_elements(shape):
    with fake_cuda(track_memory=False) as trace:
        loaded = fake_model(*SHAPES[shape])
        embedder = embedder_for(loaded, EmbedOptions(precision="bf16-mixed", device="cuda"), torch.device("cuda", 0))
        budget = embedder.tokens_per_batch
        records = records_filling(budget)
        embedder.runner(embedder.policy)
        trace.clear()
        dict(embedder.embed(records))
    dim = SHAPES[shape][0]
    assert budget * 4 * dim < 2**31 <= (budget + 2 * 256) * 4 * dim  # the cap binds on a 141 GB card
    assert embedder.stats["batches"] == 1
    assert 0.99 * budget * 4 * dim <= trace.largest < 2**31  # the FFN's hidden layer, the widest tensor


# -- every family ----------------------------------------------------------------------------

#: a T5 window: 4096 residues (the planner's longest) and its ``</s>``
T5_WINDOW = 4096


def _residues(lengths: list[int], seed: int = 0) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    amino = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    return [(f"r{i}", "".join(rng.choice(amino, n))) for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def family_paths(model_factory, tmp_path_factory) -> dict:
    """Every family from make-test-model: ESM-2 at the 8M width (320, 20 heads), T5s at 64.
    Each test loads its own model: preparing an fp32 runner moves the loaded one to the device."""
    root = tmp_path_factory.mktemp("families")
    paths = {"esm2-pt": model_factory(layers=2, dim=320, heads=20, seed=1),
             "hf-esm": make_hf_test_model(root / "hf-esm", family="hf-esm", layers=2, dim=320, heads=20, seed=1)}
    for family in ("prot-t5", "ankh"):
        paths[family] = make_hf_test_model(root / family, family=family, layers=2, dim=64, heads=4, seed=1)
    return paths


def _is_t5(family: str) -> bool:
    return family in ("prot-t5", "ankh")


@pytest.mark.parametrize("family", ["esm2-pt", "hf-esm", "prot-t5", "ankh"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16", "amp-bf16"])
def test_every_familys_estimate_matches_the_traced_peak(family_paths, family, precision):
    """ESM-2's batches of mixed lengths; a T5's batch of two full windows, the length its estimate is for."""
    loaded = load_model(str(family_paths[family]))
    lengths, tokens = ([T5_WINDOW, T5_WINDOW], 2 * (T5_WINDOW + 1)) if _is_t5(family) else (LENGTHS, 4096)
    traced, estimate = traced_embed(lambda: loaded, _residues(lengths), precision, tokens=tokens, per_residue=True)
    assert traced > 0
    assert abs(estimate - traced) <= 0.10 * traced, (family, traced, estimate)
    if _is_t5(family):
        assert estimate >= traced


#: T5 encoders at their real widths (d_model, d_kv, heads, d_ff, gated): ProtT5-XL, Ankh-large
T5_SHAPES = {"prot-t5-xl": (1024, 128, 32, 16384, False), "ankh-large": (1536, 64, 16, 3840, True)}


def fake_t5(small: T5Model, d_model: int, d_kv: int, heads: int, d_ff: int, gated: bool, depth: int = 2) -> T5Model:
    """``small`` (its vocabulary) at this width, its weights fake (call inside ``fake_cuda``)."""
    shape = T5Shape(num_layers=depth, d_model=d_model, d_kv=d_kv, num_heads=heads, d_ff=d_ff, gated=gated)
    inner = heads * d_kv
    weights = {"embed": torch.empty(small.weights["embed"].shape[0], d_model),
               "relative_bias": torch.empty(shape.num_buckets, heads), "final_ln": torch.empty(d_model)}
    ffn = {"wi_0": (d_ff, d_model), "wi_1": (d_ff, d_model)} if gated else {"wi": (d_ff, d_model)}
    for i in range(depth):
        sizes = {"q": (inner, d_model), "k": (inner, d_model), "v": (inner, d_model), "o": (d_model, inner),
                 "ln0": (d_model,), "ln1": (d_model,), "wo": (d_model, d_ff), **ffn}
        weights |= {f"{i}.{name}": torch.empty(size) for name, size in sizes.items()}
    return dataclasses.replace(small, weights=weights, shape=shape)


@pytest.mark.parametrize("shape", list(T5_SHAPES))
@pytest.mark.parametrize("precision", CUDA_POLICIES)
@pytest.mark.parametrize("inputs", ["auto", "fp32"])
def test_the_t5_estimate_holds_full_windows_at_the_real_widths(family_paths, shape, precision, inputs):
    """``--attention-inputs fp32`` included: it costs a T5 less at full windows (no cast copy
    of the scores into the bias's fp32), which the estimate says too."""
    small = load_model(str(family_paths["prot-t5"]))
    traced, estimate = traced_embed(lambda: fake_t5(small, *T5_SHAPES[shape]), _residues([T5_WINDOW, T5_WINDOW]),
                                    precision, tokens=2 * (T5_WINDOW + 1), per_residue=True, attention_inputs=inputs)
    assert traced <= estimate <= 1.10 * traced, (shape, traced, estimate)


@pytest.mark.parametrize("shape", list(T5_SHAPES))
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16"])
def test_the_t5_estimate_is_an_upper_bound_for_shorter_batches(family_paths, shape, precision):
    """The scores of shorter windows are smaller: the estimate over-counts them, never under."""
    small = load_model(str(family_paths["prot-t5"]))
    records = _residues([100, 700, 1500, 300])
    traced, estimate = traced_embed(lambda: fake_t5(small, *T5_SHAPES[shape]), records, precision, tokens=8192,
                                    per_residue=True)
    assert 0 < traced <= estimate
