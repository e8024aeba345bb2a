"""SaProt's names, vocabulary and token layout: what is known without torch or weights.

SaProt (westlake-repl) is an ESM-2 whose tokens are amino-acid x Foldseek-3Di pairs: a
``model_type: esm`` directory told apart from ESM-2 by its ``vocab.txt`` (pair tokens such as
``Ap``). Its input is a structure-aware sequence, two characters a residue (``MdEvVp``: upper
case the amino acid, lower case its 3Di state, ``#`` a masked one), so its layout says
``chars_per_residue=2`` and keeps case (its row of :data:`embedpipe.model.families.FAMILY_TABLE`).
It runs on ESM-2's forward (:mod:`embedpipe.model.saprot`).

Its tokens are SaProt's own (westlake-repl/SaProt ``utils/esm_loader.py``, ``load_esm_saprot``;
``utils/constants.py``): ``<cls> <pad> <eos> <unk> <mask>``, then every amino acid of
``foldseek_seq_vocab`` with every 3Di state of ``foldseek_struc_vocab`` (amino acid outer), 446
in all. A directory's ``vocab.txt`` is read as transformers' ``EsmTokenizer`` reads it (a token a
line, its id the line's index): the directory is SaProt's when the file holds that set of tokens,
in whatever order, and every id comes from the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embedpipe.model import esm2_spec
from embedpipe.model.config_bounds import esm_config
from embedpipe.model.hf_families import HfFamily

#: SaProt's ``foldseek_seq_vocab`` and ``foldseek_struc_vocab``, in its order (``#``: masked)
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY#"
THREE_DI = "pynwrqhgdlvtmfsaeikc#"

#: a vocab.txt larger than this is not read (SaProt's is about 1.5 KB)
MAX_VOCAB_BYTES = 1 << 20

#: the special tokens ``load_esm_saprot`` puts before the pairs, in its order
SPECIALS = ("<cls>", "<pad>", "<eos>", "<unk>", "<mask>")

#: SaProt's esm-format ``.pt``: ``{"model": ESM2 state dict, "config": {these keys}}``
CONFIG_KEYS = ("num_layers", "embed_dim", "attention_heads", "token_dropout")


def vocabulary() -> list[str]:
    """SaProt's 446 tokens in its order (``load_esm_saprot``'s): the specials, then every pair."""
    return [*SPECIALS, *(a + s for a in AMINO_ACIDS for s in THREE_DI)]


#: how many tokens SaProt has (its embedding's rows)
VOCABULARY_SIZE = len(vocabulary())


def parameter_count(layers: int, dim: int, heads: int) -> int:
    """Parameters of fair-esm's ``ESM2`` over SaProt's tokens: ESM-2's, with 446 embedding rows
    and LM-head biases instead of 33."""
    return esm2_spec.parameter_count(layers, dim, heads) + (VOCABULARY_SIZE - esm2_spec.VOCABULARY_SIZE) * (dim + 1)


def read_vocabulary(vocab: Path) -> list[str]:
    """``vocab.txt``'s tokens as transformers' ``EsmTokenizer`` reads them: one a line, stripped,
    the id of a token its line's index; a file over :data:`MAX_VOCAB_BYTES` holds none (it is not
    SaProt's); ``OSError`` when it cannot be read."""
    if vocab.stat().st_size > MAX_VOCAB_BYTES:
        return []
    return [line.strip() for line in vocab.read_text(encoding="utf-8", errors="replace").splitlines()]


def vocabulary_problem(tokens: list[str]) -> str | None:
    """Why ``tokens`` (a vocab.txt's, in its order) are not SaProt's set: what is missing, extra,
    or on two lines; None when they are SaProt's 446 tokens in any order."""
    want = set(vocabulary())
    seen: dict[str, int] = {}
    for line, token in enumerate(tokens, 1):
        if token in seen:
            return f"{token!r} is on lines {seen[token]} and {line}"
        seen[token] = line
    missing = [t for t in vocabulary() if t not in seen]
    extra = [t for t in tokens if t not in want]
    if not missing and not extra:
        return None

    def listed(names: list[str]) -> str:  # a line of the file may be long: each shown to 20 characters
        shown = [repr(n if len(n) <= 20 else n[:20] + "...") for n in names[:6]]
        return ", ".join(shown) + (f" and {len(names) - 6} more" if len(names) > 6 else "")

    return "; ".join(([f"missing {listed(missing)}"] if missing else []) + ([f"extra {listed(extra)}"] if extra else []))


def is_pt_layout(data: Mapping[str, Any]) -> bool:
    """Whether a loaded checkpoint is in SaProt's esm-format layout: ``config``, none of fair-esm's
    ``cfg`` (ESM-2) or ``args`` (ESM-1b)."""
    return "config" in data and "cfg" not in data and "args" not in data


def is_pair(token: str) -> bool:
    """Whether ``token`` is an amino-acid x 3Di pair (``Ap``, ``A#``, ``#p``)."""
    return len(token) == 2 and token[0] in AMINO_ACIDS and token[1] in THREE_DI


def has_pair_vocabulary(directory: Path) -> bool:
    """Whether ``directory``'s ``vocab.txt`` holds pair tokens (SaProt's, not ESM-2's letters)."""
    vocab = directory / "vocab.txt"
    try:
        return vocab.is_file() and any(is_pair(token) for token in read_vocabulary(vocab))
    except OSError:
        return False


def is_hf_saprot(directory: Path, config: Mapping[str, Any]) -> bool:
    """Whether a ``model_type: esm`` directory is SaProt's: its vocabulary holds pair tokens."""
    return has_pair_vocabulary(directory)


#: ``model_type: esm`` directories whose ``vocab.txt`` holds amino-acid x 3Di pairs, loaded into
#: the ESM-2 runner over SaProt's alphabet by :mod:`embedpipe.model.saprot`
HF_SAPROT = HfFamily(model_type="esm", label="SaProt", sizes=esm_config, identity_files=esm2_spec.hf_identity_files,
                     takes=is_hf_saprot)
