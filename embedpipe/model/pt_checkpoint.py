"""A model ``.pt`` (or a fair-esm name), told apart by its layout: loading it, its facts.

Three layouts share the suffix: fair-esm's ESM-2 (``cfg``) and ESM-1b / ESM-1v (``args``), both
built by :mod:`embedpipe.model.esm2`, and SaProt's esm-format checkpoint (``config``:
:mod:`embedpipe.model.saprot_checkpoint`), built into the same ESM-2 runner over SaProt's
alphabet. The file is read once, weights-only and memory-mapped (:mod:`embedpipe.model.checkpoint`);
its layout, not its name, decides which of the fair-esm reader's formats of
:data:`embedpipe.model.families.FAMILY_TABLE` it is, and that format's loader builds it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from embedpipe.model import families
from embedpipe.model.checkpoint import load_checkpoint_safely
from embedpipe.model.downloads import checkpoint_sha256, resolve_checkpoint
from embedpipe.model.facts import ModelFacts


def _loader(data: dict[str, Any]) -> ModuleType:
    """The loader of the format the checkpoint's layout says."""
    return importlib.import_module(families.pt_format(data).loader)


def load(spec: str) -> Any:
    """Resolve, checksum and safely load ``spec``: a fresh fp32 CPU model per call (SaProt's
    ``.pt``: a :class:`~embedpipe.model.saprot.SaProtModel`, stores say ``model_format = saprot-esm``)."""
    path = resolve_checkpoint(spec)
    sha = checkpoint_sha256(path)
    data = load_checkpoint_safely(path)
    return _loader(data).load_checkpoint(spec, path, sha, data)


def inspect(facts: ModelFacts) -> ModelFacts:
    """A checkpoint path's facts completed from its config and parameter count (memory-mapped:
    its weights are never read); SaProt's ``.pt`` is family ``saprot`` with SaProt's layout."""
    data = load_checkpoint_safely(Path(facts.spec).expanduser())
    return _loader(data).checkpoint_facts(facts, data)
