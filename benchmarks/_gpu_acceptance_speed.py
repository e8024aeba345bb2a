"""Speed and proteome-proxy sections of benchmarks/gpu_acceptance.py: every system on the same
records in one process, side by side, so the ratios compare like with like. A module, not a
script.

Each system is timed over its embed loop only (tokens in, pooled vectors on the host), after
a warm-up on a few records; model loading and file writing are left out here and counted in
the proxy section, which runs the ``embedpipe embed`` command end to end.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _gpu_acceptance_setup import (
    WINDOW,
    MemoryWindow,
    Stopwatch,
    forward_flops,
    length_scale,
    park_on_host,
    proxy_lengths,
    release,
    write_fasta,
)
from _harness import cosine, pinned_engine, random_records
from _helpers import embedder_for

from embedpipe.core.options import EmbedOptions
from embedpipe.model.esm2 import reset_rotary_caches
from embedpipe.runtime.cuda import BusyTimer, count_syncs

ROOT = Path(__file__).resolve().parent.parent
#: fair-esm's scripts/extract.py default --toks_per_batch (what a recipe user runs)
RECIPE_TOKENS_PER_BATCH = 4096
WARMUP_RECORDS = 4
#: system -> (kind, setting): embedpipe systems give (policy, batch layout asked, attention inputs)
SYSTEMS: dict[str, tuple[str, Any]] = {
    "embedpipe-fp32": ("embedpipe", ("fp32", "auto", "auto")),
    "embedpipe-bf16": ("embedpipe", ("bf16", "auto", "auto")),
    "embedpipe-bf16-mixed": ("embedpipe", ("bf16-mixed", "packed", "auto")),  # the MFU target's configuration
    "embedpipe-bf16-mixed-padded": ("embedpipe", ("bf16-mixed", "padded", "auto")),
    # fp32 q/k/v at the kernel (no flash, no tensor cores): the other side of the attention-inputs trade
    "embedpipe-bf16-mixed-fp32-attention": ("embedpipe", ("bf16-mixed", "padded", "fp32")),
    "embedpipe-fp16-mixed": ("embedpipe", ("fp16-mixed", "auto", "auto")),
    "fair-esm-fp32": ("recipe", torch.float32),
    "fair-esm-fp16": ("recipe", torch.float16),  # after fp32: model.half() is in place
    "hf-sdpa-bf16": ("hf", torch.bfloat16),
}
FLOPS_FORMULA = ("per real token (BOS/EOS included, padding not) per layer: 24*D^2 (2 x the 12*D^2 "
                 "non-embedding weights) + 4*T*D (QK^T and AV, T = the record's tokens); MFU = FLOPs / "
                 "loop seconds / the GPU's dense bf16 peak, for every system (fp32 ones too)")
#: the keys of every system's row (skipped systems have them all, null)
ROW_KEYS = ("skipped", "seconds", "residues_per_s", "tokens_per_batch", "batch_layout", "attention_path",
            "attention_inputs",
            "padding_efficiency", "peak_memory_mib", "peak_memory_kind", "peak_memory_why", "busy_seconds",
            "idle_fraction", "mfu", "mfu_why", "min_cosine_to_fp32", "x_fair_esm_fp32", "x_hf_sdpa_bf16", "fallback",
            "syncs", "syncs_why", "warmup_seconds", "residues_per_s_with_warmup")

#: the keys of the proxy section (besides skipped and shape)
PROXY_KEYS = ("records", "residues", "median_length", "max_length", "records_over_1022", "records_over_5000",
              "chunked_records", "precision", "seconds", "residues_per_s", "peak_rss_mib", "fallback",
              "padding_efficiency", "command")


Loop = Callable[[list[tuple[str, str]], BusyTimer], tuple[dict[str, np.ndarray], Counter]]


# -- the peers' loops ----------------------------------------------------------------------------

def recipe_batches(alphabet: Any, records: list[tuple[str, str]], tokens_per_batch: int) -> Any:
    """fair-esm's extract.py batching: length-sorted batches of at most ``tokens_per_batch``
    tokens, truncation at 1022 residues."""
    from esm.data import FastaBatchedDataset

    dataset = FastaBatchedDataset([r for r, _ in records], [s for _, s in records])
    batches = dataset.get_batch_indices(tokens_per_batch, extra_toks_per_seq=1)
    return torch.utils.data.DataLoader(dataset, collate_fn=alphabet.get_batch_converter(WINDOW),
                                       batch_sampler=batches)


def recipe_loop(model: torch.nn.Module, alphabet: Any, device: torch.device) -> Loop:
    """extract.py's loop: forward, the whole representation to the host, mean per record there."""
    layer = model.num_layers

    def run(records: list[tuple[str, str]], timer: BusyTimer) -> tuple[dict[str, np.ndarray], Counter]:
        out, tokens = {}, Counter()
        with torch.no_grad():
            for labels, strs, toks in recipe_batches(alphabet, records, RECIPE_TOKENS_PER_BATCH):
                toks = toks.to(device, non_blocking=True)
                timer.start(device)
                reps = model(toks, repr_layers=[layer], return_contacts=False)["representations"][layer]
                timer.stop(device)
                reps = reps.to(device="cpu")
                tokens["computed"] += toks.numel()
                for i, label in enumerate(labels):
                    n = min(WINDOW, len(strs[i]))
                    tokens["real"] += n + 2
                    out[label] = reps[i, 1 : n + 1].mean(0).clone().float().numpy()
        return out, tokens

    return run


