"""How embedpipe reads one Hugging Face ``model_type`` (or a variant sharing one) before loading it:
an :class:`HfFamily`, declared by the family's own torch-free spec module and named by its row of
:data:`embedpipe.model.families.FAMILY_TABLE`.

Why a description and not branches: :mod:`embedpipe.model.hf_checkpoint` finds, describes and
identifies every Hugging Face directory the same way and asks the family only what differs (its
config bounds, a window its config sets, identity files, how a variant is told apart). What the
family can do (packs, token layout, window as released, forward version, loader) is its row's.
Torch-free: the workflow describes specs while Snakemake parses its rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    """One ``model_type`` (or a variant of one): how embedpipe bounds, identifies and tells apart its directories."""

    model_type: str  # config.json's ``model_type``
    label: str  # the models it covers, as refusals name them
    #: (config, where) -> bounded sizes with ``num_layers``, ``embed_dim``, ``attention_heads``
    sizes: Callable[[Mapping[str, Any], str], Mapping[str, Any]]
    #: (directory, config) -> files besides the weights whose bytes decide the numbers
    identity_files: Callable[[Path, Mapping[str, Any]], list[str]]
    #: config -> residues per trained window, where the config sets it (ESM-1b's position table,
    #: ESM C's ``max_position_embeddings``); None: the row's window
    window: Callable[[Mapping[str, Any]], int] | None = None
    #: for a variant sharing its ``model_type`` with another row's (Hugging Face's ``esm`` covers
    #: ESM-2, rotary; ESM-1b/1v, absolute positions; SaProt, a vocabulary of amino-acid x 3Di
    #: pairs): whether (directory, config) is this variant's; variants are asked in table order
    takes: Callable[[Path, Mapping[str, Any]], bool] | None = None
    #: for a type several rows share with one loader (``t5``: ProtT5, ProstT5, Ankh): a
    #: directory's tokenization style, which each sharing row's format names (``Format.hf_style``)
    style: Callable[[Path], str] | None = None
