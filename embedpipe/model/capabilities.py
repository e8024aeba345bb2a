"""What a loaded model's family can do, asked by the worker before it plans a batch.

Torch-free. A family declares ``token_layout`` (:mod:`embedpipe.model.layout`) and, when it
has no packed runner, ``batch_layouts = ("padded",)`` (T5); a family that declares neither
is taken to be ESM-2-like (both layouts, BOS and EOS).
"""

from __future__ import annotations

from collections.abc import Sequence

from embedpipe.core.errors import EmbedpipeError
from embedpipe.model.layout import layout_of


def packs(model: object) -> bool:
    """Whether the family offers a packed runner (``runner.packed``)."""
    return "packed" in getattr(model, "batch_layouts", ("packed", "padded"))


def check_options(model: object, pooling: Sequence[str], batch_layout: str) -> None:
    """One-line refusals of what the family cannot do: ``bos`` pooling without a BOS token,
    ``--batch-layout packed`` without a packed runner."""
    family = getattr(model, "family", getattr(model, "name", "?"))
    if "bos" in pooling and not layout_of(model).bos:
        raise EmbedpipeError(f"--pooling bos: the {family} family has no BOS token (its token layout puts none "
                             "before the residues); store the mean or per-residue vectors")
    if batch_layout == "packed" and not packs(model):
        raise EmbedpipeError(f"--batch-layout packed: the {family} family runs padded batches only; "
                             "use --batch-layout padded or auto")
