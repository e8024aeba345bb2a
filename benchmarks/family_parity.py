"""Parity, published: every model family under every policy against the family's reference in fp32.

For each family a random-weight test model with the real model's proportions (small, but the
real ratios of heads, width and feed-forward: SHAPES) is run by embedpipe's runner under each
precision policy and by the family's reference implementation in fp32, on the same token ids
(the ids equal the families' tokenizers': tests/model/), and compared on the residue rows only
(BOS, direction prefix, EOS and padding left out) at the first block's output, the middle
layer and the last layer:

* **rel L2**: ||ours - reference|| / ||reference|| over every residue row of every record;
* **p99.9 |err|**: the 99.9th percentile of the absolute differences;
* **min cos**: the smallest cosine between a residue's two vectors.

References: fair-esm's own forward for a fair-esm ``.pt`` ESM-2 (``esm2``) and ESM-1b/1v
(``esm1b``: fair-esm's ``ProteinBertModel``), transformers' ``EsmModel`` for a Hugging Face
ESM-2 directory (``hf-esm``, converted from the same ``.pt``) and an ESM-1b one (``hf-esm1b``:
absolute positions, the layer norm before the first layer) and a SaProt one (``saprot``: the
pair token ids of structure-aware records),
``T5EncoderModel`` for ProtT5, ProstT5 (upper-case and lower-case 3Di records, each with its
direction prefix) and Ankh, ``EsmcModel`` (eager attention) for ESM C.

    python benchmarks/family_parity.py                      # every family, every policy: a few minutes
    python benchmarks/family_parity.py --families prostt5 --policies fp32 bf16-mixed
    python benchmarks/family_parity.py --markdown           # the table docs/models.md shows

Not a timing benchmark. Needs fair-esm and the ``hf`` extra (transformers >= 5.16 for ESM C).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _harness import cpu_model, random_records

#: family -> make-test-model shape: the real model's ratios, scaled down (4 layers)
SHAPES: dict[str, dict[str, int]] = {
    # esm2_t33_650M_UR50D: width 1280, 20 heads of 64, feed-forward 4 x width
    "esm2": {"layers": 4, "dim": 256, "heads": 4},
    "hf-esm": {"layers": 4, "dim": 256, "heads": 4},
    # esm1b_t33_650M_UR50S and the ESM-1v models: the same proportions as ESM-2 650M
    "esm1b": {"layers": 4, "dim": 256, "heads": 4},
    "hf-esm1b": {"layers": 4, "dim": 256, "heads": 4},
    # SaProt_650M_AF2 (and _PDB): ESM-2 650M's proportions over its 446 pair tokens
    "saprot": {"layers": 4, "dim": 256, "heads": 4},
    # ProtT5-XL-U50 (and ProstT5, its fine-tune): d_model 1024, 32 heads x d_kv 128 (4 x d_model), d_ff 16 x d_model
    "prot-t5": {"layers": 4, "dim": 128, "heads": 4, "d_kv": 128, "d_ff": 2048},
    "prostt5": {"layers": 4, "dim": 128, "heads": 4, "d_kv": 128, "d_ff": 2048},
    # ankh-base: d_model 768, 12 heads x d_kv 64, d_ff 4 x d_model, gated-gelu
    "ankh": {"layers": 4, "dim": 128, "heads": 2, "d_kv": 64, "d_ff": 512},
    # ESMC-300M: width 960, 15 heads of 64, SwiGLU 8/3 x width
    "esmc": {"layers": 4, "dim": 192, "heads": 3, "d_ff": 512},
}
FAMILIES = tuple(SHAPES)
POLICIES = ("fp32", "fp16", "bf16", "amp-fp16", "amp-bf16", "fp16-mixed", "bf16-mixed", "int8-mixed")
LENGTHS = (40, 120, 75, 200, 17)
CPU = torch.device("cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--seed", type=int, default=0, help="weights and records")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    return parser.parse_args(argv)


def make_model(family: str, root: Path, seed: int) -> Path:
    """The family's random-weight test model in its own on-disk format (``esm2``: a fair-esm .pt)."""
    from embedpipe.model import load_model
    from embedpipe.model.random_checkpoint import make_test_model
    from embedpipe.model.random_hf import make_hf_test_model, write_hf_esm

    shape = SHAPES[family]
    if family in ("esm2", "hf-esm"):
        pt = root / "esm2_parity.pt"  # fair-esm builds an ESM-2 for names starting with esm2 only
        if not pt.exists():
            make_test_model(pt, seed=seed, **shape)
        if family == "esm2":
            return pt
        return write_hf_esm(root / family, load_model(str(pt)).model.state_dict(), **shape)
    if family == "esm1b":
        pt = root / "esm1b_parity.pt"  # fair-esm builds its ProteinBertModel for names not starting with esm2
        if not pt.exists():
            make_test_model(pt, seed=seed, family="esm1b", **shape)
        return pt
    return make_hf_test_model(root / family, family=family, seed=seed, **shape)