def hf_loop(model: Any, alphabet: Any, device: torch.device, tokens_per_batch: int) -> Loop:
    """The HF peer as its user would write it: same batching, attention mask, masked mean on
    the device in fp32, one transfer per batch."""

    def run(records: list[tuple[str, str]], timer: BusyTimer) -> tuple[dict[str, np.ndarray], Counter]:
        out, tokens = {}, Counter()
        with torch.inference_mode():
            for labels, strs, toks in recipe_batches(alphabet, records, tokens_per_batch):
                toks = toks.to(device, non_blocking=True)
                mask = toks.ne(alphabet.padding_idx)
                timer.start(device)
                hidden = model(input_ids=toks, attention_mask=mask.long()).last_hidden_state
                timer.stop(device)
                lengths = torch.tensor([min(WINDOW, len(s)) for s in strs], device=device)
                positions = torch.arange(toks.shape[1], device=device)[None, :]
                keep = ((positions >= 1) & (positions <= lengths[:, None])).float()
                means = (torch.einsum("bt,btd->bd", keep, hidden.float()) / lengths[:, None]).cpu().numpy()
                tokens["computed"] += toks.numel()
                tokens["real"] += int(lengths.sum()) + 2 * len(labels)
                out.update(zip(labels, means))
        return out, tokens

    return run


# -- running one system ---------------------------------------------------------------------------------

def timed_loop(loop: Loop, records: list[tuple[str, str]], device: torch.device) -> dict[str, Any]:
    """Warm-up on a few records, then the timed loop with its busy (forward) seconds and the
    host syncs it made (CUDA's sync debug mode)."""
    with Stopwatch(device) as warmup:
        loop(records[:WARMUP_RECORDS], BusyTimer())
    timer = BusyTimer()
    with Stopwatch(device) as watch, count_syncs(device) as syncs:  # its own syncs outside the count
        out, tokens = loop(records, timer)
    return {"outputs": out, "seconds": watch.seconds, "busy_seconds": timer.seconds,
            "padding_efficiency": tokens["real"] / tokens["computed"], "warmup_seconds": warmup.seconds,
            "syncs": syncs.count, "syncs_why": syncs.why}


def run_embedpipe(loaded: Any, records: list[tuple[str, str]], device: torch.device, policy: str,
                  layout: str, attention_inputs: str) -> dict[str, Any]:
    """The Engine under ``policy`` with ``layout`` and ``attention_inputs`` pinned (``EMBEDPIPE_ENGINE``;
    ``auto``: the program's choice); what it reports goes in the row. The warm-up prepares the
    model: ``warmup_seconds`` counts that time."""
    with pinned_engine(batch_layout=layout, attention_inputs=attention_inputs):
        embedder = embedder_for(loaded, EmbedOptions(precision=policy, device=str(device)), device)
    last = loaded.num_layers
    with Stopwatch(device) as warmup:
        list(embedder.embed(records[:WARMUP_RECORDS]))  # prepares the model, warms the kernels
    busy, stats = embedder.busy_seconds, Counter(embedder.stats)
    with Stopwatch(device) as watch, count_syncs(device) as syncs:  # its own syncs outside the count
        out = {records[i][0]: r.mean[last] for i, r in embedder.embed(records)}
    done = embedder.stats - stats
    return {"outputs": out, "seconds": watch.seconds, "busy_seconds": embedder.busy_seconds - busy,
            "warmup_seconds": warmup.seconds, "syncs": syncs.count, "syncs_why": syncs.why,
            "padding_efficiency": done["real_tokens"] / done["computed_tokens"],
            "tokens_per_batch": embedder.tokens_per_batch, "batch_layout": embedder.batch_layout,
            "attention_path": embedder.attention_path, "attention_inputs": embedder.attention_inputs,
            "fallback": done["fallback"]}


