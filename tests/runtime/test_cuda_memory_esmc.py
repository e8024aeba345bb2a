"""ESM C's device memory per token, measured by tracing the forward at the 300M and 600M shapes
(issue 33, item 5), as tests/runtime/test_cuda_memory.py does for ESM-2.

An ESM C of the real width is built on a faked GPU (tests/helpers/fake_cuda.py: no weights exist),
one batch is embedded, and the peak of live device storage during it, less what was live before
(the weights), is what the batch needed. ``bytes_per_token`` from ``estimate_memory`` must match
it within 10% under every CUDA policy. Three layers stand in for the full depth: activations are
freed layer by layer, so the peak per token does not depend on it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedpipe.core.options import POLICY_KINDS, POLICY_NAMES, EmbedOptions
from embedpipe.embed import budget as batch_budget
from embedpipe.embed.engine import Embedder
from embedpipe.model import esmc_spec
from embedpipe.model.esmc import EsmcModel, expected_shapes
from embedpipe.model.esmc_forward import EsmcShape, inverse_frequencies
from embedpipe.runtime.precision import get_policy, resolve_attention_inputs
from helpers.fake_cuda import fake_cuda

#: width, heads, SwiGLU width of biohub's ESMC-300M and ESMC-600M
SHAPES = {"300M": (960, 15, 2560), "600M": (1152, 18, 3072)}
DEPTH = 3
LENGTHS = [400, 1022, 700, 150, 300, 90]
CUDA_POLICIES = [name for name in POLICY_NAMES if POLICY_KINDS[name][0] != "int8"]


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


def fake_esmc(dim: int, heads: int, ffn: int) -> EsmcModel:
    """An ESM C of this shape, its weights fake (call inside ``fake_cuda``)."""
    shape = EsmcShape(num_layers=DEPTH, dim=dim, heads=heads, ffn=ffn, rope_theta=10000.0, pad_id=esmc_spec.PAD)
    weights = {name: torch.empty(size) for name, size in expected_shapes(shape, 64).items()}
    weights["inv_freq"] = inverse_frequencies(shape)
    return EsmcModel(weights=weights, shape=shape, name="fake", source="fake", sha256="0" * 64, trained=False,
                     trained_window=esmc_spec.window(None), token_layout=esmc_spec.layout(None))


def traced_bytes_per_token(shape: str, precision: str, *, tokens: int = 16384, **options) -> tuple[float, int]:
    """(peak device bytes per computed token of the largest batch, the model's estimate)."""
    with fake_cuda(track_memory=True) as trace:
        loaded = fake_esmc(*SHAPES[shape])
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


#: (policy, --attention-inputs): every CUDA policy, and the mixed ones attending in fp32 too
CASES = [(name, "auto") for name in CUDA_POLICIES] + [("bf16-mixed", "fp32"), ("fp16-mixed", "fp32")]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(("precision", "attention_inputs"), CASES)
def test_the_estimate_matches_the_traced_peak(shape: str, precision: str, attention_inputs: str) -> None:
    traced, estimate = traced_bytes_per_token(shape, precision, per_residue=True, attention_inputs=attention_inputs)
    assert traced > 0
    assert abs(estimate - traced) <= 0.10 * traced, (traced / SHAPES[shape][0], estimate / SHAPES[shape][0])
