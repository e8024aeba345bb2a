"""ESM-2's names, shapes, trained window and sizes: what is known without torch or weights.

The registry (:mod:`embedpipe.model.registry`) and the workflow use this module to describe
a spec; :mod:`embedpipe.model.esm2` builds the model.
"""

from __future__ import annotations

from pathlib import Path

from embedpipe.model.facts import MemoryEstimate, ModelFacts, host_bytes

FAMILY = "esm2"

#: fair-esm ESM-2 names -> (layers, embedding dim, attention heads).
ESM2_MODELS: dict[str, tuple[int, int, int]] = {
    "esm2_t6_8M_UR50D": (6, 320, 20),
    "esm2_t12_35M_UR50D": (12, 480, 20),
    "esm2_t30_150M_UR50D": (30, 640, 20),
    "esm2_t33_650M_UR50D": (33, 1280, 20),
    "esm2_t36_3B_UR50D": (36, 2560, 40),
    "esm2_t48_15B_UR50D": (48, 5120, 40),
}

#: ESM-2 was trained on 1024 tokens: 1022 residues plus BOS and EOS.
TRAINED_RESIDUES = 1022

#: Tokens of ESM-2's alphabet (fair-esm's "ESM-1b" architecture alphabet).
VOCABULARY_SIZE = 33


def is_model_name(spec: str) -> bool:
    """Whether ``spec`` is one of fair-esm's ESM-2 names."""
    return spec in ESM2_MODELS


def valid_names() -> str:
    return ", ".join(ESM2_MODELS)


def claims(spec: str) -> bool:
    """ESM-2 takes every spec: its names, and any path (a fair-esm checkpoint, checked on load)."""
    return True


def parameter_count(layers: int, dim: int, heads: int) -> int:
    """Parameters of fair-esm's ``ESM2`` (the LM head tied to the token embedding, counted once).

    Per layer: q/k/v/out projections 4(D^2 + D), FFN 8D^2 + 5D, two layer norms 4D. Outside
    the layers: the token embedding, the final layer norm, the LM head's dense layer, layer
    norm and bias, and the contact head's regression.
    """
    per_layer = 12 * dim * dim + 13 * dim
    outside = VOCABULARY_SIZE * dim + 2 * dim + (dim * dim + dim + 2 * dim + VOCABULARY_SIZE)
    return layers * per_layer + outside + layers * heads + 1


def describe(spec: str) -> ModelFacts:
    """Facts about ``spec`` from the name table, or from a path's file size (no torch)."""
    if is_model_name(spec):
        layers, dim, heads = ESM2_MODELS[spec]
        parameters = parameter_count(layers, dim, heads)
        return ModelFacts(
            family=FAMILY, spec=spec, kind="name", name=spec, trained_window=TRAINED_RESIDUES,
            num_layers=layers, embed_dim=dim, attention_heads=heads, parameters=parameters,
            weights_bytes=4 * parameters, trained=True,
        )
    path = Path(spec).expanduser()
    size = path.stat().st_size if path.is_file() else None
    return ModelFacts(family=FAMILY, spec=spec, kind="path", name=path.stem,
                      trained_window=TRAINED_RESIDUES, weights_bytes=size)


def estimate_memory(layers: int, dim: int, heads: int, weight_itemsize: int,
                    compute_itemsize: int) -> MemoryEstimate:
    """Memory of an ESM-2 under a policy whose weights and matmuls use the given sizes.

    Activations per padded token: the fp32 residual stream and its layer norm (8D bytes),
    q/k/v (3D) and the FFN's hidden layer (4D) in the compute dtype, fp32 rotation of q and
    k (8D). Attention scores are not counted: SDPA does not hold them on CUDA.
    """
    parameters = parameter_count(layers, dim, heads)
    return MemoryEstimate(
        host_bytes=host_bytes(4 * parameters),
        weight_bytes=weight_itemsize * parameters,
        activation_bytes_per_token=dim * (16 + 7 * compute_itemsize),
    )
