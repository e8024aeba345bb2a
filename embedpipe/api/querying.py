"""Queries embedded as an index's store was, then searched: ``embedpipe.search`` and
``embedpipe search`` (the Embedder's own is :meth:`embedpipe.api.embedder.Embedder.search`);
or records the store holds, named by ID, searched with their stored vectors (:func:`neighbours`,
``search(ids=...)``, ``embedpipe search --ids``: no model).

Why the defaults come from the index: a user who indexed a store should not have to repeat its
model and options to search it; what they do name is compared (:mod:`embedpipe.api.compatible`).
Why an ID query loads nothing: its vector is in the store, as indexed
(:mod:`embedpipe.neighbours.stored`); embedding the record again could only differ.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from embedpipe.api.choices import merged_options
from embedpipe.api.compatible import STORE_OPTIONS
from embedpipe.api.embedder import Embedder, Input
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import FASTA_LIMITS, EmbedOptions, FastaLimits
from embedpipe.core.output_guard import Output, headed, writing_outputs
from embedpipe.inputs.fasta import read_sequences
from embedpipe.model.registry import model_files
from embedpipe.neighbours.hits import GROUPED_HEADER, HEADER, Hits
from embedpipe.neighbours.index_file import IndexMeta, LoadedIndex, ids_path, meta_path, open_index, read_meta
from embedpipe.neighbours.stored import stored_neighbours

__all__ = ["check_query_input", "neighbours", "parse_ids", "query_options", "search", "search_fasta", "search_ids"]

#: what ``search --out`` replaces: an earlier search's TSV (collapsed or not)
_TSV = headed("a search TSV", "\t".join(HEADER), "\t".join(GROUPED_HEADER))


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


def _embedder(loaded: LoadedIndex, model: str | os.PathLike[str] | None, quiet: bool, limits: FastaLimits,
              options: Mapping[str, Any]) -> Embedder:
    """An Embedder of the queries: the index's model and options unless given (``options``: the
    fields the user set, :func:`~embedpipe.api.choices.merged_options`); its ``limits`` are the
    family's rules every query is read by (case, pairs), as ``embed`` reads records."""
    spec = str(model) if model is not None else loaded.meta.model_source
    if not spec:
        raise EmbedpipeError(f"{loaded.path}: records no model; give the model of its store")
    return Embedder(spec, quiet=quiet, limits=limits, options=EmbedOptions(**query_options(loaded.meta, options)))


def _named(precision: str | None, layers: int | Sequence[int] | None, storage_dtype: str | None,
           device: str | None) -> dict[str, object]:
    """The keywords of embedding the queries that ``search`` names, as :func:`merged_options` takes them."""
    return {"precision": precision, "layers": layers, "storage_dtype": storage_dtype, "device": device}


def check_query_input(queries: bool, ids: bool, include_self: bool, embedding: Iterable[str], *,
                      cli: bool = False) -> None:
    """Queries to embed or IDs of stored records, one of the two; ``include_self`` only with
    IDs; no option of embedding (``embedding``: those given) with IDs. One line else, in the
    command's words (``cli``) or the function's."""
    name = (lambda option: f"--{option.replace('_', '-')}") if cli else (lambda option: f"{option}=")
    fasta = "a FASTA of queries" if cli else "queries"
    if queries and ids:
        raise EmbedpipeError(f"search: give {fasta} or {name('ids')}, not both ({fasta} are embedded; "
                             f"{name('ids')} names records of the index's store, searched with their stored vectors)")
    if not queries and not ids:
        raise EmbedpipeError(f"search: give {fasta} to embed, or {name('ids')} of records the index's store holds")
    if include_self and not ids:
        raise EmbedpipeError(f"search: {name('include_self')} applies to {name('ids')} (a query of {fasta} is no "
                             "record of the store)")
    for option in embedding if ids else ():
        raise EmbedpipeError(f"search: {name(option)} is for {fasta}: {name('ids')} searches with the vectors the "
                             "store holds, and loads no model")


def neighbours(index: str | os.PathLike[str] | LoadedIndex, ids: str | Iterable[str], *, k: int = 10, include_self: bool = False,
               collapse_aliases: bool = False) -> Hits:
    """The ``k`` nearest neighbours in ``index`` of records its store holds, named by ID (an
    ID or a list; an alias too), searched with their stored vectors (the index's layer and
    pooling, read by the store's checked reader): no model is loaded. Each ID's own record and
    its aliases (the IDs of the same sequence in a merged store) are left out of its hits
    unless ``include_self``; ``collapse_aliases``: one hit for each alias group, named by its
    record (``Hits.groups``: the group's IDs). The index's files and its store (still the
    file indexed) are checked first; an unknown ID is one line naming it and the store."""
    loaded = index if isinstance(index, LoadedIndex) else open_index(Path(index))
    wanted = [ids] if isinstance(ids, str) else list(ids)
    return stored_neighbours(loaded, wanted, k, include_self=include_self, collapse=collapse_aliases)


