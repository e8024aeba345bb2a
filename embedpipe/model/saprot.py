"""SaProt on ESM-2's forward: its pair alphabet and its tokenizer.

A SaProt model (a Hugging Face directory, :func:`load_directory`, or SaProt's esm-format ``.pt``:
:mod:`embedpipe.model.saprot_checkpoint`) is an ESM-2 in every weight; only its tokens differ
(446: five specials and the amino-acid x Foldseek-3Di pairs, :func:`embedpipe.model.saprot_spec.vocabulary`).
So it is an
:class:`~embedpipe.model.esm2.Esm2Model` (every policy, the packed layout, the fp32 fallback)
whose alphabet is the pair vocabulary and whose tokenizer reads two characters a residue, as
SaProt's ``EsmTokenizer`` splits ``MdEvVp`` into ``Md Ev Vp``. A directory is read by
:mod:`embedpipe.model.hf_esm` with what differs given here: the tokens its ``vocab.txt`` gives
(:func:`saprot_vocabulary`), this model class and SaProt's refusals.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import esm
import numpy as np
import torch

from embedpipe.core.errors import ModelError
from embedpipe.model import hf_esm, saprot_spec
from embedpipe.model.esm2 import Esm2Model
from embedpipe.model.families import Format


def saprot_alphabet(tokens: Sequence[str] | None = None) -> esm.data.Alphabet:
    """fair-esm's ``Alphabet`` over ``tokens`` (a vocab.txt's, in its order; SaProt's own order
    unless given), built as SaProt's ``load_esm_saprot`` builds it: no prepended or appended
    tokens, BOS and EOS added, the ``<null_k>`` padding to a multiple of 8 dropped again. Every id
    is the token's index in ``tokens`` (SaProt's order: ``<cls>`` 0, ``<pad>`` 1, ``<eos>`` 2,
    ``<unk>`` 3, ``<mask>`` 4, the pairs from 5)."""
    tokens = list(saprot_spec.vocabulary() if tokens is None else tokens)
    alphabet = esm.data.Alphabet(standard_toks=tokens, prepend_toks=[], append_toks=[], prepend_bos=True,
                                 append_eos=True, use_msa=False)
    alphabet.all_toks = alphabet.all_toks[: len(tokens)]  # padding after the tokens: their ids stand
    alphabet.unique_no_split_tokens = alphabet.all_toks
    alphabet.tok_to_idx = {token: i for i, token in enumerate(alphabet.all_toks)}
    return alphabet


@dataclass
class SaProtModel(Esm2Model):
    """An ESM-2 over SaProt's pair tokens; ``tokenize`` takes structure-aware sequences."""

    _pairs: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._pairs = np.full(1 << 16, self.alphabet.unk_idx, dtype=np.int64)  # (byte, byte) -> token
        for token in self.alphabet.all_toks:
            if saprot_spec.is_pair(token):
                self._pairs[ord(token[0]) << 8 | ord(token[1])] = self.alphabet.get_idx(token)

    def tokenize(self, sequences: Sequence[str]) -> torch.Tensor:
        """(B, 2 + most residues): <cls>, one pair token a residue, <eos>, then <pad>."""
        width = max(len(seq) // 2 for seq in sequences) + 2
        tokens = np.full((len(sequences), width), self.alphabet.padding_idx, dtype=np.int64)
        for row, seq in enumerate(sequences):
            chars = np.frombuffer(seq.encode("ascii"), dtype=np.uint8).astype(np.int64).reshape(-1, 2)
            n = len(chars)
            tokens[row, 0] = self.alphabet.cls_idx
            tokens[row, 1 : n + 1] = self._pairs[chars[:, 0] << 8 | chars[:, 1]]
            tokens[row, n + 1] = self.alphabet.eos_idx
        return torch.from_numpy(tokens)


def saprot_vocabulary(directory: Path) -> list[str]:
    """A SaProt directory's ``vocab.txt`` as ``EsmTokenizer`` reads it (a token a line, its id the
    line's index), refused in one line unless it holds SaProt's 446 tokens, in any order."""
    vocab = directory / "vocab.txt"
    try:
        tokens = saprot_spec.read_vocabulary(vocab)
    except OSError as exc:
        raise ModelError(f"cannot read {vocab}: {exc.strerror or exc}") from None
    problem = saprot_spec.vocabulary_problem(tokens)
    if problem is not None:
        raise ModelError(f"{vocab}: not SaProt's vocabulary (SaProt's 446 tokens, in any order): {problem}")
    return tokens


def load_directory(spec: str, directory: Path, config: Mapping[str, Any], fmt: Format) -> Esm2Model:
    """A :class:`SaProtModel` from a Hugging Face SaProt directory of format ``fmt`` (``config.json``
    already read): :func:`embedpipe.model.hf_esm.load_esm` over the tokens of its ``vocab.txt``."""
    alphabet = saprot_alphabet(saprot_vocabulary(directory))
    return hf_esm.load_esm(spec, directory, config, fmt, alphabet, model=SaProtModel,
                           positions="position_embedding_type is not 'rotary'",
                           padding=f"pad_token_id is not vocab.txt's <pad> ({alphabet.padding_idx})")
