"""Random-weight Hugging Face test directories: ``make-test-model --family`` of the Hugging Face
formats of :data:`embedpipe.model.families.FAMILY_TABLE`, each written by the writer its row names
(:func:`esm_directory`, :func:`t5_directory`, :func:`esmc_directory`) with the row's options
(``esmc-pth``, the esm package's layout of ``random_esmc``'s weights: :mod:`embedpipe.model.esmc_pth`).

Each directory is what a real one holds (``config.json``, ``model.safetensors``, tokenizer
files that transformers' ``AutoTokenizer`` loads), so the same loader reads it as it reads a
real model. ``config.json`` carries ``"embedpipe": {"trained": false, ...}``: stores made
with it say ``model_trained = false`` (transformers keeps the key as an unused attribute).
The directory is written under a temporary name and renamed: a failure leaves nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from embedpipe.core.errors import ModelError
from embedpipe.core.output_guard import writing_outputs
from embedpipe.core.version import __version__
from embedpipe.model import families
from embedpipe.model.checkpoint import validate_shape
from embedpipe.model.hf_families import MARKER_KEY
from embedpipe.model.optional import require
from embedpipe.model.t5_vocab import LETTERS, PER_CHARACTER, PROSTT5_PREFIXES, SPACED_3DI, THREE_DI


def marker(family: str, seed: int) -> dict[str, Any]:
    return {"trained": False, "family": family, "seed": int(seed), "created_by": "embedpipe make-test-model",
            "embedpipe_version": __version__}


def write_directory(out: Path, files: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Path:
    """``files`` (name -> JSON object or text) and ``model.safetensors`` into directory ``out``,
    its lock held meanwhile (embedpipe.core.output_guard: a second writer of ``out`` is refused)."""
    with writing_outputs("make-test-model", [("OUT", Path(out))]):
        return _write_directory(Path(out), files, tensors)


def _write_directory(out: Path, files: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Path:
    save = require("safetensors.torch", "make-test-model --family (writing model.safetensors)").save
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelError(f"make-test-model: {out} exists and is not an empty directory; remove it or pick another OUT")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        for name, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=2, sort_keys=True)
            (tmp / name).write_text(text)
        # the bytes written as any file is (safetensors' own save_file leaves its file 0600)
        (tmp / "model.safetensors").write_bytes(save({k: v.contiguous() for k, v in tensors.items()}))
        if out.is_dir():
            out.rmdir()
        tmp.rename(out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"make-test-model: cannot write {out}: {exc.strerror or exc}") from None
    return out


# --------------------------------------------------------------------------- ESM-2


def hf_esm_files(layers: int, dim: int, heads: int, token_dropout: bool, mark: Mapping[str, Any], *,
                 absolute: bool = False, alphabet: Any = None) -> dict[str, Any]:
    """config.json and the EsmTokenizer files of an ESM-2 with this shape (``absolute``: an ESM-1b,
    as ``facebook/esm1b_t33_650M_UR50S`` is: absolute positions, a layer norm before the first layer;
    ``alphabet``: ESM-2's unless given, SaProt's pairs: its vocab.txt as SaProt's own)."""
    from embedpipe.model.esm2 import esm2_alphabet

    alphabet = alphabet or esm2_alphabet()
    config = {"model_type": "esm", "architectures": ["EsmForMaskedLM"], "vocab_size": len(alphabet.all_toks),
              "hidden_size": dim, "num_hidden_layers": layers, "num_attention_heads": heads,
              "intermediate_size": 4 * dim, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 1026,
              "position_embedding_type": "absolute" if absolute else "rotary", "layer_norm_eps": 1e-5,
              "emb_layer_norm_before": absolute,
              "token_dropout": token_dropout, "mask_token_id": alphabet.mask_idx,
              "pad_token_id": alphabet.padding_idx, "is_folding_model": False, MARKER_KEY: dict(mark)}
    specials = {"cls_token": "<cls>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                "mask_token": "<mask>"}
    return {"config.json": config, "vocab.txt": "\n".join(alphabet.all_toks) + "\n",
            "tokenizer_config.json": {"tokenizer_class": "EsmTokenizer", "model_max_length": 1026, **specials},
            "special_tokens_map.json": specials}


def hf_esm_tensors(fair_state: Mapping[str, torch.Tensor], layers: int, absolute: bool = False, *,
                   inv_freq: bool = False) -> dict[str, torch.Tensor]:
    """A fair-esm ``ESM2`` (``absolute``: ESM-1b) state dict under ``EsmForMaskedLM``'s names (tied head left out;
    ``inv_freq``: each layer's rotary ``inv_freq`` too, under the per-layer name of the released ESM-2
    directories, which transformers' ``EsmModel.load_hook`` reads; embedpipe recomputes it)."""
    from embedpipe.model.hf_esm import fair_to_hf_names

    names = fair_to_hf_names(layers, absolute)
    if inv_freq:
        names |= {f"layers.{i}.self_attn.rot_emb.inv_freq": f"encoder.layer.{i}.attention.self.rotary_embeddings.inv_freq"
                  for i in range(layers)}
    return {(v if v.startswith("lm_head.") else "esm." + v): fair_state[k].detach().clone().float()
            for k, v in names.items() if k in fair_state}


def write_hf_esm(out: Path, fair_state: Mapping[str, torch.Tensor], *, layers: int, dim: int, heads: int,
                 token_dropout: bool = True, mark: Mapping[str, Any] | None = None, absolute: bool = False,
                 alphabet: Any = None) -> Path:
    """An ESM-2 (``absolute``: ESM-1b; ``alphabet``: SaProt's pairs; a fair-esm state dict) as a
    Hugging Face ``EsmForMaskedLM`` directory (``mark``: the marker; by default the one of the
    table's format written so, seed -1)."""
    if mark is None:
        wanted = {"absolute": absolute} if absolute else {"pairs": True} if alphabet is not None else {}
        written = families.written(__name__)
        mark = marker(next(f.name for f in written if f.writer is not None and f.writer.options == wanted), -1)
    return write_directory(out, hf_esm_files(layers, dim, heads, token_dropout, mark, absolute=absolute,
                                             alphabet=alphabet),
                           hf_esm_tensors(fair_state, layers, absolute, inv_freq=not absolute and alphabet is None))


# --------------------------------------------------------------------------- ESM C


def esmc_files(layers: int, dim: int, heads: int, ffn: int, mark: Mapping[str, Any]) -> dict[str, Any]:
    """config.json (an ``EsmcConfig``) and a ``tokenizer.json`` of ESM C's fixed vocabulary
    (character-level, ``<cls>`` ... ``<eos>`` around every sequence) that transformers reads."""
    from embedpipe.model import esmc_spec

    tokenizers = require("tokenizers", "make-test-model --family esmc (writing tokenizer.json)")
    vocab = {token: i for i, token in enumerate(esmc_spec.VOCABULARY)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens([t for t in esmc_spec.VOCABULARY if t.startswith("<")])
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<cls> $A <eos>", special_tokens=[("<cls>", esmc_spec.BOS), ("<eos>", esmc_spec.EOS)])
    config = {"model_type": "esmc", "architectures": ["EsmcModel"], "vocab_size": 64, "hidden_size": dim,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
              "head_dim": dim // heads, "intermediate_size": ffn, "hidden_act": "silu",
              "max_position_embeddings": esmc_spec.DEFAULT_POSITIONS, "attention_bias": False, "mlp_bias": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": esmc_spec.DEFAULT_ROPE_THETA},
              "pad_token_id": esmc_spec.PAD, "bos_token_id": esmc_spec.BOS, "eos_token_id": esmc_spec.EOS,
              "mask_token_id": esmc_spec.VOCABULARY.index("<mask>"), "tie_word_embeddings": False,
              MARKER_KEY: dict(mark)}
    specials = {"bos_token": "<cls>", "cls_token": "<cls>", "eos_token": "<eos>", "pad_token": "<pad>",
                "unk_token": "<unk>", "mask_token": "<mask>"}
    return {"config.json": config, "tokenizer.json": tok.to_str(), "special_tokens_map.json": specials,
            "tokenizer_config.json": {"tokenizer_class": "EsmcTokenizer", "model_max_length": 2048, **specials}}


def random_esmc(layers: int, dim: int, heads: int, ffn: int, seed: int) -> dict[str, torch.Tensor]:
    """``EsmcModel`` weights under transformers' names, drawn in ``seed`` (norm scales around 1)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(*shape, generator=gen)

    state = {"embed_tokens.weight": draw(64, dim, std=1.0), "norm.weight": draw(dim, std=0.1, mean=1.0)}
    for i in range(layers):
        layer = f"layers.{i}"
        for n in ("q", "k", "v", "o"):
            state[f"{layer}.self_attn.{n}_proj.weight"] = draw(dim, dim, std=dim ** -0.5)
        for n in ("q_norm", "k_norm"):
            state[f"{layer}.self_attn.{n}.weight"] = draw(dim, std=0.1, mean=1.0)
        for n in ("input_layernorm", "post_attention_layernorm"):
            state[f"{layer}.{n}.weight"] = draw(dim, std=0.1, mean=1.0)
            state[f"{layer}.{n}.bias"] = draw(dim, std=0.1)
        state[f"{layer}.mlp.gate_proj.weight"] = draw(ffn, dim, std=dim ** -0.5)
        state[f"{layer}.mlp.up_proj.weight"] = draw(ffn, dim, std=dim ** -0.5)
        state[f"{layer}.mlp.down_proj.weight"] = draw(dim, ffn, std=ffn ** -0.5)
    return state


# --------------------------------------------------------------------------- T5


def t5_tokenizer_files(style: str) -> tuple[dict[str, Any], int]:
    """tokenizer.json (a Unigram vocabulary: <pad> 0, </s> 1, <unk> 2, then one piece per
    residue: ``▁A`` for ProtT5's style, ``A`` for Ankh's; ProstT5's: ProtT5's, one ``▁a`` per 3Di
    state, then its direction prefixes as added special tokens) and transformers' tokenizer configs."""
    tokenizers = require("tokenizers", "make-test-model --family (writing tokenizer.json)")
    spaced = style != PER_CHARACTER
    pieces = [("▁" + r) if spaced else r for r in LETTERS + (THREE_DI if style == SPACED_3DI else "")]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(p, -1.0 - 0.01 * i) for i, p in enumerate(pieces)]
    tok = tokenizers.Tokenizer(tokenizers.models.Unigram(vocab, unk_id=2, byte_fallback=False))
    if style == SPACED_3DI:
        tok.add_special_tokens(list(PROSTT5_PREFIXES))
    if spaced:
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = tokenizers.decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    specials = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    # ProtT5 ships a T5 tokenizer; a per-character one is loaded as written (PreTrainedTokenizerFast)
    cls = "T5Tokenizer" if spaced else "PreTrainedTokenizerFast"
    return {"tokenizer.json": tok.to_str(), "special_tokens_map.json": specials,
            "tokenizer_config.json": {"tokenizer_class": cls, "extra_ids": 0, "model_max_length": 1 << 20,
                                      **specials}}, tok.get_vocab_size(with_added_tokens=True)


def random_t5(layers: int, dim: int, heads: int, vocab: int, gated: bool, seed: int, *,
              d_kv: int | None = None, d_ff: int | None = None) -> dict[str, torch.Tensor]:
    """T5EncoderModel weights drawn as T5's init scales them (norm scales around 1), in ``seed``;
    ``d_kv`` defaults to dim / heads and ``d_ff`` to 2 x dim (small test models)."""
    gen = torch.Generator().manual_seed(seed)
    d_kv, d_ff = d_kv or dim // heads, d_ff or 2 * dim

    def draw(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(*shape, generator=gen)

    inner = heads * d_kv
    state = {"shared.weight": draw(vocab, dim, std=1.0), "encoder.final_layer_norm.weight": draw(dim, std=0.1, mean=1.0),
             "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": draw(32, heads, std=0.5)}
    for i in range(layers):
        block = f"encoder.block.{i}.layer"
        state[f"{block}.0.SelfAttention.q.weight"] = draw(inner, dim, std=(dim * d_kv) ** -0.5)
        for n in ("k", "v"):
            state[f"{block}.0.SelfAttention.{n}.weight"] = draw(inner, dim, std=dim ** -0.5)
        state[f"{block}.0.SelfAttention.o.weight"] = draw(dim, inner, std=inner ** -0.5)
        state[f"{block}.0.layer_norm.weight"] = draw(dim, std=0.1, mean=1.0)
        state[f"{block}.1.layer_norm.weight"] = draw(dim, std=0.1, mean=1.0)
        for n in (("wi_0", "wi_1") if gated else ("wi",)):
            state[f"{block}.1.DenseReluDense.{n}.weight"] = draw(d_ff, dim, std=dim ** -0.5)
        state[f"{block}.1.DenseReluDense.wo.weight"] = draw(dim, d_ff, std=d_ff ** -0.5)
    return state


def make_hf_test_model(out: Path, *, family: str, layers: int = 2, dim: int = 32, heads: int = 4,
                       seed: int = 0, d_kv: int | None = None, d_ff: int | None = None) -> Path:
    """Write a random-weight Hugging Face directory of ``family`` (a Hugging Face format of the
    table: hf-esm, hf-esm1b, saprot, prot-t5, prostt5, ankh, esmc), by its row's writer.

    ``d_kv`` (T5) and ``d_ff`` (T5, ESM C's SwiGLU width; default dim / heads and 2 x dim) let benchmarks give a
    scaled-down model the real one's proportions (ProtT5-XL: d_ff 16 x d_model, d_kv 128)."""
    writer = families.test_model_format(family, __name__).writer
    assert writer is not None  # a written format
    return writer.write(out, family, layers=layers, dim=dim, heads=heads, seed=seed, d_kv=d_kv, d_ff=d_ff)


def esm_directory(out: Path, *, family: str, layers: int, dim: int, heads: int, seed: int, d_kv: int | None = None,
                  d_ff: int | None = None, absolute: bool = False, pairs: bool = False) -> Path:
    """A random ``model_type: esm`` directory: an ESM-2 (``absolute``: an ESM-1b; ``pairs``: over
    SaProt's pair alphabet) drawn as fair-esm inits it, under transformers' names."""
    from embedpipe.model.random_checkpoint import random_fair_esm
    from embedpipe.model.saprot import saprot_alphabet

    layers, dim, heads = validate_shape(layers, dim, heads, where="make-test-model")
    alphabet = saprot_alphabet() if pairs else None
    fair = random_fair_esm(absolute, layers, dim, heads, seed, alphabet=alphabet).state_dict()
    return write_hf_esm(out, fair, layers=layers, dim=dim, heads=heads, mark=marker(family, seed), absolute=absolute,
                        alphabet=alphabet)


def esmc_directory(out: Path, *, family: str, layers: int, dim: int, heads: int, seed: int, d_kv: int | None = None,
                   d_ff: int | None = None) -> Path:
    """A random ``model_type: esmc`` directory (``d_ff``: the SwiGLU width, 2 x dim unless given)."""
    layers, dim, heads = validate_shape(layers, dim, heads, where="make-test-model")
    return write_directory(out, esmc_files(layers, dim, heads, d_ff or 2 * dim, marker(family, seed)),
                           random_esmc(layers, dim, heads, d_ff or 2 * dim, seed))


def t5_directory(out: Path, *, family: str, layers: int, dim: int, heads: int, seed: int, d_kv: int | None = None,
                 d_ff: int | None = None, gated: bool = False) -> Path:
    """A random ``model_type: t5`` encoder with the tokenizer of its format's style (``gated``: T5
    v1.1-style gated-gelu, as Ankh; ProtT5-XL uses relu)."""
    layers, dim, heads = validate_shape(layers, dim, heads, where="make-test-model")
    fmt = families.format_named(family)
    tokenizer, vocab = t5_tokenizer_files(str(fmt.hf_style if fmt is not None else None))
    d_kv, d_ff = d_kv or dim // heads, d_ff or 2 * dim
    config = {"model_type": "t5", "architectures": ["T5EncoderModel"], "vocab_size": vocab, "d_model": dim,
              "d_kv": d_kv, "d_ff": d_ff, "num_layers": layers, "num_heads": heads,
              "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
              "dropout_rate": 0.0, "layer_norm_epsilon": 1e-6, "feed_forward_proj": "gated-gelu" if gated else "relu",
              "is_encoder_decoder": False, "use_cache": False, "pad_token_id": 0, "eos_token_id": 1,
              "decoder_start_token_id": 0, MARKER_KEY: marker(family, seed)}
    weights = random_t5(layers, dim, heads, vocab, gated, seed, d_kv=d_kv, d_ff=d_ff)
    return write_directory(out, {"config.json": config, **tokenizer}, weights)
