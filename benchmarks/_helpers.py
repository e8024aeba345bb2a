"""In-memory weight edits several benchmark scripts share (records, clocks and tables: _harness.py).

A module, not a script (tests/benchmarks/test_benchmark_scripts.py runs only the scripts, no
leading _). Benchmarks import the package and modules like this one, never tests/:
the tests' helpers (tests/helpers/) edit checkpoint files for the CLI and the workflow; a
benchmark that embeds in-process edits the loaded model instead, the same weights without a
second checkpoint on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.resolved import resolve_loaded
from embedpipe.model.base import EmbeddingModel


def edit_weights(loaded: object, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Change an ESM-2's weights in place (``load_model`` of a ``.pt``): ``edit`` gets its state
    dict, tensors aliasing the model's (embedding and LM head tied). Call before building an
    ``Engine``: a policy's prepared copy is made from these weights."""
    model = loaded.model  # type: ignore[attr-defined]
    with torch.no_grad():
        edit(model.state_dict())


def token_rows(loaded: object, values: Mapping[str, float]) -> Callable[[dict[str, torch.Tensor]], None]:
    """An edit for :func:`edit_weights` setting whole rows of ``embed_tokens.weight`` (``{"C": 7e4}``)."""
    alphabet = loaded.alphabet  # type: ignore[attr-defined]

    def edit(state: dict[str, torch.Tensor]) -> None:
        for token, value in values.items():
            state["embed_tokens.weight"][alphabet.get_idx(token)].fill_(float(value))

    return edit


def embedder_for(loaded: EmbeddingModel, options: EmbedOptions, device: torch.device) -> Engine:
    """An ``Engine`` for ``options`` on ``device``, resolved as the cross-check resolves one
    outside a job (``resolve_loaded``: the engine choices derived, ``EMBEDPIPE_ENGINE`` read
    while it resolves, so a benchmark pins one with ``_harness.pinned_engine`` around this call)."""
    return Engine(loaded, resolve_loaded(loaded, options, device))
