"""ProtT5, ProstT5 and Ankh as a Hugging Face family (``model_type: t5``): what is known without torch.

The loader is :mod:`embedpipe.model.t5`; this module is the :class:`HfFamily` entry
:mod:`embedpipe.model.hf_checkpoint` describes and identifies a T5 directory with.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embedpipe.model import t5_vocab
from embedpipe.model.config_bounds import t5_config
from embedpipe.model.hf_families import HfFamily, marked_family
from embedpipe.model.layout import TokenLayout

#: T5 encoders (ProtT5, Ankh): no BOS, one ``</s>`` after the residues, no hard window.
T5_LAYOUT = TokenLayout(bos=False, eos=True, window=None)

#: ProstT5: its direction prefix (``<AA2fold>`` or ``<fold2AA>``, chosen by the record's case)
#: at 0 in BOS's place, residues at 1..n, ``</s>`` at n + 1; case kept (docs/models.md, "ProstT5").
PROSTT5_LAYOUT = TokenLayout(bos=True, eos=True, window=None, keeps_case=True)

#: Hub names embedpipe knows, with their family (others load too once they are cached).
HUB_NAMES = {
    "Rostlab/prot_t5_xl_uniref50": "prot-t5",
    "Rostlab/prot_t5_xl_half_uniref50-enc": "prot-t5",
    "Rostlab/prot_t5_xl_bfd": "prot-t5",
    "Rostlab/ProstT5": "prostt5",
    "Rostlab/ProstT5_fp16": "prostt5",
    "ElnaggarLab/ankh-base": "ankh",
    "ElnaggarLab/ankh-large": "ankh",
}

#: what decides a T5 directory's tokens besides tokenizer.json: the files transformers' tokenizer
#: reads when only spiece.model is there (embedpipe.model.t5_vocab.read_vocabulary)
SPIECE_FILES = ("spiece.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


#: the family names of this type whose token layout is not :data:`T5_LAYOUT`: ProstT5's direction
#: prefix stands where a BOS would, and its case is input (upper: amino acids, lower: 3Di)
FAMILY_LAYOUTS: dict[str, TokenLayout] = {"prostt5": PROSTT5_LAYOUT}


def layout_of_family(family: str) -> TokenLayout:
    """The token layout of T5 family ``family`` (``prot-t5``, ``prostt5``, ``ankh``)."""
    return FAMILY_LAYOUTS.get(family, T5_LAYOUT)


def family_name(spec: str, directory: Path, config: Mapping[str, Any]) -> str:
    """``prot-t5``, ``prostt5`` or ``ankh``: make-test-model's marker, then the hub name, then the vocabulary."""
    marked = marked_family(config, t5_vocab.STYLES)
    if marked is not None:
        return marked
    if spec in HUB_NAMES:
        return HUB_NAMES[spec]
    return t5_vocab.tokenization_style(directory)


def sizes(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """T5's bounded sizes (:func:`~embedpipe.model.config_bounds.t5_config`) under the common names."""
    bounded = t5_config(config, where)
    return bounded | {"embed_dim": bounded["d_model"], "attention_heads": bounded["num_heads"]}


def identity_files(directory: Path, config: Mapping[str, Any]) -> list[str]:
    """``config.json`` and ``tokenizer.json`` (else the files ``spiece.model`` is read with)."""
    return ["config.json", *(("tokenizer.json",) if (directory / "tokenizer.json").is_file() else SPIECE_FILES)]


HF_T5 = HfFamily(
    model_type="t5", label="ProtT5, ProstT5, Ankh", module="embedpipe.model.t5", family_name=family_name, sizes=sizes,
    window=lambda config: t5_vocab.T5_MAX_RESIDUES, layout=lambda config: T5_LAYOUT,
    identity_files=identity_files, version=lambda: t5_vocab.FAMILY_VERSION, packs=False, hub_names=HUB_NAMES,
    family_layouts=FAMILY_LAYOUTS,
)