def run_recipe(fair: tuple[torch.nn.Module, Any], records: list[tuple[str, str]], device: torch.device,
               dtype: torch.dtype) -> dict[str, Any]:
    """fair-esm's extract.py recipe on the model of fair-esm's own loader, moved to ``device``
    (``model.half()`` for fp16: in place, so the fp16 run comes last, see SYSTEMS); then back
    to the host."""
    model, alphabet = fair
    model.to(device)
    if dtype == torch.float16:
        model.half()
    # fair-esm rebuilds its rotary cos/sin cache on a new length or device, not a new dtype: start
    # clean, as a freshly loaded model does (an fp32 cache would make q, k fp32 in the fp16 run)
    reset_rotary_caches(model)
    result = timed_loop(recipe_loop(model, alphabet, device), records, device)
    model.to("cpu")
    return result | {"tokens_per_batch": RECIPE_TOKENS_PER_BATCH, "batch_layout": "padded",
                     "attention_path": "padded-fair-esm", "attention_inputs": str(dtype).removeprefix("torch.")}


def run_hf(loaded: Any, records: list[tuple[str, str]], device: torch.device, dtype: torch.dtype,
           tokens_per_batch: int) -> dict[str, Any]:
    """HF EsmModel (SDPA) converted from the loaded checkpoint (fused q/k/v are views of the same
    values, so the weights are the file's); out of memory halves its token budget."""
    import hf_esm_peer

    model = hf_esm_peer.convert_to_hf(loaded).to(device, dtype)
    alphabet, attention = loaded.alphabet, hf_esm_peer.attention_implementation(model)
    while True:
        try:
            result = timed_loop(hf_loop(model, alphabet, device, tokens_per_batch), records, device)
            break
        except torch.cuda.OutOfMemoryError:
            pass
        release(device)  # outside the except block: the failed attempt's tensors are gone
        if tokens_per_batch < 2 * (WINDOW + 2):
            raise RuntimeError(f"HF peer: out of memory even at {tokens_per_batch} tokens per batch")
        tokens_per_batch //= 2
    return result | {"tokens_per_batch": tokens_per_batch, "batch_layout": "padded",
                     "attention_path": f"padded-hf-{attention}", "attention_inputs": str(dtype).removeprefix("torch.")}


def skip_reason(name: str, kind: str, device: torch.device) -> str | None:
    if kind == "hf" and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    return None


def run_system(name: str, loaded: Any, fair: tuple[torch.nn.Module, Any], records: list[tuple[str, str]],
               device: torch.device, peer_tokens: int) -> dict[str, Any]:
    """One system's measurement inside its own memory window."""
    kind, setting = SYSTEMS[name]
    park_on_host(loaded)
    release(device)
    memory = MemoryWindow(device)
    if kind == "embedpipe":
        result = run_embedpipe(loaded, records, device, *setting)
    elif kind == "recipe":
        result = run_recipe(fair, records, device, setting)
    else:
        result = run_hf(loaded, records, device, setting, peer_tokens)
    result |= {"peak_memory_mib": memory.peak_mib(), "peak_memory_kind": memory.kind, "peak_memory_why": memory.why}
    release(device)
    return result


# -- the section -------------------------------------------------------------------------------------------



def row(result: dict[str, Any] | None, why: str | None, residues: int, flops: float,
        peak: float | None, peak_why: str | None) -> dict[str, Any]:
    """The JSON row of one system (every key of ROW_KEYS; all null with ``skipped`` = why)."""
    out: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    out["skipped"] = why
    if result is None:
        return out
    out |= {k: result.get(k) for k in ROW_KEYS if k in result}
    seconds = result["seconds"]
    out["residues_per_s"] = residues / seconds
    out["residues_per_s_with_warmup"] = residues / (seconds + result["warmup_seconds"])
    out["idle_fraction"] = 1.0 - result["busy_seconds"] / seconds
    out["mfu"] = flops / seconds / peak if peak else None
    out["mfu_why"] = None if peak else peak_why
    return out


def add_ratios(rows: dict[str, dict[str, Any]], outputs: dict[str, dict[str, np.ndarray]]) -> None:
    """Ratios to the two peers and the pooled cosine to embedpipe fp32, per row."""
    reference = outputs.get("embedpipe-fp32")
    for name, values in rows.items():
        if values["skipped"]:
            continue
        for key, peer in (("x_fair_esm_fp32", "fair-esm-fp32"), ("x_hf_sdpa_bf16", "hf-sdpa-bf16")):
            base = rows.get(peer, {}).get("residues_per_s")
            values[key] = values["residues_per_s"] / base if base else None
        if reference is not None:
            values["min_cosine_to_fp32"] = min(cosine(outputs[name][k], v) for k, v in reference.items())


