"""embedpipe: batch protein-embedding extraction for protein language models (ESM-2, ESM-1b/1v, SaProt, ProtT5,
ProstT5, Ankh, ESM C, ESM++) with numeric-precision provenance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.version import __version__

if TYPE_CHECKING:  # pragma: no cover
    from embedpipe.api import Embedder, Result, embed, neighbours, read_fasta, search
    from embedpipe.store.reader import Store, open_store

__all__ = ["__version__", "open_store", "Store", "Embedder", "EmbedpipeError", "Result", "embed", "neighbours",
           "read_fasta", "search"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import embedpipe` (and the CLI's start-up) does not pay for h5py/dask/torch.
    if name in ("open_store", "Store"):
        from embedpipe.store import reader

        return getattr(reader, name)
    if name in ("Embedder", "Result", "embed", "neighbours", "read_fasta", "search"):  # torch loads only when used
        from embedpipe import api

        return getattr(api, name)
    raise AttributeError(name)
