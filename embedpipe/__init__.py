"""embedpipe: batch protein-embedding extraction with ESM-2 and numeric-precision provenance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from embedpipe.core.version import __version__

if TYPE_CHECKING:  # pragma: no cover
    from embedpipe.store.reader import Store, open_store

__all__ = ["__version__", "open_store", "Store"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import embedpipe` (and the CLI's start-up) does not pay for h5py/dask/torch.
    if name in ("open_store", "Store"):
        from embedpipe.store import reader

        return getattr(reader, name)
    raise AttributeError(name)