def shape_speed(loaded: Any, fair: tuple[torch.nn.Module, Any], records: list[tuple[str, str]],
                device: torch.device, peak: float | None, peak_why: str | None,
                log: Callable[[str], None]) -> dict[str, Any]:
    """Every system of SYSTEMS on ``records``, one after the other, same process. ``fair`` is
    fair-esm's own (model, alphabet), left in fp16 afterwards."""
    lengths = [len(s) for _, s in records]
    residues, flops = sum(min(n, WINDOW) for n in lengths), forward_flops(lengths, loaded.num_layers, loaded.embed_dim)
    rows, outputs = {}, {}
    for name, (kind, _) in SYSTEMS.items():
        why = skip_reason(name, kind, device)
        result = None
        if why is None:
            peer_tokens = rows.get("embedpipe-bf16-mixed", {}).get("tokens_per_batch") or RECIPE_TOKENS_PER_BATCH
            result = run_system(name, loaded, fair, records, device, peer_tokens)
            outputs[name] = result.pop("outputs")
            log(f"    {name:<28} {result['seconds']:8.2f} s")
        rows[name] = row(result, why, residues, flops, peak, peak_why)
    add_ratios(rows, outputs)
    return {"records": len(records), "residues": residues, "tokens": sum(min(n, WINDOW) + 2 for n in lengths),
            "flops": flops, "flops_formula": FLOPS_FORMULA, "recipe_tokens_per_batch": RECIPE_TOKENS_PER_BATCH,
            "peer_tokens_per_batch": "embedpipe-bf16-mixed's resolved budget, halved on out of memory",
            "warmup_records": WARMUP_RECORDS, "cosine_reference": "embedpipe-fp32", "systems": rows}


# -- the proteome proxy ------------------------------------------------------------------------------------

def proxy_records(count: int, device: torch.device) -> list[tuple[str, str]]:
    return random_records(proxy_lengths(count, seed=415, scale=length_scale(device)), seed=7, prefix="hp")


def proxy_section(path: Path, device: torch.device, count: int, work: Path, threads: int,
                  limit: float | None = None) -> dict[str, Any]:
    """``embedpipe embed --precision bf16-mixed`` as a whole process on a human-like proteome
    FASTA: start-up, model load, chunking above 1,022, embedding and the store write; stopped
    after ``limit`` seconds (the run's time budget), then ``skipped`` says so."""
    import h5py
    from _gpu_acceptance_budget import timed_with_limit

    records = proxy_records(count, device)
    fasta = write_fasta(work / f"proxy-{count}.fasta", records)
    store = work / f"proxy-{count}.h5"
    store.unlink(missing_ok=True)
    command = [sys.executable, "-m", "embedpipe.cli", "embed", str(fasta), "--model", str(path), "--out", str(store),
               "--precision", "bf16-mixed", "--device", str(device), "--threads", str(threads), "--quiet"]
    import embedpipe

    same = str(Path(embedpipe.__file__).resolve().parent.parent)  # the child imports this process's embedpipe
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [same, os.environ.get("PYTHONPATH")])))
    seconds, peak_rss, stopped = timed_with_limit(command, env, limit)
    if stopped:
        return dict.fromkeys(PROXY_KEYS) | {"skipped": stopped, "peak_rss_mib": peak_rss}
    with h5py.File(store, "r") as f:
        attrs = dict(f.attrs)
        handling = Counter(x.decode() if isinstance(x, bytes) else str(x) for x in f["long_handling"][()])
    lengths = [len(s) for _, s in records]
    residues = sum(lengths)
    return {"skipped": None, "records": count, "residues": residues, "median_length": float(np.median(lengths)),
            "max_length": max(lengths), "records_over_1022": sum(n > WINDOW for n in lengths),
            "records_over_5000": sum(n > 5000 for n in lengths), "chunked_records": handling.get("chunked", 0),
            "precision": "bf16-mixed", "seconds": seconds, "residues_per_s": residues / seconds,
            "peak_rss_mib": peak_rss, "fallback": int(attrs.get("fallback_count", 0)),
            "padding_efficiency": float(attrs.get("padding_efficiency", float("nan"))),
            "command": f"embedpipe embed {fasta.name} --model {path.name} --out {store.name} --precision bf16-mixed "
                       f"--device {device} --threads {threads} --quiet (tokens per batch auto)"}
