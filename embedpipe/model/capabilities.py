"""What a loaded model's family can do, asked by the worker before it plans a batch.

Torch-free. Every family declares ``token_layout`` (:mod:`embedpipe.model.layout`),
``family`` and ``batch_layouts`` (``("padded",)`` without a packed runner: T5), as
:class:`~embedpipe.model.base.EmbeddingModel` requires; nothing is assumed for a family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from embedpipe.core.errors import EmbedpipeError
from embedpipe.model.layout import layout_of

if TYPE_CHECKING:  # torch-free at run time
    from embedpipe.model.base import EmbeddingModel


def packs(model: EmbeddingModel) -> bool:
    """Whether the family prepares a :class:`~embedpipe.model.base.PackedRunner`."""
    return "packed" in model.batch_layouts


def check_options(model: EmbeddingModel, pooling: Sequence[str], batch_layout: str) -> None:
    """One-line refusals of what the family cannot do: ``bos`` pooling without a BOS token,
    ``--batch-layout packed`` without a packed runner."""
    family = model.family
    if "bos" in pooling and not layout_of(model).bos:
        raise EmbedpipeError(f"--pooling bos: the {family} family has no BOS token (its token layout puts none "
                             "before the residues); store the mean or per-residue vectors")
    if batch_layout == "packed" and not packs(model):
        raise EmbedpipeError(f"--batch-layout packed: the {family} family runs padded batches only; "
                             "use --batch-layout padded or auto")
