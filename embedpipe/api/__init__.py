"""embedpipe from Python: :class:`Embedder`, :func:`embed`, :func:`read_fasta`, :func:`search`
and :func:`neighbours` (docs/python.md)."""

from embedpipe.api.embedder import Embedder, embed
from embedpipe.api.querying import neighbours, search
from embedpipe.api.reading import read_fasta
from embedpipe.api.result import Result

__all__ = ["Embedder", "Result", "embed", "neighbours", "read_fasta", "search"]
