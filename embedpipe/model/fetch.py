"""Getting a model name's weights onto this machine, through the family that owns the name.

``embedpipe fetch-model`` and the workflow (``workflows/rules/common.smk``) ask here, not a
family's module: a fair-esm name is downloaded into the torch hub cache
(:mod:`embedpipe.model.downloads`); a Hugging Face hub name is only looked up in the local hub
cache (:mod:`embedpipe.model.hf_sources`: embedpipe never downloads one). The family's
module is imported only when asked (the fair-esm one imports torch).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from embedpipe.core.errors import ModelError
from embedpipe.model import registry


def _sources(spec: str):  # the family's sources module, or None
    family = registry.family_for(spec)
    return importlib.import_module(family.sources) if family.sources else None


def download_problem(spec: str) -> str | None:
    """Why the weights of name ``spec`` cannot be had here (``None``: cached, or fetchable)."""
    sources = _sources(spec)
    return sources.download_problem(spec) if sources is not None else None


def fetch_model(name: str, dest: Path | None = None) -> Path:
    """The weights of model name ``name``, fetched by its family (``dest``: where, if it can choose)."""
    sources = _sources(name)
    if sources is None:
        raise ModelError(f"model {name!r}: its family ({registry.family_for(name).name}) has nothing to fetch; "
                         "pass the model itself")
    return Path(sources.fetch_model(name, dest))
