"""The interface between embedpipe and a model family (docs/architecture.md).

The worker (:mod:`embedpipe.embed.engine`), cross-check and workflow use a model only through
:class:`EmbeddingModel` and the :class:`Runner` it prepares. A family implements both in one
module and is registered in :mod:`embedpipe.model.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from embedpipe.model.facts import MemoryEstimate
from embedpipe.runtime.precision import Policy

#: Forward implementations a family may offer: ``sdpa`` (fused attention), ``math``
#: (explicit scores, fp32 softmax) and ``fair-esm`` (the reference library's own forward).


@dataclass(frozen=True)
class TokenLayout:
    """Where a family puts its special tokens around the residues of one forward window.

    ``bos``: one token before the residues (ESM-2's ``<cls>``); ``eos``: one after them;
    ``window``: the most residues one forward pass takes (``None``: no hard window).
    Declared by each family; today planning, shard budgets and pooling still assume ESM-2's
    layout (docs/models.md, "Token layout"), and the redesign routes them through this.
    """

    bos: bool
    eos: bool
    window: int | None

    @property
    def extra_tokens(self) -> int:
        """Tokens a record carries besides its residues (ESM-2: 2, T5: 1)."""
        return int(self.bos) + int(self.eos)

    @property
    def first_residue(self) -> int:
        """Position of the first residue in a tokenized row."""
        return int(self.bos)


#: ESM-2: ``<cls>`` at 0, residues at 1..n, ``<eos>`` at n + 1; trained on 1022 residues.
ESM2_LAYOUT = TokenLayout(bos=True, eos=True, window=1022)


@dataclass
class ForwardOutput:
    """Hidden states of the requested layers, (B, T, D), plus per-record max |activation|."""

    hidden: dict[int, torch.Tensor]
    max_abs: torch.Tensor  # (B,) float32: largest |x| over the record's own tokens, all layers seen


class Runner(Protocol):
    """A model prepared for one policy on one device.

    A runner may also offer ``packed(batch: PackedTokens, layers) -> ForwardOutput`` for the
    packed layout (:mod:`embedpipe.runtime.packed`; hidden states (N, D)); the worker uses padded
    batches with runners that do not.
    """

    def __call__(self, tokens: torch.Tensor, layers: list[int]) -> ForwardOutput:
        """Hidden states of ``layers`` (0 = token embedding) for a batch from ``tokenize``."""
        ...


class EmbeddingModel(Protocol):
    """A loaded model, fp32 on the CPU, with where it came from.

    Token layout (the worker pools on it): ``tokenize`` returns (B, 2 + longest) int64 on the
    CPU, BOS at position 0, residues at 1..n, EOS at n + 1, then padding.
    """

    name: str  # registered name, or the checkpoint file's stem for a path
    source: str  # resolved checkpoint path
    sha256: str  # of the checkpoint file's bytes
    trained: bool  # False for random-weight test models (never present them as real)
    num_layers: int
    embed_dim: int
    trained_window: int  # residues per forward window the model was trained on
    provenance: Mapping[str, str]  # family-specific store attributes (e.g. fair_esm_version)

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

    ``abs`` then ``amax`` over the feature dim, then a tiny (B, T) mask: on CPU this beats the
    one-kernel ``vector_norm(ord=inf)`` by far (docs/benchmarks.md, "What the speed comes from").
    """
    per_token = x.detach().abs().amax(dim=-1).float()
    return per_token.masked_fill(~keep, 0.0).amax(dim=1)
