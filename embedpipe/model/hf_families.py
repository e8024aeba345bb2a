"""What embedpipe knows about each Hugging Face ``model_type`` before loading it: one
:class:`HfFamily` per type, declared by the family's own torch-free spec module.

Why a description and not branches: :mod:`embedpipe.model.hf_checkpoint` finds, describes and
identifies every Hugging Face directory the same way and asks the family only what differs (its
family name, config bounds, trained window, token layout, identity files, forward version, the
module that loads it). Adding a family is one spec module plus one entry in
:data:`embedpipe.model.hf_checkpoint.FAMILIES` (docs/architecture.md, "Where a change starts").
Torch-free: the workflow describes specs while Snakemake parses its rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedpipe.model.capabilities import batch_layouts
from embedpipe.model.layout import TokenLayout

#: config.json key of the untrained marker written by make-test-model.
MARKER_KEY = "embedpipe"


def is_trained(config: Mapping[str, Any]) -> bool:
    """False when make-test-model's marker says so (anything but ``trained: true`` in it)."""
    marker = config.get(MARKER_KEY)
    return marker is None or (isinstance(marker, Mapping) and marker.get("trained") is True)


def marked_family(config: Mapping[str, Any], choices: tuple[str, ...]) -> str | None:
    """The family make-test-model's marker names, when it is one of ``choices``."""
    marker = config.get(MARKER_KEY)
    if isinstance(marker, Mapping) and marker.get("family") in choices:
        return str(marker["family"])
    return None


@dataclass(frozen=True)
class HfFamily:
    """One ``model_type``: how embedpipe describes, identifies and loads its directories."""

    model_type: str  # config.json's ``model_type``
    label: str  # the models it covers, as the refusal of an unknown type lists them
    module: str  # defines ``load_directory(spec, directory, config) -> EmbeddingModel``
    #: (spec, directory, config) -> the store's ``model_family`` (esm2, prot-t5, ankh, ...)
    family_name: Callable[[str, Path, Mapping[str, Any]], str]
    #: (config, where) -> bounded sizes with ``num_layers``, ``embed_dim``, ``attention_heads``
    sizes: Callable[[Mapping[str, Any], str], Mapping[str, Any]]
    #: config (None: a hub name not cached yet) -> residues per trained forward window
    window: Callable[[Mapping[str, Any] | None], int]
    #: config (None: not cached yet) -> the special tokens around the residues
    layout: Callable[[Mapping[str, Any] | None], TokenLayout]
    #: (directory, config) -> files besides the weights whose bytes decide the numbers
    identity_files: Callable[[Path, Mapping[str, Any]], list[str]]
    version: Callable[[], int]  # the forward's version, read at call time (the one place it is set)
    packs: bool  # whether its runner takes packed batches (a store's identity records it)
    hub_names: Mapping[str, str] = field(default_factory=dict)  # known hub name -> family name
    #: for a family that shares its ``model_type`` with another (listed in
    #: :data:`embedpipe.model.hf_checkpoint.VARIANTS`): whether (directory, config) is this
    #: family's (Hugging Face's ``esm`` covers ESM-2, rotary; ESM-1b/1v, absolute positions;
    #: SaProt, a vocabulary of amino-acid x 3Di pairs)
    takes: Callable[[Path, Mapping[str, Any]], bool] | None = None
    #: family name -> its layout where it is not ``layout``'s (one type, several families: ProstT5)
    family_layouts: Mapping[str, TokenLayout] = field(default_factory=dict)

    @property
    def batch_layouts(self) -> tuple[str, ...]:
        """What its loaded models declare (:func:`~embedpipe.model.capabilities.batch_layouts`)."""
        return batch_layouts(self.packs)

    def layout_of(self, family: str, config: Mapping[str, Any] | None) -> TokenLayout:
        """The token layout of ``family`` (a family name of this type)."""
        return self.family_layouts.get(family) or self.layout(config)
