"""``embedpipe embed``: one FASTA (a shard) into one store, with the worker and provenance.

The worker itself is :mod:`embedpipe.worker`; the model comes from :mod:`embedpipe.model`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from embedpipe import __version__
from embedpipe.atomic import check_output_path
from embedpipe.devices import claim_device
from embedpipe.errors import EmbedpipeError
from embedpipe.fasta import read_sequences
from embedpipe.host_memory import keep_freed_memory
from embedpipe.model import load_model
from embedpipe.model.base import EmbeddingModel
from embedpipe.precision import Policy, dtype_name
from embedpipe.progress import say
from embedpipe.store import StoreWriter, utc_now
from embedpipe.worker import EmbedOptions, Embedder

@dataclass
class EmbedSummary:
    out: Path
    records: int
    residues: int
    seconds: float
    precision: str
    device: str
    fallback: dict[str, int]
    padding_efficiency: float

    def render(self) -> str:
        rate = self.residues / self.seconds if self.seconds > 0 else float("nan")
        fell = sum(self.fallback.values())
        why = ", ".join(f"{k}: {v}" for k, v in sorted(self.fallback.items())) or "none"
        lines = [
            f"embedded {self.records} records ({self.residues} residues) in {self.seconds:.1f}s "
            f"({rate:,.0f} residues/s) with {self.precision} on {self.device} -> {self.out}",
            f"fp32 fallback: {fell} of {self.records} records ({why}); padding efficiency {self.padding_efficiency:.3f}",
        ]
        return "\n".join(lines)


def provenance(loaded: EmbeddingModel, options: EmbedOptions, device: torch.device, policy: Policy,
               layers: list[int], source: Path | None) -> dict:
    """Root attributes: which weights, which numerics, where, with what."""
    islands = "float32" if policy.fp32_islands else ("per-op (autocast)" if policy.autocast else dtype_name(policy.compute_dtype))
    config = asdict(options) | {"model": loaded.source, "input": str(source) if source else None, "layers": layers}
    return {
        "model_name": loaded.name,
        "model_source": loaded.source,
        "model_sha256": loaded.sha256,
        "model_trained": bool(loaded.trained),
        "model_num_layers": loaded.num_layers,
        "precision_policy": policy.name,
        "weight_dtype": dtype_name(policy.weight_dtype),
        "compute_dtype": dtype_name(policy.compute_dtype),
        "island_dtype": islands,
        "fallback_dtype": "float32",
        "attention": options.attention,
        "long_sequences": options.long_sequences,
        "trained_window_residues": loaded.trained_window,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        **loaded.provenance,
        "embedpipe_version": __version__,
        "config": json.dumps(config, sort_keys=True),
    }


def embed_fasta(fasta: Path, *, model: str, out: Path, options: EmbedOptions, quiet: bool = False) -> EmbedSummary:
    """Embed every record of ``fasta`` with ``model`` into the store ``out`` (atomic)."""
    options.validate()
    started = time.perf_counter()
    records = list(read_sequences(Path(fasta)))
    if not records:
        raise EmbedpipeError(f"{fasta}: no records to embed")
    if options.threads:
        torch.set_num_threads(options.threads)
    check_output_path(Path(out))
    with claim_device(options.device) as device:
        if device.type == "cpu":
            keep_freed_memory()  # activations live in host memory: reuse it, no fresh pages per batch
        loaded = load_model(model)  # after the GPU is ours: a waiting job holds no model in memory
        embedder = Embedder(loaded, options, device)
        for note in embedder.notes:
            say(f"warning: {note}", quiet=quiet)
        plan = embedder.plan(records)
        attrs = provenance(loaded, options, device, embedder.policy, embedder.layers, Path(fasta))
        with StoreWriter(
            Path(out),
            ids=[r for r, _ in records],
            sequences=[s for _, s in records],
            residue_rows=plan.rows if options.per_residue else None,
            layers=embedder.layers,
            dim=loaded.embed_dim,
            storage_dtype=options.storage_dtype,
            attrs=attrs,
            pooling=embedder.pooling,
        ) as writer:
            for index, record in embedder.embed(records, plan, quiet=quiet):
                writer.write(index, record)
            fallback = {k.split(":", 1)[1]: v for k, v in embedder.stats.items() if k.startswith("fallback:")}
            writer.set_attrs(
                fallback_count=int(embedder.stats["fallback"]),
                fallback_reasons=json.dumps(fallback, sort_keys=True),
                padding_efficiency=plan.padding_efficiency,
                fallback_device=embedder.fallback_device or "none",
                finished_utc=utc_now(),
            )
    return EmbedSummary(
        out=Path(out),
        records=len(records),
        residues=sum(len(s) for _, s in records),
        seconds=time.perf_counter() - started,
        precision=options.precision,
        device=str(device),
        fallback=fallback,
        padding_efficiency=plan.padding_efficiency,
    )
