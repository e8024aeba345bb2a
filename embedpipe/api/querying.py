"""Queries embedded as an index's store was, then searched: ``embedpipe.search`` and
``embedpipe search`` (the Embedder's own is :meth:`embedpipe.api.embedder.Embedder.search`).

Why the defaults come from the index: a user who indexed a store should not have to repeat its
model and options to search it; what they do name is compared (:mod:`embedpipe.api.compatible`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embedpipe.api.compatible import STORE_OPTIONS
from embedpipe.api.embedder import Embedder
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import FASTA_LIMITS, FastaLimits
from embedpipe.core.output_guard import headed, writing_outputs
from embedpipe.inputs.fasta import read_sequences
from embedpipe.inputs.memory import Sequences
from embedpipe.model.registry import model_files
from embedpipe.neighbours.hits import HEADER, Hits
from embedpipe.neighbours.index_file import IndexMeta, LoadedIndex, ids_path, meta_path, open_index, read_meta

__all__ = ["query_options", "search", "search_fasta"]


def query_options(meta: IndexMeta, given: Mapping[str, Any]) -> dict[str, Any]:
    """The queries' options: the index's layer, pooling and policy and the store's options that
    decide its numbers, each replaced by one ``given`` (then compared:
    :func:`embedpipe.api.compatible.check_compatible`)."""
    known = set(meta.options)
    options: dict[str, Any] = {k: meta.options[k] for k in STORE_OPTIONS if k in known}
    if isinstance(options.get("int8_calibration"), str) and not Path(options["int8_calibration"]).is_file():
        options.pop("int8_calibration")  # moved since: the identity compares the set's bytes, not its path
    options |= {"precision": meta.precision_policy, "layers": (meta.layer,),
                "pooling": ("mean",) if meta.pooling == "mean" else ("mean", meta.pooling)}
    return options | {k: v for k, v in given.items() if v is not None}


def _embedder(loaded: LoadedIndex, model: str | Path | None, quiet: bool, limits: FastaLimits,
              options: Mapping[str, Any]) -> Embedder:
    """An Embedder of the queries: the index's model and options unless given; its ``limits``
    are the family's rules every query is read by (case, pairs), as ``embed`` reads records."""
    spec = str(model) if model is not None else loaded.meta.model_source
    if not spec:
        raise EmbedpipeError(f"{loaded.path}: records no model; give the model of its store")
    return Embedder(spec, quiet=quiet, limits=limits, **query_options(loaded.meta, options))


def search(queries: Sequences, index: str | Path | LoadedIndex, *, model: str | Path | None = None, k: int = 10,
           quiet: bool = True, limits: FastaLimits = FASTA_LIMITS, **options: Any) -> Hits:
    """One call: embed ``queries`` as the index's store was (its model unless ``model`` is given,
    its options unless named in ``options``) and return each one's ``k`` nearest IDs. The index's
    files are checked whole (:func:`~embedpipe.neighbours.index_file.open_index`) before the
    model loads."""
    loaded = index if isinstance(index, LoadedIndex) else open_index(Path(index))
    with _embedder(loaded, model, quiet, limits, options) as embedder:
        return embedder.search(queries, loaded, k=k)


def search_fasta(queries: Path, index: Path, out: Path, *, model: str | None = None, k: int = 10,
                 quiet: bool = False, limits: FastaLimits = FASTA_LIMITS, **options: Any) -> Hits:
    """``embedpipe search``: the records of the FASTA ``queries``, read by the model family's rules
    as ``embed`` reads them, searched in ``index``, the hits written to the TSV ``out``
    (atomically; never over the queries, the index, its store or the model, and only over an
    earlier search's TSV)."""
    meta = read_meta(Path(index))
    inputs = [Path(queries), Path(index), meta_path(Path(index)), ids_path(Path(index)),
              *([Path(meta.store)] if meta.store else []),
              *model_files(model or meta.model_source)]
    with writing_outputs("search", [("--out", Path(out), headed("a search TSV", "\t".join(HEADER)))], inputs):
        loaded = open_index(Path(index))  # every file checked before the queries are read or embedded
        with _embedder(loaded, model, quiet, limits, options) as embedder:
            records = list(read_sequences(Path(queries), embedder.limits))
            if not records:
                raise EmbedpipeError(f"{queries}: no records to search")
            hits = embedder.search(records, loaded, k=k)
        hits.write_tsv(out)
    return hits
