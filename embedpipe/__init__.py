"""embedpipe: batch protein-embedding extraction for protein language models (ESM-2, ESM-1b/1v, SaProt, ProtT5,
ProstT5, Ankh, ESM C, ESM++) with numeric-precision provenance."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

from embedpipe import embed as _embed_package  # torch-free: its __init__ is a docstring
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.version import __version__

if TYPE_CHECKING:  # pragma: no cover
    from embedpipe.api import Embedder, Result, read_fasta, search
    from embedpipe.store.reader import Store, open_store

__all__ = ["__version__", "open_store", "Store", "Embedder", "EmbedpipeError", "Result", "embed", "read_fasta", "search"]


class _CallablePackage(types.ModuleType):
    """``embedpipe.embed`` is both the package of the ``embed`` command and, called, the API's
    one-call :func:`embedpipe.api.embed`: once the package is imported Python finds it before this
    module's ``__getattr__``, so the package itself answers the call."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from embedpipe.api import embed

        return embed(*args, **kwargs)


_embed_package.__class__ = _CallablePackage


def __getattr__(name: str) -> Any:
    # Lazy so that `import embedpipe` (and the CLI's start-up) does not pay for h5py/dask/torch.
    if name in ("open_store", "Store"):
        from embedpipe.store import reader

        return getattr(reader, name)
    if name in ("Embedder", "Result", "read_fasta", "search"):  # torch loads only when the API is used
        from embedpipe import api

        return getattr(api, name)
    raise AttributeError(name)
