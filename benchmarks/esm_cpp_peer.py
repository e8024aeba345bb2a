"""Optional benchmark peer: esm.cpp (PyPI ``esm-cpp``), a C++ ESM-2 engine for CPUs.

Exports the fair-esm checkpoint to a Hugging Face ``EsmForMaskedLM`` directory (safetensors
and config.json; the LM head is not used for embeddings), then runs esm.cpp on it as one
whole process: its fp32 path, or with ``--int8`` its W8A8 path (``Model.quantize_weights()``:
per-channel symmetric int8 weights; no SmoothQuant calibration, which needs its own
calibration set). Each record (truncated at 1022 residues, as the fair-esm recipe) goes
through ``forward_with_hidden_states``, the one call that returns hidden states; the mean over
residues of the last hidden state is written as in the fair-esm recipe (one ``.pt`` per
sequence, ``_stats.json``).

    python benchmarks/esm_cpp_peer.py MODEL FASTA OUT --threads N [--int8]

Needs ``esm_cpp`` and, for the export, ``transformers``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TRUNCATION = 1022


def export(model_path: Path, out_dir: Path) -> Path:
    """``out_dir/model.safetensors`` (with config.json) holding ``model_path``'s weights, made once."""
    target = out_dir / "model.safetensors"
    if target.exists():
        return target
    from hf_esm_peer import convert_to_hf
    from safetensors.torch import save_file
    from transformers import EsmForMaskedLM

    from embedpipe.model import load_model

    encoder = convert_to_hf(load_model(str(model_path)))
    full = EsmForMaskedLM(encoder.config)
    full.esm.load_state_dict(encoder.state_dict(), strict=False)
    state = {name: t.detach().clone().contiguous() for name, t in full.state_dict().items()}
    for name, buffer in full.named_buffers():  # rotary inv_freq is not persistent in HF, esm.cpp reads it
        state.setdefault(name, buffer.detach().clone().contiguous())
    inv_freq = next(t for name, t in state.items() if name.endswith("inv_freq"))
    for i in range(encoder.config.num_hidden_layers):  # per layer, as transformers 4.x named it
        state.setdefault(f"esm.encoder.layer.{i}.attention.self.rotary_embeddings.inv_freq", inv_freq.clone())
    out_dir.mkdir(parents=True, exist_ok=True)
    full.config.save_pretrained(out_dir)
    save_file(state, str(target))
    return target


def run(model_path: Path, fasta: Path, out_dir: Path, threads: int, int8: bool) -> None:
    import esm_cpp
    import numpy as np
    import torch

    from embedpipe.inputs.fasta import read_sequences

    weights = export(model_path, model_path.parent / f"{model_path.stem}-hf")
    model = esm_cpp.Model.load_from_safetensors(str(weights))
    # threads: esm.cpp reads OMP_NUM_THREADS (its num_threads property is read-only); the benchmark sets it
    if int8:
        model.quantize_weights()
    tokenizer = esm_cpp.Tokenizer()
    out_dir.mkdir(parents=True, exist_ok=True)
    layer = model.config.num_hidden_layers
    for rid, seq in read_sequences(fasta):
        n = min(TRUNCATION, len(seq))
        ids = np.asarray(tokenizer.encode(seq[:n]), dtype=np.int32)
        _, hidden = model.forward_with_hidden_states(ids)
        last = np.asarray(hidden[-1]).reshape(len(ids), -1)
        mean = torch.from_numpy(last[1 : n + 1].astype(np.float32).mean(0))
        torch.save({"label": rid, "mean_representations": {layer: mean}}, out_dir / f"{rid.replace('|', '_')}.pt")
    stats = {"padding_efficiency": 1.0, "isa": esm_cpp.current_isa(), "int8": int8}
    (out_dir / "_stats.json").write_text(json.dumps(stats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("fasta", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--int8", action="store_true")
    args = parser.parse_args()
    run(args.model, args.fasta, args.out, args.threads, args.int8)


if __name__ == "__main__":
    main()
