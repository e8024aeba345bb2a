"""T5 protein tokenizers (ProtT5, Ankh) as a residue -> token-id table, without sentencepiece.

Both tokenizers give one token per residue plus one ``</s>``, so embedpipe maps residues
through the vocabulary directly (torch-free):

* **ProtT5** (ProtTrans' ``prott5_embedder.py``): rare residues U, Z, O, B become X; the
  residues are space-separated, so each is a word and its piece is ``"▁" + residue``.
* **Ankh**: per-character tokens without spaces (the recipe's ``is_split_into_words``), the
  piece is the residue itself.

The vocabulary comes from ``tokenizer.json`` (read as JSON) when the directory has one; a
directory with only ``spiece.model`` is read through transformers' tokenizer (which needs
sentencepiece: the ``hf`` extra). tests/model/test_t5.py checks the ids against transformers'.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from embedpipe.core.errors import ModelError
from embedpipe.core.jsonbounds import load_bounded_json
from embedpipe.model.optional import require

#: Residues one T5 forward window takes (docs/models.md, "Limits"). T5 has no hard window
#: (relative position buckets), but attention memory is quadratic: the score matrix of one
#: record is heads x L^2 x 4 bytes per layer, 2.1 GiB for ProtT5-XL (32 heads) at 4096.
T5_MAX_RESIDUES = 4096

#: the version of the T5 encoder's forward (t5_forward.py) and of these tokens, in every store's
#: identity: bump it when a change moves the numbers (docs/cluster.md, "Resuming, rerunning")
FAMILY_VERSION = 1

#: Letters embedpipe lets through (embedpipe.inputs.residue_rules); any other maps to <unk>.
LETTERS = "ACDEFGHIKLMNPQRSTVWYXBUZO"
#: ProtT5's recipe: ``re.sub(r"[UZOB]", "X", sequence)``.
PROT_T5_RARE = "UZOB"
STYLES = ("prot-t5", "ankh")


def read_vocabulary(directory: Path) -> dict[str, int]:
    """piece -> id of the directory's tokenizer (model vocabulary and added tokens)."""
    path = directory / "tokenizer.json"
    if path.is_file():
        try:
            data = load_bounded_json(path.read_text(), str(path), ModelError)
            model = data["model"]
            vocab = model["vocab"]
            pieces = ({p[0]: i for i, p in enumerate(vocab)} if isinstance(vocab, list)
                      else {str(k): int(v) for k, v in vocab.items()})
            pieces.update({t["content"]: int(t["id"]) for t in data.get("added_tokens") or []})
            return pieces
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ModelError(f"{path} is not a tokenizer file transformers writes ({type(exc).__name__}: {exc})") from None
    if (directory / "spiece.model").is_file():
        transformers = require("transformers", f"reading {directory / 'spiece.model'} (a directory without tokenizer.json)")
        try:
            return dict(transformers.AutoTokenizer.from_pretrained(str(directory)).get_vocab())
        except (ImportError, ValueError, OSError) as exc:
            raise ModelError(f"cannot read the tokenizer of {directory}: {' '.join(str(exc).split())[:200]} "
                             "(spiece.model needs: pip install sentencepiece)") from None
    raise ModelError(f"{directory} has no tokenizer (tokenizer.json or spiece.model)")


def tokenization_style(directory: Path) -> str:
    """``prot-t5`` when the vocabulary holds ``▁A`` (space-separated residues), ``ankh`` when it
    holds ``A`` (per-character); anything else is not a protein T5 tokenizer."""
    vocab = read_vocabulary(directory)
    if "▁A" in vocab:
        return "prot-t5"
    if "A" in vocab:
        return "ankh"
    raise ModelError(f"{directory}: the tokenizer has neither '▁A' (ProtT5) nor 'A' (Ankh): not a protein T5 model")


def residue_table(vocab: dict[str, int], style: str, *, where: str) -> tuple[np.ndarray, int, int]:
    """(ASCII byte -> token id, ``</s>`` id, ``<pad>`` id) for ``style``."""
    missing = [t for t in ("</s>", "<pad>", "<unk>") if t not in vocab]
    if missing:
        raise ModelError(f"{where}: the tokenizer lacks {', '.join(missing)}")
    lut = np.full(256, vocab["<unk>"], dtype=np.int64)
    for letter in LETTERS:
        if style == "prot-t5":
            piece = "▁" + ("X" if letter in PROT_T5_RARE else letter)
        else:
            piece = letter
        lut[ord(letter)] = vocab.get(piece, vocab["<unk>"])
    return lut, vocab["</s>"], vocab["<pad>"]


def tokenize(sequences: list[str], lut: np.ndarray, eos: int, pad: int) -> np.ndarray:
    """(B, 1 + longest) int64: residues at 0..n-1, ``</s>`` at n, then ``<pad>`` (no BOS)."""
    width = max(len(seq) for seq in sequences) + 1
    tokens = np.full((len(sequences), width), pad, dtype=np.int64)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = lut[np.frombuffer(seq.encode("ascii"), dtype=np.uint8)]
        tokens[row, len(seq)] = eos
    return tokens
