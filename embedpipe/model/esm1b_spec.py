"""ESM-1b and ESM-1v's names, shapes, trained window and sizes: what is known without torch or weights.

fair-esm's earlier families (``esm1b_t33_650M_UR50S`` and the five ``esm1v_t33_650M_UR90S_N``)
share ESM-2's alphabet, token layout and transformer layers; they differ in learned absolute
positions (1024 tokens: a 1022-residue window), a layer norm before the first layer and no
rotary embeddings. They run on ESM-2's forward (:mod:`embedpipe.model.esm2_forward`) with
those differences as parameters; :mod:`embedpipe.model.esm1b` builds them from a fair-esm
checkpoint, :mod:`embedpipe.model.hf_esm` from a Hugging Face directory. What they can do (packs,
BOS, layout, window as released) is their row's of :data:`embedpipe.model.families.FAMILY_TABLE`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embedpipe.core.errors import ModelError
from embedpipe.model.config_bounds import esm_config
from embedpipe.model.esm2_spec import hf_identity_files
from embedpipe.model.esm2_spec import parameter_count as esm2_count
from embedpipe.model.hf_families import HfFamily

#: the version of ESM-1b's forward and tokens, in every store's identity (``esm1b v1``):
#: bump it when a change moves the numbers (docs/cluster.md, "Resuming, rerunning")
FAMILY_VERSION = 1

#: fair-esm ESM-1b / ESM-1v names -> (layers, embedding dim, attention heads).
ESM1B_MODELS: dict[str, tuple[int, int, int]] = {
    "esm1b_t33_650M_UR50S": (33, 1280, 20),
    **{f"esm1v_t33_650M_UR90S_{i}": (33, 1280, 20) for i in range(1, 6)},
}

#: learned positions of the released models: 1024 tokens, 1022 residues plus BOS and EOS
MAX_POSITIONS = 1024

#: fair-esm's padding index (the position table has ``padding_idx + 1`` rows before position 1)
PADDING_IDX = 1


def has_contact_regression(name: str) -> bool:
    """fair-esm publishes no contact-regression file for ESM-1v (its ``_has_regression_weights``)."""
    return not name.startswith("esm1v")


def window(max_positions: int) -> int:
    """Residues one forward pass takes: the learned positions less BOS and EOS."""
    return max_positions - 2


def parameter_count(layers: int, dim: int, heads: int, max_positions: int = MAX_POSITIONS) -> int:
    """Parameters of fair-esm's ESM-1b ``ProteinBertModel``: ESM-2's (the same layers, heads and
    outside parts; :func:`embedpipe.model.esm2_spec.parameter_count`) plus the learned position
    table and the layer norm before the first layer."""
    return esm2_count(layers, dim, heads) + (max_positions + PADDING_IDX + 1) * dim + 2 * dim


def name_sizes(spec: str) -> tuple[tuple[int, int, int], int]:
    """A registered name's (layers, dim, heads) and parameter count, from the name table."""
    shape = ESM1B_MODELS[spec]
    return shape, parameter_count(*shape)


# --------------------------------------------------------------------------- Hugging Face ESM-1b


def is_hf_esm1b(directory: Path, config: Mapping[str, Any]) -> bool:
    """Whether a ``model_type: esm`` config is an ESM-1b / ESM-1v (absolute positions, transformers'
    default) rather than an ESM-2 (rotary)."""
    return config.get("position_embedding_type", "absolute") == "absolute"


def is_pt_layout(data: Mapping[str, Any]) -> bool:
    """Whether a loaded fair-esm checkpoint is in ESM-1b's layout (``args``, no ``cfg``): ESM-1b
    and ESM-1v (:mod:`embedpipe.model.esm1b`)."""
    return "args" in data and "cfg" not in data


def hf_max_positions(config: Mapping[str, Any]) -> int:
    """fair-esm's ``max_positions`` of a Hugging Face config: its position table less the
    ``pad_token_id + 1`` rows before position 1 (1026 -> 1024)."""
    return int(config.get("max_position_embeddings", 1026)) - PADDING_IDX - 1


def _hf_sizes(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """:func:`esm_config`'s bounds, and a position table with room for BOS, a residue and EOS."""
    sizes = esm_config(config, where)
    if hf_max_positions(config) < 3:
        raise ModelError(f"{where}: max_position_embeddings must be at least {PADDING_IDX + 4} for an ESM-1b "
                         f"(pad_token_id + 1 rows before the first position, then BOS, a residue and EOS), "
                         f"got {config.get('max_position_embeddings')}")
    return sizes


def hf_window(config: Mapping[str, Any]) -> int:
    """The window a Hugging Face config's position table allows."""
    return window(hf_max_positions(config))


#: ``model_type: esm`` directories with absolute positions (``facebook/esm1b_t33_650M_UR50S``,
#: ``facebook/esm1v_*``), loaded into the ESM-1b runner by :mod:`embedpipe.model.hf_esm`
HF_ESM1B = HfFamily(model_type="esm", label="ESM-1b/ESM-1v", sizes=_hf_sizes, identity_files=hf_identity_files,
                    window=hf_window, takes=is_hf_esm1b)
