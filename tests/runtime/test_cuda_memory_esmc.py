"""ESM C's device memory per token, measured by tracing the forward at the 300M and 600M shapes
(issue 33, item 5), as tests/runtime/test_cuda_memory.py does for ESM-2.

An ESM C of the real width is built on a faked GPU (tests/helpers/fake_cuda.py: no weights exist),
one batch is embedded, and the peak of live device storage during it, less what was live before
(the weights), is what the batch needed. ``bytes_per_token`` from ``estimate_memory`` must match
it within 10% under every CUDA policy. Three layers stand in for the full depth: activations are
freed layer by layer, so the peak per token does not depend on it.
"""

from __future__ import annotations

import pytest
import torch
from test_cuda_memory import records_filling, traced_embed

from embedpipe.core.options import POLICY_KINDS, POLICY_NAMES
from embedpipe.model import esmc_spec
from embedpipe.model.esmc import EsmcModel, expected_shapes
from embedpipe.model.esmc_forward import EsmcShape, inverse_frequencies
from embedpipe.model.families import ESMC

#: width, heads, SwiGLU width of biohub's ESMC-300M and ESMC-600M
SHAPES = {"300M": (960, 15, 2560), "600M": (1152, 18, 3072)}
DEPTH = 3
CUDA_POLICIES = [name for name in POLICY_NAMES if POLICY_KINDS[name][0] != "int8"]


def fake_esmc(dim: int, heads: int, ffn: int) -> EsmcModel:
    """An ESM C of this shape, its weights fake (call inside ``fake_cuda``)."""
    shape = EsmcShape(num_layers=DEPTH, dim=dim, heads=heads, ffn=ffn, rope_theta=10000.0, pad_id=esmc_spec.PAD)
    weights = {name: torch.empty(size) for name, size in expected_shapes(shape, 64).items()}
    weights["inv_freq"] = inverse_frequencies(shape)
    return EsmcModel(weights=weights, shape=shape, name="fake", source="fake", sha256="0" * 64, trained=False,
                     **ESMC.capabilities().model_fields())


def traced_bytes_per_token(shape: str, precision: str, *, tokens: int = 16384, **options) -> tuple[float, int]:
    """(peak device bytes per computed token of the largest batch, the model's estimate), traced as
    test_cuda_memory traces every other family."""
    return traced_embed(lambda: fake_esmc(*SHAPES[shape]), records_filling(tokens), precision, tokens=tokens, **options)


#: (policy, --attention-inputs): every CUDA policy, and the mixed ones attending in fp32 too
CASES = [(name, "auto") for name in CUDA_POLICIES] + [("bf16-mixed", "fp32"), ("fp16-mixed", "fp32")]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(("precision", "attention_inputs"), CASES)
def test_the_estimate_matches_the_traced_peak(shape: str, precision: str, attention_inputs: str) -> None:
    traced, estimate = traced_bytes_per_token(shape, precision, per_residue=True, attention_inputs=attention_inputs)
    assert traced > 0
    assert abs(estimate - traced) <= 0.10 * traced, (traced / SHAPES[shape][0], estimate / SHAPES[shape][0])
