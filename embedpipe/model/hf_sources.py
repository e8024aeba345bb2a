"""Hugging Face hub names for ``fetch-model`` and the workflow: the local hub cache only.

embedpipe never downloads a Hugging Face model (docs/models.md): a cached name is "fetched"
(its snapshot directory is the answer), any other is the one-line pre-fetch message.
Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from embedpipe.core.errors import ModelError
from embedpipe.core.jsonbounds import load_bounded_json
from embedpipe.model import hf_checkpoint as hf


def download_problem(name: str) -> str | None:
    """``None`` when ``name`` (or a directory) is there; else how to pre-fetch it."""
    try:
        hf.resolve_directory(name)
    except ModelError as exc:
        return str(exc)
    return None


def fetch_model(name: str, dest: Path | None = None) -> Path:
    """The cached snapshot of ``name``; ``--dest`` is refused (the hub cache decides where)."""
    if dest is not None:
        raise ModelError(f"fetch-model {name}: --dest is for fair-esm checkpoints; a Hugging Face model lives in "
                         f"the hub cache ({hf.hub_cache()}; set HF_HOME or HF_HUB_CACHE)")
    return hf.resolve_directory(name)


def model_files(spec: str) -> list[Path]:
    """Every file of the model directory ``spec`` names (given as a directory, or a hub name
    in the local cache: the snapshot's files, symlinks to its blobs, which the output guard
    resolves), and the shards a ``*.index.json`` names, there yet or not; [] for a name not cached."""
    try:
        directory = hf.resolve_directory(spec)
    except ModelError:
        return []
    files = {p for p in directory.rglob("*") if p.is_file()}
    for index in directory.glob("*.index.json"):
        try:
            weight_map = load_bounded_json(index.read_text(), str(index), ModelError).get("weight_map")
        except (OSError, ValueError, AttributeError, ModelError):
            continue  # the loader says what is wrong with it, in one line
        if isinstance(weight_map, dict):
            files |= {directory / str(name) for name in weight_map.values()}
    return sorted(files)
