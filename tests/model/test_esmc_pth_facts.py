"""What the esm package (EvolutionaryScale) says of ESM C's files, transcribed from its source, and
make-test-model's ``esmc-pth`` fixture and embedpipe's release table checked against it.

Independent computation: the esm package's ESM C forward written out here from its modules
(attention, blocks, transformer stack, rotary), run on the fixture's state dict under the esm
package's own names, against embedpipe's forward on the same file.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from embedpipe.model import esmc_pth_spec, esmc_spec, load_model
from embedpipe.model.esmc_pth import make_test_model
from embedpipe.model.random_hf import random_esmc
from embedpipe.runtime.precision import get_policy

# evolutionaryscale/esm esm/utils/constants/models.py: ESMC_300M, ESMC_600M
# evolutionaryscale/esm esm/pretrained.py: ESMC_300M_202412, ESMC_600M_202412 (d_model, n_heads, n_layers, the file)
# evolutionaryscale/esm esm/utils/constants/esm3.py: data_root (the hub repository of each)
RELEASES = {
    "esmc_300m": ("EvolutionaryScale/esmc-300m-2024-12", "data/weights/esmc_300m_2024_12_v0.pth", 960, 15, 30),
    "esmc_600m": ("EvolutionaryScale/esmc-600m-2024-12", "data/weights/esmc_600m_2024_12_v0.pth", 1152, 18, 36),
}

# evolutionaryscale/esm esm/utils/constants/esm3.py: SEQUENCE_VOCAB (EsmSequenceTokenizer's ids, in order)
SEQUENCE_VOCAB = [
    "<cls>", "<pad>", "<eos>", "<unk>",
    "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K",
    "Q", "N", "F", "Y", "M", "H", "W", "C", "X", "B", "U", "Z",
    "O", ".", "-", "|",
    "<mask>",
]


def swiglu_correction_fn(expansion_ratio: float, d_model: int) -> int:
    # evolutionaryscale/esm esm/layers/blocks.py (expansion_ratio 8 / 3: esm/layers/transformer_stack.py)
    return int(((expansion_ratio * d_model) + 255) // 256 * 256)


def esm_state_shapes(d: int, n_layers: int) -> dict[str, tuple[int, ...]]:
    """``ESMC(d_model=d, n_heads=d // 64, n_layers).state_dict()``'s names and shapes."""
    f = swiglu_correction_fn(8 / 3, d)
    # evolutionaryscale/esm esm/models/esmc.py: embed = nn.Embedding(64, d_model), transformer = TransformerStack(...),
    # sequence_head = RegressionHead(d_model, 64); esm/layers/regression_head.py: Linear, GELU, LayerNorm, Linear
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (64, d), "transformer.norm.weight": (d,),  # esm/layers/transformer_stack.py: LayerNorm(bias=False)
        "sequence_head.0.weight": (d, d), "sequence_head.0.bias": (d,), "sequence_head.2.weight": (d,),
        "sequence_head.2.bias": (d,), "sequence_head.3.weight": (64, d), "sequence_head.3.bias": (64,)}
    for i in range(n_layers):
        b = f"transformer.blocks.{i}."
        # evolutionaryscale/esm esm/layers/attention.py: layernorm_qkv = Sequential(LayerNorm(d), Linear(d, 3d, bias=False)),
        # out_proj = Linear(d, d, bias=False), q_ln / k_ln = LayerNorm(d, bias=False); rotary's inv_freq is not persistent
        shapes |= {b + "attn.layernorm_qkv.0.weight": (d,), b + "attn.layernorm_qkv.0.bias": (d,),
                   b + "attn.layernorm_qkv.1.weight": (3 * d, d), b + "attn.out_proj.weight": (d, d),
                   b + "attn.q_ln.weight": (d,), b + "attn.k_ln.weight": (d,)}
        # evolutionaryscale/esm esm/layers/blocks.py: swiglu_ln_ffn = Sequential(LayerNorm(d), Linear(d, 2F, bias=False),
        # SwiGLU(), Linear(F, d, bias=False))
        shapes |= {b + "ffn.0.weight": (d,), b + "ffn.0.bias": (d,), b + "ffn.1.weight": (2 * f, d),
                   b + "ffn.3.weight": (d, f)}
    return shapes


