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


#: families that run padded batches only, known by name from their facts (torch-free): the
#: workflow refuses ``batch_layout: packed`` for them before any job (embedpipe.embed.combinations);
#: their loaded models declare the same ``batch_layouts`` (tests/model/test_capabilities.py)
PADDED_ONLY_FAMILIES = frozenset({"prot-t5", "ankh"})
#: families whose every model packs (ESM-2 and ESM-1b: fair-esm checkpoints and Hugging Face directories)
PACKING_FAMILIES = frozenset({"esm2", "esm1b"})


def packs_by_family(family: str) -> bool | None:
    """Whether the family packs, from its name alone; None for a family not listed here (its
    loaded model says, when the job runs)."""
    if family in PADDED_ONLY_FAMILIES:
        return False
    return True if family in PACKING_FAMILIES else None


def check_family(family: str, bos: bool, packs_batches: bool | None, pooling: Sequence[str], batch_layout: str) -> None:
    """One-line refusals of what the family cannot do: ``bos`` pooling without a BOS token,
    ``--batch-layout packed`` without a packed runner (``packs_batches`` None: not known yet)."""
    if "bos" in pooling and not bos:
        raise EmbedpipeError(f"--pooling bos: the {family} family has no BOS token (its token layout puts none "
                             "before the residues); store the mean or per-residue vectors")
    if batch_layout == "packed" and packs_batches is False:
        raise EmbedpipeError(f"--batch-layout packed: the {family} family runs padded batches only; "
                             "use --batch-layout padded or auto")


def check_options(model: EmbeddingModel, pooling: Sequence[str], batch_layout: str) -> None:
    """:func:`check_family` for a loaded model (what its family declares)."""
    check_family(model.family, layout_of(model).bos, packs(model), pooling, batch_layout)
