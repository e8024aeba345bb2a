"""T5 protein tokenizers (ProtT5, ProstT5, Ankh) as a residue -> token-id table, without sentencepiece.

Each tokenizer gives one token per residue plus one ``</s>``, so embedpipe maps residues
through the vocabulary directly (torch-free):

* **ProtT5** (ProtTrans' ``prott5_embedder.py``): rare residues U, Z, O, B become X; the
  residues are space-separated, so each is a word and its piece is ``"▁" + residue``.
* **ProstT5** (its model card's recipe): as ProtT5, and lower-case 3Di states are pieces too
  (``"▁" + state``); one direction prefix before the residues, ``<AA2fold>`` for an upper-case
  record (amino acids), ``<fold2AA>`` for a lower-case one (3Di): :func:`direction`.
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

#: the version of the T5 encoder's forward (t5_forward.py) and of these tokens, in every store's
#: identity: bump it when a change moves the numbers (docs/cluster.md, "Resuming, rerunning")
FAMILY_VERSION = 1

#: Letters embedpipe lets through (embedpipe.inputs.residue_rules); any other maps to <unk>.
LETTERS = "ACDEFGHIKLMNPQRSTVWYXBUZO"
#: ProtT5's recipe: ``re.sub(r"[UZOB]", "X", sequence)``.
PROT_T5_RARE = "UZOB"
#: how a protein T5 tokenizer cuts a record into pieces (:func:`tokenization_style`); each T5 row of
#: :data:`embedpipe.model.families.FAMILY_TABLE` names its own: ProtT5 (each residue a word, its piece
#: ``"▁" + residue``), ProstT5 (as ProtT5, with 3Di pieces and direction prefixes), Ankh (per character)
SPACED, SPACED_3DI, PER_CHARACTER = "spaced", "spaced+3di", "per-character"
#: ProstT5's direction prefixes: (amino acids, upper case; 3Di, lower case)
PROSTT5_PREFIXES = ("<AA2fold>", "<fold2AA>")
#: Foldseek's 20 3Di states, lower case as ProstT5 reads them (each a piece ``"▁" + state``)
THREE_DI = "acdefghiklmnpqrstvwy"


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
    """:data:`SPACED_3DI` when the vocabulary holds both direction prefixes, :data:`SPACED` when it
    holds ``▁A`` (space-separated residues), :data:`PER_CHARACTER` when it holds ``A``; anything
    else is not a protein T5 tokenizer."""
    vocab = read_vocabulary(directory)
    if all(prefix in vocab for prefix in PROSTT5_PREFIXES):
        return SPACED_3DI
    if "▁A" in vocab:
        return SPACED
    if "A" in vocab:
        return PER_CHARACTER
    raise ModelError(f"{directory}: the tokenizer has neither '▁A' (ProtT5) nor 'A' (Ankh): not a protein T5 model")


def residue_table(vocab: dict[str, int], style: str, *, where: str) -> tuple[np.ndarray, int, int]:
    """(ASCII byte -> token id, ``</s>`` id, ``<pad>`` id) for ``style``."""
    missing = [t for t in ("</s>", "<pad>", "<unk>") if t not in vocab]
    if missing:
        raise ModelError(f"{where}: the tokenizer lacks {', '.join(missing)}")
    lut = np.full(256, vocab["<unk>"], dtype=np.int64)
    # ProstT5 keeps the case (lower case: 3Di states); the recipe's X applies to upper case only
    letters = LETTERS + (LETTERS.lower() if style == SPACED_3DI else "")
    for letter in letters:
        if style != PER_CHARACTER:
            piece = "▁" + ("X" if letter in PROT_T5_RARE else letter)
        else:
            piece = letter
        lut[ord(letter)] = vocab.get(piece, vocab["<unk>"])
    return lut, vocab["</s>"], vocab["<pad>"]


def prefix_ids(vocab: dict[str, int], *, where: str) -> tuple[int, int]:
    """The ids of ProstT5's ``<AA2fold>`` and ``<fold2AA>``; one line when one, or a 3Di state's
    piece, is missing."""
    missing = [p for p in PROSTT5_PREFIXES if p not in vocab]
    states = [s for s in THREE_DI if "▁" + s not in vocab]
    if states:  # each 3Di state one piece, or the rows would not be the residues': refused, not guessed
        raise ModelError(f"{where}: a ProstT5 tokenizer has one piece per 3Di state; it lacks "
                         f"{', '.join('▁' + s for s in states[:5])}")
    if missing:
        raise ModelError(f"{where}: a ProstT5 tokenizer needs {' and '.join(PROSTT5_PREFIXES)}; it lacks {', '.join(missing)}")
    return vocab[PROSTT5_PREFIXES[0]], vocab[PROSTT5_PREFIXES[1]]


def direction(sequence: str) -> int:
    """0 (``<AA2fold>``) for an upper-case record, 1 (``<fold2AA>``) for a lower-case one; a
    record of both cases is refused (the FASTA reader refuses it first: ``mixed-case``)."""
    if sequence.isupper():
        return 0
    if sequence.islower():
        return 1
    raise ModelError(f"ProstT5 reads an upper-case sequence as amino acids and a lower-case one as 3Di; "
                     f"{sequence[:20]!r}... mixes both")


def tokenize(sequences: list[str], lut: np.ndarray, eos: int, pad: int,
             prefixes: tuple[int, int] | None = None) -> np.ndarray:
    """(B, 1 + longest) int64: residues at 0..n-1, ``</s>`` at n, then ``<pad>`` (no BOS); with
    ``prefixes`` (ProstT5) each row starts with its :func:`direction`'s prefix, residues at 1..n."""
    start = 0 if prefixes is None else 1
    width = max(len(seq) for seq in sequences) + 1 + start
    tokens = np.full((len(sequences), width), pad, dtype=np.int64)
    for row, seq in enumerate(sequences):
        if prefixes is not None:
            tokens[row, 0] = prefixes[direction(seq)]
        tokens[row, start : start + len(seq)] = lut[np.frombuffer(seq.encode("ascii"), dtype=np.uint8)]
        tokens[row, start + len(seq)] = eos
    return tokens