def esm_forward(state: dict[str, torch.Tensor], tokens: torch.Tensor, n_heads: int, n_layers: int) -> list[torch.Tensor]:
    """The esm package's ESMC.forward on one unpadded sequence (1, L), fp32: the embedding, every
    block's output (``hidden_states``), the final norm's output (``embeddings``)."""
    d = state["embed.weight"].shape[1]
    d_head = d // n_heads
    x = F.embedding(tokens, state["embed.weight"])  # esm/models/esmc.py
    out = [x]
    scale = math.sqrt(n_layers / 36)  # esm/layers/transformer_stack.py: residue_scaling_factor
    # esm/layers/rotary.py: RotaryEmbedding(d_head), base 10000, not interleaved (halves)
    inv_freq = 1 / (10000.0 ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head))
    freqs = torch.outer(torch.arange(tokens.shape[1], dtype=torch.float32), inv_freq)
    cos, sin = torch.cos(freqs).repeat(1, 2)[:, None, :], torch.sin(freqs).repeat(1, 2)[:, None, :]

    def rotary(t: torch.Tensor) -> torch.Tensor:  # esm/layers/rotary.py: apply_rotary_emb_torch, rotate_half
        t = t.unflatten(-1, (n_heads, d_head))
        t1, t2 = t.chunk(2, dim=-1)
        return (t * cos + torch.cat((-t2, t1), dim=-1) * sin).flatten(-2, -1)

    for i in range(n_layers):
        b = f"transformer.blocks.{i}."
        # esm/layers/attention.py: MultiHeadAttention.forward
        h = F.layer_norm(x, (d,), state[b + "attn.layernorm_qkv.0.weight"], state[b + "attn.layernorm_qkv.0.bias"])
        q, k, v = torch.chunk(F.linear(h, state[b + "attn.layernorm_qkv.1.weight"]), 3, dim=-1)
        q = rotary(F.layer_norm(q, (d,), state[b + "attn.q_ln.weight"]))
        k = rotary(F.layer_norm(k, (d,), state[b + "attn.k_ln.weight"]))
        heads = [t.unflatten(-1, (n_heads, d_head)).transpose(1, 2) for t in (q, k, v)]
        context = F.scaled_dot_product_attention(*heads).transpose(1, 2).flatten(-2, -1)
        x = x + F.linear(context, state[b + "attn.out_proj.weight"]) / scale  # esm/layers/blocks.py: forward
        h = F.layer_norm(x, (d,), state[b + "ffn.0.weight"], state[b + "ffn.0.bias"])
        x1, x2 = F.linear(h, state[b + "ffn.1.weight"]).chunk(2, dim=-1)  # esm/layers/blocks.py: SwiGLU
        x = x + F.linear(F.silu(x1) * x2, state[b + "ffn.3.weight"]) / scale
        out.append(x)
    out.append(F.layer_norm(x, (d,), state["transformer.norm.weight"]))  # esm/layers/transformer_stack.py
    return out


def test_the_release_table_is_the_esm_package_s() -> None:
    assert {name: (r.repo, r.file, r.dim, r.heads, r.layers) for name, r in esmc_pth_spec.RELEASES.items()} == RELEASES
    for _repo, _file, d, heads, _layers in RELEASES.values():  # the rule a .pth's head count follows
        assert d // heads == esmc_pth_spec.HEAD_DIM and d % heads == 0


def test_the_vocabulary_and_the_swiglu_width_are_the_esm_package_s() -> None:
    assert list(esmc_spec.VOCABULARY) == SEQUENCE_VOCAB
    # esm/tokenization/sequence_tokenizer.py: TemplateProcessing("<cls> $A <eos>"), pad_token "<pad>"
    assert (esmc_spec.BOS, esmc_spec.EOS, esmc_spec.PAD) == tuple(SEQUENCE_VOCAB.index(t) for t in ("<cls>", "<eos>",
                                                                                                     "<pad>"))
    for d in (64, 128, 960, 1152):
        assert esmc_spec.swiglu_width(d) == swiglu_correction_fn(8 / 3, d)
    assert esmc_spec.RESIDUAL_LAYERS == 36  # esm/layers/transformer_stack.py: math.sqrt(n_layers / 36)


def test_the_fixture_holds_the_esm_package_s_names_and_the_esmc_fixture_s_weights(tmp_path: Path) -> None:
    """Every name and shape of ``ESMC.state_dict()``; q/k/v concatenated in that order (attention.py's
    ``torch.chunk(qkv, 3)``: query, key, value) and the gate before the up projection (blocks.py's
    SwiGLU: ``silu(x1) * x2``), from the weights make-test-model --family esmc draws for the seed."""
    state = torch.load(make_test_model(tmp_path / "m.pth", layers=2, dim=128, seed=7), weights_only=True)
    assert {k: tuple(v.shape) for k, v in state.items()} == esm_state_shapes(128, 2)
    hf = random_esmc(2, 128, 2, 512, 7)
    for i in range(2):
        a, b = f"layers.{i}.", f"transformer.blocks.{i}."
        assert torch.equal(state[b + "attn.layernorm_qkv.1.weight"],
                           torch.cat([hf[a + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        assert torch.equal(state[b + "ffn.1.weight"], torch.cat([hf[a + "mlp.gate_proj.weight"],
                                                                 hf[a + "mlp.up_proj.weight"]]))
        assert torch.equal(state[b + "attn.out_proj.weight"], hf[a + "self_attn.o_proj.weight"])
        assert torch.equal(state[b + "ffn.0.bias"], hf[a + "post_attention_layernorm.bias"])
    assert torch.equal(state["embed.weight"], hf["embed_tokens.weight"])


def test_embedpipe_equals_the_esm_package_s_forward_on_every_layer(tmp_path: Path) -> None:
    path = make_test_model(tmp_path / "m.pth", layers=3, dim=128, seed=8)
    state = torch.load(path, weights_only=True)
    model = load_model(str(path))
    runner = model.prepare(get_policy("fp32"), torch.device("cpu"), "sdpa")
    for seq in ("MKTAYIAKQRQISFVKSHFSRQ", "ACDEFGHIKLMNPQRSTVWYXBUZO", "W"):
        tokens = torch.tensor([[0, *(SEQUENCE_VOCAB.index(c) for c in seq), 2]])
        assert torch.equal(model.tokenize([seq]), tokens)  # esm's tokenizer: <cls>, the letters, <eos>
        with torch.inference_mode():
            ours = runner(tokens, list(range(4))).hidden
            want = esm_forward(state, tokens, 2, 3)
        # embedpipe's layers: the embedding, blocks 1..N-1, the final norm's output (esm's last block is before it)
        for layer, expected in enumerate([*want[:3], want[-1]]):
            err = float((ours[layer] - expected).norm() / expected.norm())
            assert err <= 1e-5, (seq, layer, err)
