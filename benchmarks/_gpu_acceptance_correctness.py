"""Correctness section of benchmarks/gpu_acceptance.py: before any speed is worth quoting, the
packed and padded layouts must equal fair-esm's own forward, every policy must give finite
numbers, a record's vector must not depend on its batch, and the fp16 overflow fallback must
stay exact. A module, not a script."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _gpu_acceptance_setup import checkpoint, release
from _harness import cosine, pinned_engine, random_records
from _helpers import edit_weights, embedder_for, token_rows

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import POLICY_NAMES, EmbedOptions
from embedpipe.extraction.engine import Engine
from embedpipe.runtime.precision import get_policy, true_fp32_matmuls

#: max |difference| allowed between fp32 outputs of two exact computations (TF32 off)
TOLERANCE = 1e-4
#: bf16-mixed packed (on CUDA the varlen flash kernel) against padded (SDPA with a mask):
#: two bf16 computations of the same thing, apart by rounding only. Pooled vectors: cosine at
#: least this; per residue: max |difference| within this share of the record's largest value
#: (2^-5: a few bf16 steps, which have 2^-8 relative precision, over 30+ layers)
MIXED_MIN_COSINE = 0.9999
MIXED_MAX_RELATIVE_DIFF = 2.0**-5
#: records embedded alone for the batch-invariance check (shortest, middle, longest)
INVARIANCE_RECORDS = 3
#: policies whose fp16 weights turn the overflow model's 7e4 'C' row into inf
OVERFLOW_POLICIES = ("fp16", "fp16-mixed")
#: the overflow model's shape on every device: small, so that only the 'C' row can overflow
#: (a deep random-weight model's own activations might, and blur which records should fall back)
OVERFLOW_DIMS = (2, 64, 4)


def reported(embedder: Engine) -> dict[str, Any]:
    """What the Engine says it ran: the JSON records it so a test can check packed was packed."""
    return {"batch_layout": embedder.batch_layout, "attention_path": embedder.attention_path,
            "attention_inputs": embedder.attention_inputs, "tokens_per_batch": embedder.tokens_per_batch}


def fair_esm_residues(fair: tuple[torch.nn.Module, Any], records: list[tuple[str, str]],
                      device: torch.device) -> dict[int, np.ndarray]:
    """fair-esm's own forward (its own loader's model), each record alone, fp32 with TF32 off:
    last-layer residue vectors. The model goes back to the host afterwards."""
    model, alphabet = fair
    model.to(device)
    converter, last, out = alphabet.get_batch_converter(), model.num_layers, {}
    with torch.no_grad(), true_fp32_matmuls():
        for index, (rid, seq) in enumerate(records):
            _, _, toks = converter([(rid, seq)])
            reps = model(toks.to(device), repr_layers=[last])["representations"][last]
            out[index] = reps[0, 1 : len(seq) + 1].float().cpu().numpy()
    model.to("cpu")
    release(device)
    return out


def max_diff(a: dict[int, Any], b: dict[int, Any], pick) -> float:
    """Largest |a - b| over the records both hold, after ``pick`` (mean or per-residue)."""
    return max(float(np.max(np.abs(pick(a[i]) - pick(b[i])))) for i in a)




def layouts_section(loaded: Any, fair: tuple[torch.nn.Module, Any], records: list[tuple[str, str]],
                    device: torch.device) -> dict:
    """fp32 packed vs padded vs fair-esm: mean and per-residue max |difference| of the last layer."""
    last = loaded.num_layers
    reference = fair_esm_residues(fair, records, device)
    means = {i: r.mean(0) for i, r in reference.items()}
    outputs, section = {}, {}
    for layout in ("packed", "padded"):
        with pinned_engine(batch_layout=layout):
            embedder = embedder_for(loaded, EmbedOptions(precision="fp32", per_residue=True, device=str(device)), device)
        outputs[layout] = dict(embedder.embed(records))
        got = outputs[layout]
        mean_diff = max(float(np.max(np.abs(got[i].mean[last] - means[i]))) for i in means)
        residue_diff = max(float(np.max(np.abs(got[i].per_residue[last] - reference[i]))) for i in reference)
        section[layout] = {"asked": layout, **reported(embedder),
                           "max_abs_diff_mean_vs_fair_esm": mean_diff,
                           "max_abs_diff_per_residue_vs_fair_esm": residue_diff,
                           "within_tolerance": max(mean_diff, residue_diff) <= TOLERANCE}
        del embedder
    packed_vs_padded = max_diff(outputs["packed"], outputs["padded"], lambda r: r.per_residue[last])
    return {"tolerance": TOLERANCE, "tf32": False, **section,
            "max_abs_diff_packed_vs_padded": packed_vs_padded,
            "packed_equals_padded": packed_vs_padded <= TOLERANCE}


def mixed_layouts_section(loaded: Any, records: list[tuple[str, str]], device: torch.device) -> dict:
    """bf16-mixed packed against padded, last layer: on CUDA this is varlen flash against SDPA
    (fp32 packed on CUDA runs the per-sequence stand-in, so the fp32 comparison never sees flash)."""
    last, outputs, paths = loaded.num_layers, {}, {}
    for layout in ("packed", "padded"):
        with pinned_engine(batch_layout=layout):
            embedder = embedder_for(loaded, EmbedOptions(precision="bf16-mixed", per_residue=True, device=str(device)), device)
        outputs[layout] = dict(embedder.embed(records))
        paths[layout] = embedder.attention_path
        del embedder
        release(device)
    packed, padded = outputs["packed"], outputs["padded"]
    cos = min(cosine(packed[i].mean[last], padded[i].mean[last]) for i in packed)
    relative = max(float(np.max(np.abs(packed[i].per_residue[last] - padded[i].per_residue[last]))
                         / max(float(np.max(np.abs(padded[i].per_residue[last]))), 1e-30)) for i in packed)
    return {"packed_attention_path": paths["packed"], "padded_attention_path": paths["padded"],
            "min_cosine_tolerance": MIXED_MIN_COSINE, "max_relative_diff_tolerance": MIXED_MAX_RELATIVE_DIFF,
            "min_pooled_cosine": cos, "max_relative_diff_per_residue": relative,
            "within_tolerance": cos >= MIXED_MIN_COSINE and relative <= MIXED_MAX_RELATIVE_DIFF}


def invariance_picks(records: list[tuple[str, str]]) -> list[int]:
    """Indices of the shortest, a middle and the longest record (the batch's extremes)."""
    order = sorted(range(len(records)), key=lambda i: len(records[i][1]))
    picks = [order[0], order[len(order) // 2], order[-1]]
    return list(dict.fromkeys(picks))[:INVARIANCE_RECORDS]


def runnable_policies(device: torch.device) -> list[str]:
    """The policies ``device`` runs (``int8-mixed`` is CPU-only: refused on CUDA), fp32 first."""
    names = []
    for name in POLICY_NAMES:
        try:
            get_policy(name).check_device(device)
        except EmbedpipeError:
            continue
        names.append(name)
    return names


def policies_section(loaded: Any, records: list[tuple[str, str]], device: torch.device) -> dict:
    """Every policy on the same records: finite, cosine to fp32, and batch invariance (a record
    alone vs inside the full batch, same Engine)."""
    last, section, reference = loaded.num_layers, {}, None
    for policy in runnable_policies(device):
        embedder = embedder_for(loaded, EmbedOptions(precision=policy, device=str(device)), device)
        full = dict(embedder.embed(records))
        if policy == "fp32":  # first in POLICY_NAMES: the reference of the others
            reference = full
        alone_diffs, equal = [], True
        for index in invariance_picks(records):
            (_, alone), = embedder.embed([records[index]])
            alone_diffs.append(float(np.max(np.abs(alone.mean[last] - full[index].mean[last]))))
            equal &= bool(np.array_equal(alone.mean[last], full[index].mean[last]))
        batchings = two_batchings(loaded, records, policy, device, full)
        section[policy] = {
            **reported(embedder),
            "finite": all(bool(np.isfinite(r.mean[last]).all()) for r in full.values()),
            "fallback": int(embedder.stats["fallback"]),
            "min_cosine_to_fp32": min(cosine(full[i].mean[last], reference[i].mean[last]) for i in full),
            "batch_invariance": {"records": len(alone_diffs), "max_abs_diff": max(alone_diffs), "equal": equal},
            "two_batchings": batchings,
        }
        del embedder
        release(device)
    return section


def two_batchings(loaded: Any, records: list[tuple[str, str]], policy: str, device: torch.device,
                  full: dict) -> dict:
    """Every record embedded again in small batches (a budget of about two of the longest
    records) by a fresh Engine: its pooled last layer bit-identical to the full batch's
    (docs/precision.md, "Reproducibility"). Records that fell back are compared too."""
    last = loaded.num_layers
    budget = max(2 * (max(len(s) for _, s in records) + 2), 64)
    embedder = embedder_for(loaded, EmbedOptions(precision=policy, device=str(device), tokens_per_batch=budget), device)
    small = dict(embedder.embed(records))
    batches = int(embedder.stats["batches"])
    del embedder
    release(device)
    differ = [i for i in full if not np.array_equal(small[i].mean[last], full[i].mean[last])]
    diff = max(float(np.max(np.abs(small[i].mean[last] - full[i].mean[last]))) for i in full)
    return {"tokens_per_batch": budget, "batches": batches, "records_not_bit_equal": len(differ),
            "max_abs_diff": diff, "equal": not differ}


def shape_correctness(loaded: Any, fair: tuple[torch.nn.Module, Any], records: list[tuple[str, str]],
                      device: torch.device) -> dict:
    """The correctness of one shape: layouts against fair-esm, bf16-mixed packed against
    padded, then every policy."""
    return {"records": len(records), "residues": sum(len(s) for _, s in records),
            **layouts_section(loaded, fair, records, device),
            "bf16_mixed_packed_vs_padded": mixed_layouts_section(loaded, records, device),
            "policies": policies_section(loaded, records, device)}


# -- fp16 overflow fallback --------------------------------------------------------------------------

def overflow_records(count: int) -> list[tuple[str, str]]:
    """Records without 'C', and every third one with a single 'C' (the 7e4 row) inserted."""
    records = random_records([40 + 13 * i for i in range(count)], seed=8, prefix="ovf")
    records = [(rid, seq.replace("C", "A")) for rid, seq in records]
    return [(rid, seq[:10] + "C" + seq[10:]) if i % 3 == 1 else (rid, seq) for i, (rid, seq) in enumerate(records)]


def overflow_model(directory: Path, dims: tuple[int, int, int]) -> Any:
    """A random ESM-2 whose 'C' embedding row is 7e4: inf in fp16 (max 65504), finite in fp32;
    the row set in the loaded model (benchmarks/_helpers.py)."""
    from embedpipe.model import load_model

    loaded = load_model(str(checkpoint(directory, dims, seed=21)))
    edit_weights(loaded, token_rows(loaded, {"C": 7e4}))
    return loaded


def overflow_section(device: torch.device, count: int, dims: tuple[int, int, int] = OVERFLOW_DIMS) -> dict:
    """Records with 'C' fall back to fp32 under the fp16-weight policies, and their stored
    vectors equal an fp32 run of the record alone bit for bit (mean and per-residue)."""
    records = overflow_records(count)
    with_c = {i for i, (_, seq) in enumerate(records) if "C" in seq}
    with tempfile.TemporaryDirectory() as tmp:
        loaded = overflow_model(Path(tmp), dims)
        fp32 = embedder_for(loaded, EmbedOptions(precision="fp32", per_residue=True, device=str(device)), device)
        alone = {i: next(iter(fp32.embed([records[i]])))[1] for i in sorted(with_c)}
        section = {"shape": dict(zip(("layers", "dim", "heads"), dims)), "records": len(records),
                   "records_with_c": len(with_c), "policies": {}}
        last = loaded.num_layers
        for policy in OVERFLOW_POLICIES:
            embedder = embedder_for(loaded, EmbedOptions(precision=policy, per_residue=True, device=str(device)), device)
            out = dict(embedder.embed(records))
            fell = {i for i, r in out.items() if r.precision_used == "fp32"}
            diffs = [float(np.max(np.abs(out[i].per_residue[last] - alone[i].per_residue[last]))) for i in fell & with_c]
            exact = all(np.array_equal(out[i].mean[last], alone[i].mean[last])
                        and np.array_equal(out[i].per_residue[last], alone[i].per_residue[last]) for i in fell & with_c)
            section["policies"][policy] = {
                "fallback": len(fell), "fallback_ids_match": fell == with_c,
                "reasons": dict(Counter(out[i].fallback_reason for i in fell)),
                "finite": all(bool(np.isfinite(r.mean[last]).all()) for r in out.values()),
                "max_abs_diff_vs_fp32_alone": max(diffs) if diffs else None,
                "exact": bool(fell) and exact, "batch_layout": embedder.batch_layout,
            }
            del embedder
        del fp32, loaded
        release(device)
    return section

