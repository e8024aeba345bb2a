"""SaProt's names, vocabulary and token layout: what is known without torch or weights.

SaProt (westlake-repl) is an ESM-2 whose tokens are amino-acid x Foldseek-3Di pairs: a
``model_type: esm`` directory told apart from ESM-2 by its ``vocab.txt`` (pair tokens such as
``Ap``). Its input is a structure-aware sequence, two characters a residue (``MdEvVp``: upper
case the amino acid, lower case its 3Di state, ``#`` a masked one), so its layout says
``chars_per_residue=2`` and keeps case. It runs on ESM-2's forward (:mod:`embedpipe.model.saprot`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embedpipe.model import esm2_spec
from embedpipe.model.config_bounds import esm_config
from embedpipe.model.hf_families import HfFamily
from embedpipe.model.layout import TokenLayout

FAMILY = "saprot"

#: SaProt runs on ESM-2's forward (its version) and packs as ESM-2 does
PACKS = esm2_spec.PACKS

#: SaProt's ``foldseek_seq_vocab`` and ``foldseek_struc_vocab``, in its order (``#``: masked)
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY#"
THREE_DI = "pynwrqhgdlvtmfsaeikc#"

#: <cls> at 0, two characters a residue, <eos>; trained on 1024 tokens as ESM-2
LAYOUT = TokenLayout(bos=True, eos=True, window=1022, keeps_case=True, chars_per_residue=2)

#: hub names of the released checkpoints
HUB_NAMES = ("westlake-repl/SaProt_650M_AF2", "westlake-repl/SaProt_35M_AF2", "westlake-repl/SaProt_650M_PDB")

#: a vocab.txt larger than this is not read for recognition (SaProt's is about 1.5 KB)
MAX_VOCAB_BYTES = 1 << 20


def vocabulary() -> list[str]:
    """SaProt's 446 tokens in ``vocab.txt`` order: the specials, every pair, ``<mask>``."""
    return ["<cls>", "<pad>", "<eos>", "<unk>", *(a + s for a in AMINO_ACIDS for s in THREE_DI), "<mask>"]


def is_pair(token: str) -> bool:
    """Whether ``token`` is an amino-acid x 3Di pair (``Ap``, ``A#``, ``#p``)."""
    return len(token) == 2 and token[0] in AMINO_ACIDS and token[1] in THREE_DI


def has_pair_vocabulary(directory: Path) -> bool:
    """Whether ``directory``'s ``vocab.txt`` holds pair tokens (SaProt's, not ESM-2's letters)."""
    vocab = directory / "vocab.txt"
    try:
        if not vocab.is_file() or vocab.stat().st_size > MAX_VOCAB_BYTES:
            return False
        return any(is_pair(token) for token in vocab.read_text(errors="replace").split())
    except OSError:
        return False


def is_hf_saprot(directory: Path, config: Mapping[str, Any]) -> bool:
    """Whether a ``model_type: esm`` directory is SaProt's: its vocabulary holds pair tokens."""
    return has_pair_vocabulary(directory)


#: ``model_type: esm`` directories whose ``vocab.txt`` holds amino-acid x 3Di pairs, loaded into
#: the ESM-2 runner over SaProt's alphabet by :mod:`embedpipe.model.hf_esm`
HF_SAPROT = HfFamily(
    model_type="esm", label="SaProt", module="embedpipe.model.hf_esm",
    family_name=lambda spec, directory, config: FAMILY, sizes=esm_config,
    window=lambda config: esm2_spec.TRAINED_RESIDUES, layout=lambda config: LAYOUT,
    identity_files=esm2_spec.hf_identity_files, version=lambda: esm2_spec.FAMILY_VERSION, packs=PACKS,
    hub_names={name: FAMILY for name in HUB_NAMES}, takes=is_hf_saprot,
)
