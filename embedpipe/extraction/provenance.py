"""What a store records about how it was made (docs/store-format.md, root attributes): the
weights, the numerics, the device and the software, and how the batches ran."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from embedpipe.core import cpus
from embedpipe.core.version import __version__
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.resolved import ResolvedRun
from embedpipe.model import capabilities
from embedpipe.model.base import EmbeddingModel
from embedpipe.runtime.attention import invariance_attrs
from embedpipe.store.format import chars_attr


def provenance(loaded: EmbeddingModel, run: ResolvedRun, source: Path | None) -> dict:
    """Root attributes: which weights, which numerics, where, with what (all as the run resolved them)."""
    options, device = run.options, run.device
    config = asdict(options) | {"model": loaded.source, "input": str(source) if source else None,
                                "layers": list(run.layers)}
    return {
        "model_name": loaded.name,
        "model_family": loaded.family,
        "model_source": loaded.source,
        "model_sha256": loaded.sha256,
        "model_trained": bool(loaded.trained),
        "model_num_layers": loaded.num_layers,
        **run.policy.provenance(),  # precision_policy, weight/compute/island dtypes (int8: its scheme)
        "fallback_dtype": "float32",
        "attention": run.attention,
        "long_sequences": options.long_sequences,
        "trained_window_residues": loaded.trained_window,
        **chars_attr(capabilities.layout_of(loaded).chars_per_residue),  # SaProt: 2 (store/format.py)
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "platform": run.platform,  # what decides the numbers besides the options (embed_identity holds it too)
        **cpus.provenance(run.threads),  # threads, threads_from
        **loaded.provenance,
        "embedpipe_version": __version__,
        "config": json.dumps(config, sort_keys=True),
    }


def batching_attrs(embedder: Engine) -> dict[str, Any]:
    """Root attributes of how the batches ran (docs/store-format.md): the resolved token budget
    (``config`` keeps ``auto`` as given), the layout, attention path and q/k/v dtype. Read once
    the forward has run, when the embedder's choices are final."""
    return {
        "tokens_per_batch": int(embedder.tokens_per_batch),
        "batch_layout": embedder.batch_layout,
        "attention_path": embedder.attention_path,
        "attention_inputs": embedder.attention_inputs,
        **invariance_attrs(embedder.attention_path, embedder.device),  # batch_invariant, batch_tile_rows
        **embedder.runner_provenance,  # int8-mixed: quantization_fp32_layers
    }
