"""The Hugging Face extra's packages (safetensors, tokenizers, transformers), imported when a
family needs them, or a one-line error naming the extra that brings them (docs/models.md)."""

from __future__ import annotations

import importlib
from types import ModuleType

from embedpipe.core.errors import ModelError

EXTRA = "pip install 'embedpipe[hf]'"


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` for ``what``, or a one-line error naming the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModelError(f"{what} needs the Python package {module!r}, which is not installed: {EXTRA}") from None
