"""One small random-weight model of every family, in the family's own on-disk format, for the
tests that must hold for every family (the entry points' parity, search's self-hits).

Each builder writes what ``embedpipe make-test-model`` writes, through the writer of each format
of the family table (embedpipe.model.families), plus ESM-1v (ESM-1b's format without a companion)
and ESM++ (which make-test-model does not write: the ``esm`` package's weights as ESM++ names
them), with records the family reads as its layout says: amino acids, SaProt's structure-aware
pairs (two characters a residue), ProstT5's amino acids and 3Di (case kept)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from embedpipe.model import families
from embedpipe.model.esmc_pth import make_test_model as make_esmc_pth
from embedpipe.model.layout import TokenLayout
from embedpipe.model.random_checkpoint import make_test_model
from helpers.embed_helpers import random_sequences, structure_aware

#: ProstT5's 3Di alphabet as records hold it (lower case; transcribed in tests/model/test_prostt5.py)
THREE_DI = np.array(list("acdefghiklmnpqrstvwy"))

AMINO_RECORDS = random_sequences(5, [6, 31, 1, 17, 44], seed=21) + [("lower", "mkvlaag")]
SAPROT_RECORDS = structure_aware(random_sequences(5, [6, 31, 1, 17, 44], seed=22), seed=23) + [
    ("masked", "M#K#T#"), ("hand", "MdEvVpQp")]
PROSTT5_RECORDS = random_sequences(3, [6, 31, 12], seed=24) + [
    (f"3di{i}", rid) for i, (_, rid) in enumerate(random_sequences(3, [5, 29, 13], seed=25, alphabet=THREE_DI))]


def esm_plusplus_directory(out: Path, *, layers: int = 2, dim: int = 128, seed: int = 4) -> Path:
    """An ESM++ directory (``model_type: ESMplusplus``, Synthyra's port): the ``esm`` package's
    weight names, which ESM++ keeps (tests/model/test_esmc.py), from the random ``.pth`` that
    ``make-test-model --family esmc-pth`` writes, as ``model.safetensors`` beside a config.json
    of the width, heads, layers and vocabulary."""
    from safetensors.torch import save_file

    pth = make_esmc_pth(out.with_suffix(".pth"), layers=layers, dim=dim, seed=seed)
    state = torch.load(pth, weights_only=True)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "model_type": "ESMplusplus", "architectures": ["ESMplusplusForMaskedLM"], "vocab_size": 64,
        "hidden_size": dim, "num_attention_heads": dim // 64, "num_hidden_layers": layers}))
    return out


def _records(layout: TokenLayout) -> list[tuple[str, str]]:
    """Records a family of ``layout`` reads: pairs two characters a residue, amino acids and 3Di
    where case is input, else amino acids."""
    if layout.chars_per_residue == 2:
        return SAPROT_RECORDS
    return PROSTT5_RECORDS if layout.keeps_case else AMINO_RECORDS


def _written(fmt: families.Format) -> Callable[[Path], Path]:
    """The format's own writer (make-test-model's), 2 layers of width 32 and 4 heads unless the writer
    has its own (esmc-pth: 128 wide), seed 5."""
    writer = fmt.writer
    assert writer is not None
    return lambda out: writer.write(out.with_suffix(writer.suffix) if writer.suffix else out, fmt.name,
                                    given=("layers", "seed"), layers=2, dim=32, heads=4, seed=5)


#: family -> (writer of its test model at a path, records it reads)
FAMILIES: dict[str, tuple[Callable[[Path], Path], list[tuple[str, str]]]] = {
    fmt.name: (_written(fmt), _records(families.row_of(fmt).layout)) for fmt in families.written()} | {
    "esm1v": (lambda out: make_test_model(out.with_suffix(".pt"), family="esm1b", layers=2, dim=32, heads=4, seed=6,
                                          companion=False), AMINO_RECORDS),
    "esm++": (esm_plusplus_directory, AMINO_RECORDS),
}
