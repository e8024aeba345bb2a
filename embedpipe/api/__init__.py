"""embedpipe from Python: :class:`Embedder`, :func:`embed`, :func:`read_fasta`, :func:`search`
and :func:`neighbours`, the options they take (:class:`EmbedOptions`, :class:`FastaLimits`) and
what they return (:class:`Result`, :class:`Hits`) (docs/python.md)."""

from embedpipe.api.embedder import Embedder, embed
from embedpipe.api.querying import neighbours, search
from embedpipe.api.reading import read_fasta
from embedpipe.api.result import Result
from embedpipe.core.options import EmbedOptions, FastaLimits
from embedpipe.neighbours.hits import Hits

__all__ = ["EmbedOptions", "Embedder", "FastaLimits", "Hits", "Result", "embed", "neighbours", "read_fasta", "search"]
