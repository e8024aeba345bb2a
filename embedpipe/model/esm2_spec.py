"""ESM-2's names, shapes and sizes: what is known without torch or weights.

Its row of :data:`embedpipe.model.families.FAMILY_TABLE` (what ESM-2 can do: packs, token layout,
trained window) names this module's name table and its Hugging Face reading (:data:`HF_ESM`);
:mod:`embedpipe.model.esm2` builds the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embedpipe.model.config_bounds import esm_config
from embedpipe.model.facts import MemoryEstimate, host_bytes
from embedpipe.model.hf_families import HfFamily

#: the version of ESM-2's forward (esm2_forward.py) and tokens, in every store's identity:
#: bump it when a change moves the numbers (docs/cluster.md, "Resuming, rerunning")
FAMILY_VERSION = 1

#: fair-esm ESM-2 names -> (layers, embedding dim, attention heads).
ESM2_MODELS: dict[str, tuple[int, int, int]] = {
    "esm2_t6_8M_UR50D": (6, 320, 20),
    "esm2_t12_35M_UR50D": (12, 480, 20),
    "esm2_t30_150M_UR50D": (30, 640, 20),
    "esm2_t33_650M_UR50D": (33, 1280, 20),
    "esm2_t36_3B_UR50D": (36, 2560, 40),
    "esm2_t48_15B_UR50D": (48, 5120, 40),
}

#: Tokens of ESM-2's alphabet (fair-esm's "ESM-1b" architecture alphabet).
VOCABULARY_SIZE = 33


def parameter_count(layers: int, dim: int, heads: int) -> int:
    """Parameters of fair-esm's ``ESM2`` (the LM head tied to the token embedding, counted once).

    Per layer: q/k/v/out projections 4(D^2 + D), FFN 8D^2 + 5D, two layer norms 4D. Outside
    the layers: the token embedding, the final layer norm, the LM head's dense layer, layer
    norm and bias, and the contact head's regression.
    """
    per_layer = 12 * dim * dim + 13 * dim
    outside = VOCABULARY_SIZE * dim + 2 * dim + (dim * dim + dim + 2 * dim + VOCABULARY_SIZE)
    return layers * per_layer + outside + layers * heads + 1


def name_sizes(spec: str) -> tuple[tuple[int, int, int], int]:
    """A registered name's (layers, dim, heads) and parameter count, from the name table."""
    shape = ESM2_MODELS[spec]
    return shape, parameter_count(*shape)


#: forward working memory per token, in units of D bytes, per kind of policy: the live peak of
#: a traced forward (tests/runtime/test_cuda_memory.py: the 650M and 3B shapes on a faked GPU, no
#: weights), which includes the hidden state of the layer in flight
ACTIVATION_D_BYTES = {"fp32": 44, "plain": 22, "fp32-islands": 30, "fp32-islands-fp32-attention": 36, "autocast": 28}


def estimate_memory(layers: int, dim: int, heads: int, weight_itemsize: int,
                    compute_itemsize: int, *, kind: str = "plain", parameters: int | None = None) -> MemoryEstimate:
    """Memory of an ESM-2 under a policy whose weights and matmuls use the given sizes.

    Activations per token (``kind``: ``fp32``, ``plain`` 16-bit, ``fp32-islands`` with q/k/v
    cast to the compute dtype for attention, ``fp32-islands-fp32-attention``, ``autocast``),
    the peak of one layer:
    - fp32 and plain 16-bit, at the FFN: residual stream and its norm (2 x D values), the
      hidden layer before and after GELU (2 x 4D), the FFN's output (D): 11 D values;
    - fp32 islands, at attention: fp32 stream and norm (8D bytes), the norm in the compute
      dtype (2D), fused q/k/v (6D), q and k rotated in fp32 (8D) and cast back (4D), the
      attention output (2D): 30 D bytes; attending in fp32 (v and the output fp32, the
      padded layout's mask): 36 D;
    - autocast: fp32 stream and norm, the rest in the compute dtype: 28 D bytes.
    Attention scores are not counted: neither SDPA nor the varlen kernel holds them on CUDA.
    The residual stream (and so a returned hidden state) is fp32 except under plain casts.
    The widest tensor is the FFN's hidden layer, 4 D values a token.
    """
    if parameters is None:  # ESM-1b passes its own count (the same layers, plus a position table)
        parameters = parameter_count(layers, dim, heads)
    if compute_itemsize == 4:
        kind = "fp32"
    return MemoryEstimate(
        host_bytes=host_bytes(4 * parameters),
        weight_bytes=weight_itemsize * parameters,
        activation_bytes_per_token=dim * ACTIVATION_D_BYTES[kind],
        hidden_itemsize=weight_itemsize if kind == "plain" else 4,
        widest_values_per_token=4 * dim,
    )


# --------------------------------------------------------------------------- Hugging Face ESM-2


def hf_identity_files(directory: Path, config: Mapping[str, Any]) -> list[str]:
    """``config.json`` and ``vocab.txt`` (checked against fair-esm's alphabet on load)."""
    return ["config.json", "vocab.txt"]


#: ``model_type: esm`` directories with rotary positions and ESM-2's letters, loaded into the
#: ESM-2 runner (:mod:`embedpipe.model.hf_esm`); ESM-1b and SaProt share the type as variants
HF_ESM = HfFamily(model_type="esm", label="ESM-2", sizes=esm_config, identity_files=hf_identity_files)