def reference(family: str, path: Path, tokens: torch.Tensor, pad: int, layers: list[int]) -> dict[int, torch.Tensor]:
    """The family's reference forward in fp32: hidden states (B, T, D) of ``layers``."""
    mask = tokens.ne(pad).long()
    with torch.no_grad():
        if family in ("esm2", "esm1b"):
            import argparse as namespace

            import esm

            with torch.serialization.safe_globals([namespace.Namespace]):  # fair-esm's config in the .pt
                model, _ = esm.pretrained.load_model_and_alphabet_local(str(path))
            return dict(model.eval()(tokens, repr_layers=layers)["representations"])
        import transformers

        if family in ("hf-esm", "hf-esm1b", "saprot"):
            hidden = transformers.EsmModel.from_pretrained(str(path), add_pooling_layer=False).eval()(
                input_ids=tokens, attention_mask=mask, output_hidden_states=True).hidden_states
        elif family == "esmc":
            hidden = transformers.EsmcModel.from_pretrained(str(path), attn_implementation="eager",
                                                            dtype=torch.float32).eval()(
                input_ids=tokens, attention_mask=mask, output_hidden_states=True).hidden_states
        else:
            hidden = transformers.T5EncoderModel.from_pretrained(str(path), dtype=torch.float32).eval()(
                input_ids=tokens, attention_mask=mask, output_hidden_states=True).hidden_states
    return {layer: hidden[layer] for layer in layers}


def residue_rows(hidden: torch.Tensor, first: int, lengths: list[int]) -> np.ndarray:
    """(residues, D) float64: each record's residue rows, special tokens and padding left out."""
    return np.concatenate([hidden[row, first : first + n].double().numpy() for row, n in enumerate(lengths)])


def compare(got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    """rel L2, p99.9 |err| and min cosine of residue rows ``got`` against ``want``."""
    diff = got - want
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    finite = bool(np.isfinite(got).all())
    return {"rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(want)) if finite else float("inf"),
            "p999_abs": float(np.quantile(np.abs(diff), 0.999)) if finite else float("inf"),
            "min_cos": float(cos.min()) if finite else float("nan")}


def records(family: str, seed: int) -> list[str]:
    """Random amino-acid records; ProstT5 also reads every other one as lower-case 3Di; SaProt's
    are structure-aware, each amino acid followed by a random 3Di state (``MdEvVp``)."""
    seqs = [seq for _, seq in random_records(LENGTHS, seed)]
    if family == "saprot":
        from embedpipe.model.saprot_spec import THREE_DI

        rng = np.random.default_rng(seed)
        return ["".join(a + b for a, b in zip(seq, rng.choice(list(THREE_DI.rstrip("#")), len(seq)), strict=True))
                for seq in seqs]
    return [s.lower() if family == "prostt5" and i % 2 else s for i, s in enumerate(seqs)]


def measure(family: str, policies: list[str], root: Path, seed: int = 0) -> list[dict[str, Any]]:
    """One row per (policy, layer) of ``family``: the three measures at the first, middle and last layer."""
    from embedpipe.model import load_model
    from embedpipe.model.layout import layout_of
    from embedpipe.runtime import int8_policy  # noqa: F401 - registers int8-mixed
    from embedpipe.runtime.precision import POLICIES as RUNTIME
    from embedpipe.runtime.precision import forward_context

    path = make_model(family, root, seed)
    model = load_model(str(path))
    seqs = records(family, seed)
    tokens = model.tokenize(seqs)
    layout = layout_of(model)
    pad = int(tokens[int(np.argmin([len(s) for s in seqs])), -1])  # the shortest record's row ends in padding
    n = model.num_layers
    layers = sorted({1, (n + 1) // 2, n})
    lengths = [len(s) // layout.chars_per_residue for s in seqs]  # residues (SaProt: two characters each)
    want = {layer: residue_rows(h, layout.first_residue, lengths)
            for layer, h in reference(family, path, tokens, pad, layers).items()}
    rows = []
    for name in policies:
        policy = RUNTIME[name]
        runner = model.prepare(policy, CPU)
        with torch.inference_mode(), forward_context(policy, CPU):
            hidden = runner(tokens, layers).hidden
        for layer in layers:
            got = residue_rows(hidden[layer].float(), layout.first_residue, lengths)
            rows.append({"family": family, "policy": name, "layer": layer, "layers": n,
                         **compare(got, want[layer])})
    return rows


def cpu_line() -> str:
    """The CPU (model name, the flags that decide the policies), threads, torch: what the numbers were measured on."""
    model, flags = cpu_model()
    return f"{model} ({' '.join(flags) or 'no policy flags'}); {torch.get_num_threads()} threads; torch {torch.__version__}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per family and policy, each measure at the first / middle / last layer."""
    head = ("| family | policy | rel L2 (first / middle / last) | p99.9 abs err | min cos |\n"
            "| --- | --- | --- | --- | --- |")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["policy"]), []).append(r)
    def joined(group: list[dict[str, Any]], key: str, form: str) -> str:
        return " / ".join(format(r[key], form) for r in group)

    body = [f"| `{family}` | `{policy}` | {joined(group, 'rel_l2', '.1e')} | {joined(group, 'p999_abs', '.1e')} | "
            f"{joined(group, 'min_cos', '.5f')} |" for (family, policy), group in groups.items()]
    return "\n".join([head, *body])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="family-parity-") as tmp:
        for family in args.families:
            rows += measure(family, args.policies, Path(tmp), args.seed)
    print(f"CPU: {cpu_line()}")
    print(markdown(rows) if args.markdown else "\n".join(
        f"{r['family']:8} {r['policy']:11} layer {r['layer']}/{r['layers']}  rel L2 {r['rel_l2']:.2e}  "
        f"p99.9 {r['p999_abs']:.2e}  min cos {r['min_cos']:.6f}" for r in rows))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
