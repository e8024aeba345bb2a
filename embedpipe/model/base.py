"""The interface between embedpipe and a model family (docs/architecture.md).

The worker (:mod:`embedpipe.extraction.engine`), cross-check and workflow use a model only through
:class:`EmbeddingModel` and the :class:`Runner` it prepares. A family implements both in one
module, named by its row of :data:`embedpipe.model.families.FAMILY_TABLE` (a family from outside
embedpipe: registered in :mod:`embedpipe.model.registry`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from embedpipe.model.facts import MemoryEstimate
from embedpipe.model.layout import TokenLayout  # re-exported: families import it here
from embedpipe.runtime.packed import PackedTokens, token_max_abs
from embedpipe.runtime.precision import Policy

#: Forward implementations a family may offer: ``sdpa`` (fused attention), ``math``
#: (explicit scores, fp32 softmax) and ``fair-esm`` (the reference library's own forward).

__all__ = ["EmbeddingModel", "ForwardOutput", "PackedRunner", "Runner", "TokenLayout", "masked_max_abs"]


@dataclass
class ForwardOutput:
    """Hidden states of the requested layers, (B, T, D), plus per-record max |activation|."""

    hidden: dict[int, torch.Tensor]
    max_abs: torch.Tensor  # (B,) float32: largest |x| over the record's own tokens, all layers seen


class Runner(Protocol):
    """A model prepared for one policy on one device (padded batches).

    A family whose ``batch_layouts`` include ``packed`` prepares a :class:`PackedRunner`.
    """

    def __call__(self, tokens: torch.Tensor, layers: list[int]) -> ForwardOutput:
        """Hidden states of ``layers`` (0 = token embedding) for a batch from ``tokenize``."""
        ...

    @property
    def fp32_layers(self) -> dict[str, str]:
        """Linear layers the policy would run in low precision but keeps fp32, name -> why
        (int8-mixed: weights too small for int8); empty for every other policy."""
        ...


@runtime_checkable
class PackedRunner(Runner, Protocol):
    """A runner that also takes the packed layout (:mod:`embedpipe.runtime.packed`)."""

    def packed(self, batch: PackedTokens, layers: list[int]) -> ForwardOutput:
        """Hidden states (N, D) of ``layers`` for a packed batch (no padding)."""
        ...


class EmbeddingModel(Protocol):
    """A loaded model, fp32 on the CPU, with where it came from.

    Token layout (shard budgets, batch planning and pooling follow it): ``token_layout``
    (:class:`~embedpipe.model.layout.TokenLayout`). Every attribute is required: nothing is
    read with an ESM-2 default (mypy checks each family against this class).
    ``tokenize`` returns (B, extra + longest) int64 on the CPU: BOS at 0 when the layout has
    one, the residues, EOS after them when it has one, then padding.
    """

    name: str  # registered name, or the checkpoint file's stem for a path
    source: str  # resolved checkpoint path
    sha256: str  # of the checkpoint file's bytes
    trained: bool  # False for random-weight test models (never present them as real)
    trained_window: int  # residues per forward window the model was trained on
    token_layout: TokenLayout  # its special tokens
    family: str  # the store's model_family (esm2, prot-t5, ankh, ...)
    batch_layouts: tuple[str, ...]  # ("packed", "padded") when it prepares a PackedRunner, else ("padded",)
    provenance: Mapping[str, str]  # family-specific store attributes (e.g. fair_esm_version)

    @property
    def num_layers(self) -> int:
        """Transformer layers (layer 0 is the token embedding, so ``num_layers + 1`` are stored)."""
        ...

    @property
    def embed_dim(self) -> int:
        """Width of every hidden state."""
        ...

    def tokenize(self, sequences: Sequence[str]) -> torch.Tensor:
        """Token ids of ``sequences`` (validated protein letters), laid out as above."""
        ...

    def prepare(self, policy: Policy, device: torch.device, attention: str, *, attention_inputs: str = "fp32") -> Runner:
        """A runner for ``policy`` on ``device``; the fp32 model stays usable as the fallback.
        ``attention_inputs`` (``fp32`` or ``compute``): see :func:`embedpipe.runtime.precision.attention_dtype`."""
        ...

    def estimate_memory(self, policy: Policy, *, attention_inputs: str = "fp32") -> MemoryEstimate:
        """Host, weight and per-token activation memory under ``policy``, with q/k/v at the
        attention kernel as ``attention_inputs`` (resolved: ``fp32`` or ``compute``) says."""
        ...


def masked_max_abs(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-record max |x| over kept tokens, in fp32; NaN/inf propagate so they are never hidden.

    Per token through :func:`token_max_abs` (on CPU ``abs`` then ``amax``, which beats the
    one-kernel ``vector_norm(ord=inf)`` by far, docs/benchmarks.md "What the speed comes from";
    off the CPU one min/max reduction, no full ``|x|`` copy a layer), then a tiny (B, T) mask.
    """
    return token_max_abs(x).masked_fill(~keep, 0.0).amax(dim=1)
