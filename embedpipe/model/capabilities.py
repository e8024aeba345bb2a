"""What a model's family can do, asked by the worker before it plans a batch and by the
workflow before any job.

Torch-free. A family's capabilities (whether it packs, its token layout with BOS and window)
are declared once, by its row of :data:`embedpipe.model.families.FAMILY_TABLE` (a plugin's, by its
``describe``): its :class:`~embedpipe.model.facts.ModelFacts` and its loaded model (``token_layout``,
``family``, ``trained_window``, ``batch_layouts``, as :class:`~embedpipe.model.base.EmbeddingModel`
requires) both take them from the row's :class:`Capabilities`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedpipe.core.errors import EmbedpipeError
from embedpipe.model.layout import TokenLayout, layout_of

if TYPE_CHECKING:  # torch-free at run time
    from embedpipe.model.base import EmbeddingModel


def parameter_count(model: EmbeddingModel) -> int:
    """The model's parameters: its fp32 weights' bytes over 4 (what ``auto``'s table rows record
    as the model size they were measured at)."""
    from embedpipe.runtime.precision import POLICIES  # torch-free at import: only when asked

    return int(model.estimate_memory(POLICIES["fp32"]).weight_bytes) // 4


def packs(model: EmbeddingModel) -> bool:
    """Whether the family prepares a :class:`~embedpipe.model.base.PackedRunner`."""
    return "packed" in model.batch_layouts


def batch_layouts(packs_batches: bool) -> tuple[str, ...]:
    """A loaded model's ``batch_layouts`` from its row's ``packs`` (the one declaration)."""
    return ("packed", "padded") if packs_batches else ("padded",)


@dataclass(frozen=True)
class Capabilities:
    """What one model of a family can do, from its row (with the window its own config sets)."""

    family: str  # the store's model_family
    token_layout: TokenLayout
    trained_window: int  # residues per trained forward window
    packs: bool  # whether its runner takes packed batches

    def model_fields(self) -> dict[str, Any]:
        """The loaded model's fields (:class:`~embedpipe.model.base.EmbeddingModel`'s ``family``,
        ``token_layout``, ``trained_window``, ``batch_layouts``)."""
        return {"family": self.family, "token_layout": self.token_layout, "trained_window": self.trained_window,
                "batch_layouts": batch_layouts(self.packs)}

    def facts_fields(self) -> dict[str, Any]:
        """The :class:`~embedpipe.model.facts.ModelFacts` fields they set."""
        return {"family": self.family, "token_layout": self.token_layout, "trained_window": self.trained_window,
                "packs": self.packs}


def check_family(family: str, bos: bool, packs_batches: bool | None, pooling: Sequence[str], batch_layout: str) -> None:
    """One-line refusals of what the family cannot do: ``bos`` pooling without a BOS token,
    the batch layout ``packed`` (an ``EMBEDPIPE_ENGINE`` override) without a packed runner
    (``packs_batches`` None: not known yet)."""
    if "bos" in pooling and not bos:
        raise EmbedpipeError(f"--pooling bos: the {family} family has no BOS token (its token layout puts none "
                             "before the residues); store the mean or per-residue vectors")
    if batch_layout == "packed" and packs_batches is False:
        raise EmbedpipeError(f"EMBEDPIPE_ENGINE batch_layout=packed: the {family} family runs padded batches only; "
                             "leave the batch layout to the run")


def check_options(model: EmbeddingModel, pooling: Sequence[str], batch_layout: str) -> None:
    """:func:`check_family` for a loaded model (what its family declares)."""
    check_family(model.family, layout_of(model).bos, packs(model), pooling, batch_layout)
