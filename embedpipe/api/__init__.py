"""embedpipe from Python: :class:`Embedder`, :func:`embed`, :func:`search` (docs/python.md)."""

from embedpipe.api.embedder import Embedder, embed
from embedpipe.api.querying import search
from embedpipe.api.result import Result

__all__ = ["Embedder", "Result", "embed", "search"]
