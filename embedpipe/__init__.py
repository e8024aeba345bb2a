"""embedpipe: batch protein-embedding extraction for protein language models (ESM-2, ESM-1b/1v, SaProt, ProtT5,
ProstT5, Ankh, ESM C, ESM++) with numeric-precision provenance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.version import __version__

if TYPE_CHECKING:  # pragma: no cover
    from embedpipe.api import Embedder, Hits, Result, embed, read_fasta, search
    from embedpipe.core.options import EmbedOptions, FastaLimits
    from embedpipe.store.reader import Store, open_store

# not `neighbours` (embedpipe.api.neighbours): the subpackage embedpipe.neighbours takes that name here once
# it is imported; embedpipe.search(index=..., ids=...) calls it
__all__ = ["__version__", "open_store", "Store", "Embedder", "EmbedOptions", "EmbedpipeError", "FastaLimits", "Hits",
           "Result", "embed", "read_fasta", "search"]


if not TYPE_CHECKING:  # hidden from mypy, so that a misspelt name is an error there, not Any

    def __getattr__(name: str) -> Any:
        # Lazy so that `import embedpipe` (and the CLI's start-up) does not pay for h5py/dask/torch.
        if name in ("open_store", "Store"):
            from embedpipe.store import reader

            return getattr(reader, name)
        if name in ("EmbedOptions", "FastaLimits"):  # plain Python: no torch
            from embedpipe.core import options

            return getattr(options, name)
        if name in ("Embedder", "Hits", "Result", "embed", "read_fasta", "search"):  # torch loads only when used
            from embedpipe import api

            return getattr(api, name)
        raise AttributeError(name)
