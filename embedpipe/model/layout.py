"""The token layout a model family declares: its special tokens around the residues.

Torch-free (the workflow and ``embedpipe shard`` read it from :func:`embedpipe.model.describe`).
Everything outside ``model/`` that counts tokens or finds residue rows asks the family's
layout: shard token budgets (:mod:`embedpipe.shard.passes`), batch planning
(:class:`embedpipe.extraction.planning.Piece`) and pooling (:mod:`embedpipe.extraction.pooling`), as fair-esm's
``Alphabet`` lets ``prepend_bos``/``append_eos`` drive its batch converter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenLayout:
    """Where a family puts its special tokens around the residues of one forward window.

    ``bos``: one token before the residues (ESM-2's ``<cls>``, ProstT5's direction prefix);
    ``eos``: one after them; ``window``: the most residues one forward pass takes by
    construction (``None``: no hard window; the family's ``trained_window`` is then its
    practical limit, docs/models.md). ``keeps_case``: the family reads upper and lower case as
    different inputs (ProstT5: amino acids and 3Di), so the FASTA reader keeps each record's
    case instead of upper-casing it (:class:`embedpipe.core.options.FastaLimits`).
    ``chars_per_residue``: characters of the input (and of the stored ``sequence``) one residue
    takes (SaProt: 2, an amino acid and its 3Di state); a record's length, its windows and its
    per-residue rows count residues (:meth:`residues`).
    """

    bos: bool
    eos: bool
    window: int | None
    keeps_case: bool = False
    chars_per_residue: int = 1

    def residues(self, sequence: str) -> int:
        """Residues of ``sequence`` (its characters over ``chars_per_residue``)."""
        return len(sequence) // self.chars_per_residue

    def residue_slice(self, sequence: str, start: int, end: int) -> str:
        """The characters of residues ``start:end`` of ``sequence``."""
        return sequence[start * self.chars_per_residue : end * self.chars_per_residue]

    @property
    def extra_tokens(self) -> int:
        """Tokens a record (or a window of one) carries besides its residues (ESM-2: 2, T5: 1)."""
        return int(self.bos) + int(self.eos)

    @property
    def first_residue(self) -> int:
        """Position of the first residue in a tokenized row."""
        return int(self.bos)

    def to_dict(self) -> dict[str, Any]:
        """The layout as JSON (``model-info``); ``keeps_case`` and ``chars_per_residue`` only where they differ."""
        return ({"bos": self.bos, "eos": self.eos, "window": self.window} | ({"keeps_case": True} if self.keeps_case else {})
                | ({"chars_per_residue": self.chars_per_residue} if self.chars_per_residue != 1 else {}))


#: ESM-2: ``<cls>`` at 0, residues at 1..n, ``<eos>`` at n + 1; trained on 1022 residues. The
#: layout of a family that declares none, and of ``embedpipe shard`` without ``--model``.
ESM2_LAYOUT = TokenLayout(bos=True, eos=True, window=1022)


def layout_of(model: object) -> TokenLayout:
    """A loaded model's (or its facts') declared layout; ESM-2's when it declares none."""
    layout = getattr(model, "token_layout", None)
    return layout if isinstance(layout, TokenLayout) else ESM2_LAYOUT