def search(queries: Input | None = None, index: str | os.PathLike[str] | LoadedIndex | None = None, *,
           ids: str | Iterable[str] | None = None, model: str | os.PathLike[str] | None = None, k: int = 10,
           precision: str | None = None, layers: int | Sequence[int] | None = None, storage_dtype: str | None = None,
           device: str | None = None, options: EmbedOptions | None = None, quiet: bool = True,
           limits: FastaLimits = FASTA_LIMITS, include_self: bool = False, collapse_aliases: bool = False) -> Hits:
    """One call: embed ``queries`` (sequences, or a FASTA file as ``Embedder.embed`` takes it)
    as the index's store was (its model unless ``model`` is given; its policy, layer, storage
    dtype and the options that decide its numbers unless named, as keywords or as fields set in
    ``options``) and return each one's ``k`` nearest IDs; or, with ``ids`` instead of queries,
    the neighbours of those stored records (:func:`neighbours`: no model). The index's files
    are checked whole (:func:`~embedpipe.neighbours.index_file.open_index`) before the model
    loads. ``collapse_aliases``: one hit for each alias group of the store."""
    if index is None:
        raise EmbedpipeError("search: give the index to search (index=...)")
    named = _named(precision, layers, storage_dtype, device)
    embedding = [name for name, value in {"model": model, **named, "options": options}.items() if value is not None]
    check_query_input(queries is not None, ids is not None, include_self,
                      embedding + (["limits"] if limits != FASTA_LIMITS else []))
    if ids is not None:
        return neighbours(index, ids, k=k, include_self=include_self, collapse_aliases=collapse_aliases)
    loaded = index if isinstance(index, LoadedIndex) else open_index(Path(index))
    with _embedder(loaded, model, quiet, limits, merged_options("search", options, named)) as embedder:
        return embedder.search(queries, loaded, k=k, collapse_aliases=collapse_aliases)  # type: ignore[arg-type]


def _index_inputs(index: Path, meta: IndexMeta) -> list[Path]:
    """What a search reads of an index: its three files and its store."""
    return [index, meta_path(index), ids_path(index), *([Path(meta.store)] if meta.store else [])]


def _out(out: Path) -> list[Output]:
    return [("--out", Path(out), _TSV)]


def search_fasta(queries: Path, index: Path, out: Path, *, model: str | None = None, k: int = 10,
                 precision: str | None = None, layers: int | Sequence[int] | None = None,
                 storage_dtype: str | None = None, device: str | None = None, options: EmbedOptions | None = None,
                 quiet: bool = False, limits: FastaLimits = FASTA_LIMITS, collapse_aliases: bool = False) -> Hits:
    """``embedpipe search``: the records of the FASTA ``queries``, read by the model family's rules
    as ``embed`` reads them, embedded as :func:`search` embeds queries, searched in ``index``,
    the hits written to the TSV ``out`` (atomically; never over the queries, the index, its
    store or the model, and only over an earlier search's TSV)."""
    given = merged_options("search", options, _named(precision, layers, storage_dtype, device))
    meta = read_meta(Path(index))
    inputs = [Path(queries), *_index_inputs(Path(index), meta), *model_files(model or meta.model_source)]
    with writing_outputs("search", _out(out), inputs):
        loaded = open_index(Path(index))  # every file checked before the queries are read or embedded
        with _embedder(loaded, model, quiet, limits, given) as embedder:
            records = list(read_sequences(Path(queries), embedder.limits))
            if not records:
                raise EmbedpipeError(f"{queries}: no records to search")
            hits = embedder.search(records, loaded, k=k, collapse_aliases=collapse_aliases)
        hits.write_tsv(out)
    return hits


def parse_ids(values: Sequence[str]) -> list[str]:
    """``--ids ID[,ID...]`` (the option repeatable): the IDs in order; an empty one is refused."""
    out: list[str] = []
    for value in values:
        for part in value.split(","):
            if not part.strip():
                raise EmbedpipeError(f"--ids {value!r}: an empty ID (give ID[,ID...])")
            out.append(part.strip())
    return out


def search_ids(ids: Sequence[str], index: Path, out: Path, *, k: int = 10, include_self: bool = False,
               collapse_aliases: bool = False) -> Hits:
    """``embedpipe search --ids``: :func:`neighbours` of the stored records ``ids``, the hits
    written to the TSV ``out`` (as :func:`search_fasta` writes it; no model is loaded)."""
    meta = read_meta(Path(index))
    with writing_outputs("search", _out(out), _index_inputs(Path(index), meta)):
        hits = neighbours(Path(index), ids, k=k, include_self=include_self, collapse_aliases=collapse_aliases)
        hits.write_tsv(out)
    return hits
