"""Optional benchmark peer: Hugging Face transformers' ``EsmModel`` with SDPA attention.

Converts a fair-esm ESM-2 checkpoint (as loaded by ``embedpipe.model.load_model``) into
``transformers.EsmModel`` (no pooling layer, ``attn_implementation="sdpa"``) and runs the
same whole-process recipe as fair-esm's scripts/extract.py in ``embed_throughput.py``:
length-sorted batches of at most 4096 tokens (BOS/EOS included), truncation at 1022
residues, fp32 (or the whole model in bf16 with ``--dtype bfloat16``, what a CPU user after
speed would pick), mean over residues of the last layer (in fp32), one ``.pt`` file per
sequence with ``{"label": id, "mean_representations": {num_layers: fp32 tensor}}`` and
``_stats.json`` with ``padding_efficiency`` (real tokens / computed tokens), the attention
implementation and the dtype.

    python benchmarks/hf_esm_peer.py MODEL FASTA OUT --threads N [--dtype bfloat16]

transformers is not a dependency of embedpipe: this peer runs only where it is installed.
Tokens come from fair-esm's alphabet (same ids as HF's EsmTokenizer vocabulary), and an
``attention_mask`` (token != padding) is passed, so padded batches give the same
real-token outputs as fair-esm.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import transformers

#: fair-esm's extract.py defaults used by the benchmark recipe.
TOKS_PER_BATCH = 4096
TRUNCATION = 1022
#: dtypes the peer runs in (the whole model cast, as ``model.to(dtype)`` / ``torch_dtype=`` does)
DTYPES = ("float32", "bfloat16")


def _hf_state_dict(fair: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Map a fair-esm ``ESM2.state_dict()`` to ``EsmModel`` parameter names (as convert_esm.py does)."""
    out = {
        "embeddings.word_embeddings.weight": fair["embed_tokens.weight"],
        "encoder.emb_layer_norm_after.weight": fair["emb_layer_norm_after.weight"],
        "encoder.emb_layer_norm_after.bias": fair["emb_layer_norm_after.bias"],
    }
    from embedpipe.model.hf_esm import PER_LAYER as per_layer  # the one fair-esm -> EsmModel name map

    for i in range(num_layers):
        for src, dst in per_layer.items():
            for kind in ("weight", "bias"):
                out[f"encoder.layer.{i}.{dst}.{kind}"] = fair[f"layers.{i}.{src}.{kind}"]
    for kind in ("weight", "bias"):
        key = f"contact_head.regression.{kind}"
        if key in fair:
            out[key] = fair[key]
    inv_freq = fair.get("layers.0.self_attn.rot_emb.inv_freq")
    if inv_freq is not None:
        out["rotary_embeddings.inv_freq"] = inv_freq
    return out


def convert_to_hf(loaded: Any) -> transformers.EsmModel:
    """A ``transformers.EsmModel`` (eval, fp32, SDPA when supported) with ``loaded``'s ESM-2 weights.

    ``loaded`` is an ``embedpipe.model.esm2.Esm2Model``. ``last_hidden_state`` of the result
    equals fair-esm's last-layer representation (``emb_layer_norm_after`` applied).
    """
    import torch
    from transformers import EsmConfig, EsmModel

    alphabet = loaded.alphabet
    dim = loaded.embed_dim
    sdpa = bool(getattr(EsmModel, "_supports_sdpa", False))
    config = EsmConfig(
        vocab_size=len(alphabet),
        hidden_size=dim,
        num_hidden_layers=loaded.num_layers,
        num_attention_heads=loaded.attention_heads,
        intermediate_size=4 * dim,
        position_embedding_type="rotary",
        token_dropout=bool(getattr(loaded.model, "token_dropout", True)),
        mask_token_id=alphabet.mask_idx,
        pad_token_id=alphabet.padding_idx,
        emb_layer_norm_before=False,
        layer_norm_eps=1e-5,
        max_position_embeddings=1026,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **({"attn_implementation": "sdpa"} if sdpa else {}),
    )
    model = EsmModel(config, add_pooling_layer=False)
    if sdpa and getattr(model.config, "_attn_implementation", None) != "sdpa":
        model.set_attn_implementation("sdpa")
    state = _hf_state_dict(loaded.model.state_dict(), loaded.num_layers)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Only the optional contact head and recomputed buffers may be left to their defaults.
    missing = [k for k in missing if not k.startswith("contact_head.") and not k.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"ESM-2 -> EsmModel mapping incomplete: missing {missing}, unexpected {unexpected}")
    model = model.to(torch.float32).eval()
    model.requires_grad_(False)
    return model


def attention_implementation(model: transformers.EsmModel) -> str:
    """The attention backend the converted model runs with (``"sdpa"`` or ``"eager"``)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def run_hf(model_path: Path, fasta: Path, out_dir: Path, threads: int, dtype: str = "float32") -> None:
    """Whole-process HF recipe mirroring ``embed_throughput.run_fair_esm_recipe``'s outputs;
    ``dtype`` casts the whole model (bf16: every op in bf16, means taken in fp32)."""
    import torch
    from esm.data import FastaBatchedDataset

    from embedpipe.model import load_model

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    torch.set_num_threads(threads)
    loaded = load_model(str(model_path))
    model = convert_to_hf(loaded).to(getattr(torch, dtype))
    alphabet, layer = loaded.alphabet, loaded.num_layers
    del loaded  # keep only the HF model in memory
    dataset = FastaBatchedDataset.from_file(str(fasta))
    batches = dataset.get_batch_indices(TOKS_PER_BATCH, extra_toks_per_seq=1)
    loader = torch.utils.data.DataLoader(
        dataset, collate_fn=alphabet.get_batch_converter(TRUNCATION), batch_sampler=batches
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    real = computed = 0
    with torch.inference_mode():
        for labels, strs, toks in loader:
            mask = toks.ne(alphabet.padding_idx).long()
            reps = model(input_ids=toks, attention_mask=mask).last_hidden_state
            computed += toks.numel()
            for i, label in enumerate(labels):
                n = min(TRUNCATION, len(strs[i]))
                real += n + 2
                mean = reps[i, 1 : n + 1].float().mean(0).clone()
                result = {"label": label, "mean_representations": {layer: mean}}
                torch.save(result, out_dir / f"{label.split()[0].replace('|', '_')}.pt")
    stats = {"padding_efficiency": real / computed, "attention": attention_implementation(model), "dtype": dtype}
    (out_dir / "_stats.json").write_text(json.dumps(stats))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("fasta", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("hf_esm_peer: transformers is not installed (pip install transformers)")
    run_hf(args.model, args.fasta, args.out, args.threads, args.dtype)


if __name__ == "__main__":
    main()
