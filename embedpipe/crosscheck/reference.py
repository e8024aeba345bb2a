"""Step 2 of the cross-check: the sampled records re-embedded in fp32 with the store's model.

The model is the store's own (its checkpoint path or name from the provenance, or
``--model``), checked by sha256; the fp32 ``EmbedOptions`` reproduce the store's layers,
per-residue output, long-sequence handling, attention and batch budget; the GPU is claimed
before the model is loaded, as ``embed`` does (docs/crosscheck.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedpipe.core.devices import claim_device
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions, parse_tokens_per_batch
from embedpipe.core.progress import say
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.resolved import ResolvedRun, resolve_loaded
from embedpipe.model import is_model_name, load_model
from embedpipe.runtime.engine_override import ATTENTION_KERNELS, EngineChoice
from embedpipe.store.reader import Store


@dataclass
class Reference:
    """The fp32 re-run: which model, with which settings, and its records (by sample index)."""

    model_info: dict[str, Any]
    settings: dict[str, Any]
    records: dict[int, Any]
    dim: int


def fp32_reference(st: Store, provenance: dict[str, Any], layers: list[int], sampled: list[dict], device: str,
                   model: str | None, allow_model_mismatch: bool, notes: list[str], quiet: bool) -> Reference:
    """Step 2: the sampled records re-embedded in fp32 with the store's model."""
    with claim_device(device) as gpu:  # before loading: a job waiting for a GPU holds no model
        loaded, model_info = _load_reference_model(provenance, model, allow_model_mismatch, notes, quiet)
        if loaded.embed_dim != st.dim:
            raise EmbedpipeError(
                f"model {model_info['path']} has embedding dim {loaded.embed_dim} but the store holds dim {st.dim}"
            )
        if max(layers) > loaded.num_layers:
            raise EmbedpipeError(
                f"the store holds layer {max(layers)} but model {model_info['path']} has only {loaded.num_layers} layers"
            )
        if not loaded.trained:
            notes.append("the model has random (untrained) weights: a test or smoke run, not a real measurement")
        options, engine, reference = _reference_options(provenance, layers, st.has_per_residue)
        fp32 = _reembed(loaded, resolve_loaded(loaded, options, gpu, engine),
                        [(s["id"], s["sequence"]) for s in sampled], quiet)
    reference["device"] = fp32.pop("device")
    reference["seconds"] = fp32.pop("seconds")
    return Reference(model_info=model_info, settings=reference, records=fp32["records"], dim=int(loaded.embed_dim))


def _load_reference_model(provenance: dict[str, Any], override: str | None, allow_mismatch: bool,
                          notes: list[str], quiet: bool):
    """Load the store's model (or ``override``) and check its sha256 against the store's."""
    recorded = provenance.get("config")
    config = recorded if isinstance(recorded, dict) else {}
    expected = provenance.get("model_sha256")
    name = provenance.get("model_name")
    spec: str | None
    if override is not None:
        spec, how = str(override), "--model"
    else:
        candidates = [config.get("model"), provenance.get("model_source")]
        spec = next((str(c) for c in candidates if c and Path(str(c)).exists()), None)  # a file, or a model directory
        how = "store provenance"
        if spec is None and isinstance(name, str) and is_model_name(name):
            spec = name
        if spec is None:
            where = next((c for c in candidates if c), None)
            raise EmbedpipeError(
                f"the store's model checkpoint {where or '(not recorded)'} is not here; pass --model PATH "
                f"(a checkpoint whose sha256 is {expected or 'recorded in the store'})"
            )
    loaded = load_model(spec)
    matches = bool(expected) and loaded.sha256 == expected
    info = {
        "spec": spec,
        "from": how,
        "path": loaded.source,
        "name": loaded.name,
        "sha256": loaded.sha256,
        "expected_sha256": expected,
        "sha256_matches": matches,
        "trained": bool(loaded.trained),
        "num_layers": int(loaded.num_layers),
    }
    if not expected:
        notes.append("the store records no model_sha256: the reference model could not be verified")
    elif not matches:
        message = (
            f"model {loaded.source} has sha256 {loaded.sha256[:16]}... but the store was made with "
            f"{name or 'a model'} of sha256 {str(expected)[:16]}..."
        )
        if not allow_mismatch:
            raise EmbedpipeError(
                f"{message}; pass the store's checkpoint with --model, or --allow-model-mismatch to compare anyway"
            )
        warning = f"MODEL MISMATCH: {message}; the comparison is not against the store's own model"
        notes.append(warning)
        say(f"embedpipe: WARNING: {warning}", quiet=False)
    return loaded, info


def _reference_options(provenance: dict[str, Any], layers: list[int], per_residue: bool):
    """fp32 ``EmbedOptions`` and engine choices that reproduce the store's pooling, long-sequence
    handling and attention kernel (the rest of the engine derived for this device)."""
    recorded = provenance.get("config")
    config = recorded if isinstance(recorded, dict) else {}
    defaults = EmbedOptions()

    def pick(key: str) -> Any:
        value = config.get(key, provenance.get(key))
        return getattr(defaults, key) if value is None else value

    options = EmbedOptions(
        precision="fp32",
        layers=tuple(int(k) for k in layers),
        per_residue=bool(per_residue),
        tokens_per_batch=parse_tokens_per_batch(str(pick("tokens_per_batch"))),  # auto: sized for this device
        device="auto",
        storage_dtype="float32",
        long_sequences=str(pick("long_sequences")),
    )
    attention = config.get("attention", provenance.get("attention")) or ATTENTION_KERNELS[0]
    if attention not in ATTENTION_KERNELS:
        raise EmbedpipeError(f"the store records attention {attention!r}; this embedpipe runs "
                             f"{', '.join(ATTENTION_KERNELS)}")
    reference = {
        "precision": "fp32",
        "layers": list(options.layers),
        "per_residue": options.per_residue,
        "tokens_per_batch": options.tokens_per_batch,
        "long_sequences": options.long_sequences,
        "attention": attention,
        "tf32": False,
    }
    return options, EngineChoice(attention=str(attention)), reference


def _reembed(loaded, run: ResolvedRun, pairs: list[tuple[str, str]], quiet: bool) -> dict[str, Any]:
    """fp32 forward of ``pairs`` as ``run`` resolved it on the claimed device (the worker's fp32
    policy already pins true fp32 matmuls, no TF32)."""
    started = time.perf_counter()
    out: dict[int, Any] = {}
    device = run.device
    embedder = Engine(loaded, run)
    plan = embedder.plan(pairs)
    for index, record in embedder.embed(pairs, plan, quiet=quiet):
        out[index] = record
    return {"records": out, "device": str(device), "seconds": round(time.perf_counter() - started, 3)}
