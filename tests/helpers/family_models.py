"""One small random-weight model of every family, in the family's own on-disk format, for the
tests that must hold for every family (the entry points' parity, search's self-hits).

Each builder writes what ``embedpipe make-test-model`` writes (or, for ESM++, which it does not
write, transformers' ``EsmcModel`` weights under ESM++'s names), with records the family reads:
amino acids, SaProt's structure-aware pairs, ProstT5's amino acids and 3Di."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.model.random_hf import make_hf_test_model
from helpers.embed_helpers import random_sequences, structure_aware

#: ProstT5's 3Di alphabet as records hold it (lower case; transcribed in tests/model/test_prostt5.py)
THREE_DI = np.array(list("acdefghiklmnpqrstvwy"))

AMINO_RECORDS = random_sequences(5, [6, 31, 1, 17, 44], seed=21) + [("lower", "mkvlaag")]
SAPROT_RECORDS = structure_aware(random_sequences(5, [6, 31, 1, 17, 44], seed=22), seed=23) + [
    ("masked", "M#K#T#"), ("hand", "MdEvVpQp")]
PROSTT5_RECORDS = random_sequences(3, [6, 31, 12], seed=24) + [
    (f"3di{i}", rid) for i, (_, rid) in enumerate(random_sequences(3, [5, 29, 13], seed=25, alphabet=THREE_DI))]


def esm_plusplus_directory(out: Path, *, layers: int = 2, dim: int = 64, heads: int = 4, seed: int = 4) -> Path:
    """An ESM++ directory (``model_type: ESMplusplus``): transformers' ``EsmcModel`` random
    weights under ESM++'s names (Synthyra's modeling file, as tests/model/test_esmc.py checks)."""
    import transformers
    from safetensors.torch import save_file

    config = transformers.EsmcConfig(hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                                     intermediate_size=256)
    torch.manual_seed(seed)
    state = transformers.EsmcModel(config).state_dict()
    plus = {"embed.weight": state["embed_tokens.weight"], "transformer.norm.weight": state["norm.weight"]}
    for i in range(layers):
        a, b = f"layers.{i}.", f"transformer.blocks.{i}."
        plus |= {b + "attn.layernorm_qkv.0.weight": state[a + "input_layernorm.weight"],
                 b + "attn.layernorm_qkv.0.bias": state[a + "input_layernorm.bias"],
                 b + "attn.layernorm_qkv.1.weight": torch.cat([state[a + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                 b + "attn.q_ln.weight": state[a + "self_attn.q_norm.weight"],
                 b + "attn.k_ln.weight": state[a + "self_attn.k_norm.weight"],
                 b + "attn.out_proj.weight": state[a + "self_attn.o_proj.weight"],
                 b + "ffn.0.weight": state[a + "post_attention_layernorm.weight"],
                 b + "ffn.0.bias": state[a + "post_attention_layernorm.bias"],
                 b + "ffn.1.weight": torch.cat([state[a + "mlp.gate_proj.weight"], state[a + "mlp.up_proj.weight"]]),
                 b + "ffn.3.weight": state[a + "mlp.down_proj.weight"]}
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in plus.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "model_type": "ESMplusplus", "architectures": ["ESMplusplusForMaskedLM"], "vocab_size": 64,
        "hidden_size": dim, "num_attention_heads": heads, "num_hidden_layers": layers}))
    return out


def _hf(family: str) -> Callable[[Path], Path]:
    return lambda out: make_hf_test_model(out, family=family, layers=2, dim=32, heads=4, seed=5)


#: family -> (writer of its test model at a path, records it reads)
FAMILIES: dict[str, tuple[Callable[[Path], Path], list[tuple[str, str]]]] = {
    "esm2": (lambda out: make_test_model(out.with_suffix(".pt"), layers=2, dim=32, heads=4, seed=5), AMINO_RECORDS),
    "esm1b": (lambda out: make_test_model(out.with_suffix(".pt"), family="esm1b", layers=2, dim=32, heads=4, seed=5),
              AMINO_RECORDS),
    "esm1v": (lambda out: make_test_model(out.with_suffix(".pt"), family="esm1b", layers=2, dim=32, heads=4, seed=6,
                                          companion=False), AMINO_RECORDS),
    "hf-esm": (_hf("hf-esm"), AMINO_RECORDS),
    "hf-esm1b": (_hf("hf-esm1b"), AMINO_RECORDS),
    "saprot": (_hf("saprot"), SAPROT_RECORDS),
    "prot-t5": (_hf("prot-t5"), AMINO_RECORDS),
    "prostt5": (_hf("prostt5"), PROSTT5_RECORDS),
    "ankh": (_hf("ankh"), AMINO_RECORDS),
    "esmc": (_hf("esmc"), AMINO_RECORDS),
    "esm++": (esm_plusplus_directory, AMINO_RECORDS),
}
