"""ProtT5, ProstT5 and Ankh as a Hugging Face type (``model_type: t5``): what is known without torch.

The loader is :mod:`embedpipe.model.t5`; this module is the :class:`HfFamily` the three T5 rows of
:data:`embedpipe.model.families.FAMILY_TABLE` share (:mod:`embedpipe.model.hf_checkpoint` tells them
apart by make-test-model's marker, the hub name, then the tokenization style of the vocabulary).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embedpipe.model import t5_vocab
from embedpipe.model.config_bounds import t5_config
from embedpipe.model.hf_families import HfFamily

#: what decides a T5 directory's tokens besides tokenizer.json: the files transformers' tokenizer
#: reads when only spiece.model is there (embedpipe.model.t5_vocab.read_vocabulary)
SPIECE_FILES = ("spiece.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def sizes(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """T5's bounded sizes (:func:`~embedpipe.model.config_bounds.t5_config`) under the common names."""
    bounded = t5_config(config, where)
    return bounded | {"embed_dim": bounded["d_model"], "attention_heads": bounded["num_heads"]}


def identity_files(directory: Path, config: Mapping[str, Any]) -> list[str]:
    """``config.json`` and ``tokenizer.json`` (else the files ``spiece.model`` is read with)."""
    return ["config.json", *(("tokenizer.json",) if (directory / "tokenizer.json").is_file() else SPIECE_FILES)]


HF_T5 = HfFamily(model_type="t5", label="ProtT5, ProstT5, Ankh", sizes=sizes, identity_files=identity_files,
                 style=t5_vocab.tokenization_style)
