"""The expert override of the engine choices (``EMBEDPIPE_ENGINE``, docs/precision.md "Engine
choices") as tests set it, and an embedder resolved outside a job the way the cross-check
resolves one (``resolve_loaded``), with the override set while the run resolves."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.resolved import resolve_loaded
from embedpipe.model.base import EmbeddingModel
from embedpipe.runtime.engine_override import CHOICES, VARIABLE


def engine_text(**choices: str) -> str:
    """The variable's value for ``choices`` (``attention="math"`` -> ``attention=math``)."""
    return ",".join(f"{key}={value}" for key, value in choices.items())


@contextlib.contextmanager
def engine_override(**choices: str) -> Iterator[None]:
    """``EMBEDPIPE_ENGINE`` set to ``choices`` inside the block (unset with none), then restored."""
    before = os.environ.get(VARIABLE)
    if choices:
        os.environ[VARIABLE] = engine_text(**choices)
    else:
        os.environ.pop(VARIABLE, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = before


def embedder_for(loaded: EmbeddingModel, options: EmbedOptions | dict, device: torch.device, **engine: str) -> Engine:
    """An :class:`Engine` of ``options`` on ``device``, its run resolved by ``resolve_run`` with
    the engine choices given through the override (the derived ones where none are given):
    ``engine``, or the keys of :data:`CHOICES` in an ``options`` dict."""
    if isinstance(options, dict):
        engine = {key: options[key] for key in options if key in CHOICES} | engine
        options = EmbedOptions(**{key: value for key, value in options.items() if key not in CHOICES})
    with engine_override(**engine):
        return Engine(loaded, resolve_loaded(loaded, options, device))
