"""The recipes a user runs on a Hugging Face protein model, for benchmarks/family_throughput.py.

Each runs in its own child process (``family_throughput.py --run-recipe FAMILY MODEL FASTA OUT``)
and writes what ProtTrans' ``prott5_embedder.py --per_protein 1`` writes: one HDF5 file with
one dataset per sequence id holding its mean embedding (fp32), plus the attribute
``padding_efficiency`` (real tokens / computed tokens) and ``attention`` (transformers' attention
implementation: its default, ``sdpa``, for T5 and ESM alike in transformers 5).

* **prot-t5**: ``prott5_embedder.py``'s logic. ``T5EncoderModel`` and ``T5Tokenizer``
  (``do_lower_case=False``; transformers' tokenizers-backed class reads ``tokenizer.json``),
  fp32 on the CPU, sequences sorted by length (longest first) and cut into batches of at most
  100 sequences and 4000 residues (a sequence over 1000 residues alone), ``re.sub("[UZOB]",
  "X")``, residues space-separated, ``</s>`` appended by the tokenizer, padding to the
  longest, mean over the first ``len(seq)`` rows of ``last_hidden_state`` (``</s>`` and
  padding excluded).
* **ankh**: the same with Ankh's tokenization (its README): ``list(seq)`` with
  ``is_split_into_words=True`` (one token per character, no spaces), ``</s>`` appended.
* **hf-esm**: the same batching with ``EsmModel`` (``add_pooling_layer=False``, transformers'
  default SDPA attention) and its ``EsmTokenizer`` (``<cls>`` ... ``<eos>``), mean over rows
  ``1 .. len(seq)``.
* **esmc**: the same batching with transformers' ``EsmcModel`` (its default SDPA attention) and
  ``EsmcTokenizer`` (``<cls>`` ... ``<eos>``), mean over rows ``1 .. len(seq)``; ``esmc:bf16`` runs
  the model cast to bf16 (as a user with ``dtype=torch.bfloat16`` does), means in fp32.

Sequence ids are the header's first word (ProtTrans keeps the whole header line).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

#: prott5_embedder.py's defaults
MAX_RESIDUES = 4000
MAX_SEQ_LEN = 1000
MAX_BATCH = 100
FAMILIES = ("prot-t5", "ankh", "hf-esm", "esmc")


def read_fasta(path: Path) -> dict[str, str]:
    """id (first header word) -> sequence, upper-cased, gaps dropped (as prott5_embedder.py reads)."""
    seqs: dict[str, str] = {}
    current = None
    for line in Path(path).read_text().splitlines():
        if line.startswith(">"):
            current = line[1:].split()[0]
            seqs[current] = ""
        elif current is not None:
            seqs[current] += "".join(line.split()).upper().replace("-", "")
    return seqs


def prott5_batches(seqs: dict[str, str]) -> Iterator[list[tuple[str, str]]]:
    """prott5_embedder.py's batches: longest first; a batch closes at 100 sequences, at 4000
    residues (counting the last sequence twice, as the script does), or after a sequence
    over 1000 residues."""
    ordered = sorted(seqs.items(), key=lambda kv: len(kv[1]), reverse=True)
    batch: list[tuple[str, str]] = []
    for index, (sid, seq) in enumerate(ordered, 1):
        batch.append((sid, seq))
        n_res = sum(len(s) for _, s in batch) + len(seq)
        if len(batch) >= MAX_BATCH or n_res >= MAX_RESIDUES or index == len(ordered) or len(seq) > MAX_SEQ_LEN:
            yield batch
            batch = []


def load(family: str, model_dir: Path):
    """(model, tokenizer) as the family's recipe loads them: fp32, eval mode."""
    import torch
    from transformers import AutoTokenizer, EsmcModel, EsmModel, T5EncoderModel, T5Tokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # EsmForMaskedLM -> EsmModel lists the unused lm_head
    logging.disable_progress_bar()
    if family == "hf-esm":
        model = EsmModel.from_pretrained(str(model_dir), add_pooling_layer=False)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    elif family == "esmc":
        model = EsmcModel.from_pretrained(str(model_dir), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    else:
        model = T5EncoderModel.from_pretrained(str(model_dir))
        tokenizer = (T5Tokenizer.from_pretrained(str(model_dir), do_lower_case=False) if family == "prot-t5"
                     else AutoTokenizer.from_pretrained(str(model_dir)))
    return model.to(torch.float32).eval(), tokenizer


def encode(family: str, tokenizer, seqs: list[str]) -> dict:
    """The batch's input ids and attention mask, tokenized as the family's recipe does."""
    if family == "prot-t5":
        spaced = [" ".join(re.sub(r"[UZOB]", "X", s)) for s in seqs]
        return tokenizer(spaced, add_special_tokens=True, padding="longest", return_tensors="pt")
    if family == "ankh":
        return tokenizer([list(s) for s in seqs], add_special_tokens=True, padding="longest",
                         is_split_into_words=True, return_tensors="pt")
    return tokenizer(seqs, add_special_tokens=True, padding="longest", return_tensors="pt")


def run_recipe(family: str, model_dir: Path, fasta: Path, out: Path, threads: int) -> None:
    """Embed ``fasta`` the family's recipe way into ``out`` (one dataset of means per id);
    ``family:bf16`` runs the model cast to bf16."""
    import h5py
    import torch

    family, _, dtype = family.partition(":")
    if family not in FAMILIES or dtype not in ("", "bf16"):
        raise SystemExit(f"unknown family {family!r} (or dtype {dtype!r})")
    torch.set_num_threads(threads)
    model, tokenizer = load(family, model_dir)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    first = 1 if family in ("hf-esm", "esmc") else 0  # ESM rows start after <cls>; T5 has no BOS
    means, real, computed = {}, 0, 0
    with torch.no_grad():
        for batch in prott5_batches(read_fasta(fasta)):
            ids, seqs = zip(*batch)
            inputs = encode(family, tokenizer, list(seqs))
            hidden = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
            computed += inputs["input_ids"].numel()
            real += int(inputs["attention_mask"].sum())
            for i, (sid, seq) in enumerate(batch):
                means[sid] = hidden[i, first : first + len(seq)].float().mean(0).numpy()
    with h5py.File(out, "w") as f:
        for sid, mean in means.items():
            f.create_dataset(sid, data=mean)
        f.attrs["padding_efficiency"] = real / computed
        f.attrs["attention"] = str(getattr(model.config, "_attn_implementation", None) or "eager")


def read_recipe(path: Path) -> dict:
    """id -> mean vector of a recipe's output file."""
    import h5py
    import numpy as np

    with h5py.File(path, "r") as f:
        return {sid: np.asarray(f[sid][()], dtype=np.float32) for sid in f}
