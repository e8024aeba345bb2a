"""Device memory per token, measured by tracing the forward at the real ESM-2 shapes (issue 20, §2).

An ESM-2 of the 650M or 3B shape is built on a faked GPU (tests/helpers/fake_cuda.py), so no weights
exist; one batch is embedded and the peak of live device storage during it, less what was
live before (the weights), is the memory the batch needed. ``batch_budget.bytes_per_token``,
from the model's ``estimate_memory``, must match it within 10% for every policy. Three
layers of the real width stand in for the full depth: activations are freed layer by layer
and weights are not counted, so the peak per token does not depend on the depth (the full
650M depth gives the same 30.0 D for bf16-mixed; docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from esm.model.esm2 import ESM2

from embedpipe.core.options import POLICY_KINDS, POLICY_NAMES, EmbedOptions
from embedpipe.embed import budget as batch_budget
from embedpipe.embed.engine import Embedder
from embedpipe.model.esm2 import Esm2Model, esm2_alphabet, skip_random_init
from embedpipe.runtime.precision import get_policy, resolve_attention_inputs
from helpers.fake_cuda import fake_cuda

SHAPES = {"650M": (1280, 20), "3B": (2560, 40)}
DEPTH = 3
LENGTHS = [400, 1022, 700, 150, 300, 90]


def _records(tokens: int) -> list[tuple[str, str]]:
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
                     sha256="0" * 64, trained=False, num_layers=depth, embed_dim=dim, attention_heads=heads)


def traced_bytes_per_token(shape: str, precision: str, *, tokens: int = 16384, **options) -> tuple[float, int]:
    """(peak device bytes per computed token of the largest batch, the model's estimate)."""
    with fake_cuda(track_memory=True) as trace:
        loaded = fake_model(*SHAPES[shape])
        chosen = EmbedOptions(precision=precision, device="cuda", tokens_per_batch=tokens, **options)
        embedder = Embedder(loaded, chosen, torch.device("cuda", 0))
        records = _records(tokens)
        plan = embedder.plan(records)
        embedder.runner(embedder.policy)
        trace.clear()
        before = trace.peak_bytes
        dict(embedder.embed(records, plan))
        computed = max(sum(p.tokens for p in b) if plan.packed else len(b) * max(p.tokens for p in b)
                       for b in plan.batches)
        estimate = batch_budget.bytes_per_token(loaded, get_policy(precision), embedder.layers, chosen.per_residue,
                                                attention_inputs=resolve_attention_inputs(chosen.attention_inputs,
                                                                                          embedder.device))
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
        embedder = Embedder(loaded, EmbedOptions(precision="bf16-mixed", device="cuda"), torch.device("cuda", 0))
        budget = embedder.tokens_per_batch
        records = _records(budget)
        embedder.runner(embedder.policy)
        trace.clear()
        dict(embedder.embed(records))
    dim = SHAPES[shape][0]
    assert budget * 4 * dim < 2**31 <= (budget + 2 * 256) * 4 * dim  # the cap binds on a 141 GB card
    assert embedder.stats["batches"] == 1
    assert 0.99 * budget * 4 * dim <= trace.largest < 2**31  # the FFN's hidden layer, the widest tensor
