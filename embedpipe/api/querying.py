"""Queries embedded as an index's vectors were, then searched: ``Embedder.search``,
``embedpipe.search`` and ``embedpipe search``.

Why the identity check: vectors of another model, layer, pooling, policy or storage dtype live in
another space, and their neighbours are meaningless without any error. The queries' run is
resolved (:func:`~embedpipe.embed.resolved.resolve_run`, through the Embedder) and its identity
compared with the store's (:func:`embedpipe.embed.identity.describe_difference`); a difference is
one line naming it. What only rounds differently (the platform, the device type, the batch
layout, q/k/v's dtype at attention, compiled kernels) is not compared: a store embedded on a GPU
can be searched with queries embedded on a CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embedpipe.api.embedder import Embedder
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import FASTA_LIMITS, FastaLimits
from embedpipe.embed.identity import PLATFORM, describe_difference
from embedpipe.embed.resolved import ResolvedRun
from embedpipe.inputs.memory import Sequences
from embedpipe.neighbours.hits import Hits, search_index
from embedpipe.neighbours.index_file import IndexMeta, read_meta

__all__ = ["check_compatible", "query_options", "search", "search_with"]

#: identity fields a query's run need not share with the store: the index holds one layer and
#: pooling (checked apart), and what only rounds differently
NOT_COMPARED = ("layers", "pooling", "per_residue", PLATFORM, "computed_as.device_type", "computed_as.batch_layout",
                "computed_as.attention_inputs", "computed_as.compiled")
#: the store's options that decide what its numbers are, given to the queries' run unless named
STORE_OPTIONS = ("storage_dtype", "long_sequences", "attention", "overflow_margin", "int8_smoothing",
                 "int8_calibration")


def check_compatible(run: ResolvedRun, meta: IndexMeta, index: Path) -> None:
    """One line naming what differs between the queries' run and the index's vectors."""
    if meta.layer not in run.layers:
        raise EmbedpipeError(f"{index}: holds layer {meta.layer} of its store; the queries embed layers "
                             f"{list(run.layers)}: embed them with layer {meta.layer}")
    if meta.pooling not in run.pooling:
        raise EmbedpipeError(f"{index}: holds the {meta.pooling} pooling; the queries embed {list(run.pooling)}")
    why = describe_difference(meta.embed_identity, run.identity, NOT_COMPARED)
    if why is not None:
        raise EmbedpipeError(f"{index}: its vectors were {why.replace('this run', 'the queries')}; "
                             "embed the queries as the store was (or leave the option out)")


def search_with(embedder: Embedder, queries: Sequences, index: Path, *, k: int = 10) -> Hits:
    """``queries`` embedded by ``embedder`` (refused unless its run matches the index), then searched."""
    meta = read_meta(index)
    check_compatible(embedder.run, meta, index)
    result = embedder.embed(queries)
    return search_index(index, meta, result.ids, result.pooled(meta.layer, meta.pooling), k)


def query_options(meta: IndexMeta, given: Mapping[str, Any]) -> dict[str, Any]:
    """The queries' options: the index's layer, pooling and policy and the store's options that
    decide its numbers, each replaced by one ``given`` (then compared: :func:`check_compatible`)."""
    known = set(meta.options)
    options: dict[str, Any] = {k: meta.options[k] for k in STORE_OPTIONS if k in known}
    if isinstance(options.get("int8_calibration"), str) and not Path(options["int8_calibration"]).is_file():
        options.pop("int8_calibration")  # moved since: the identity compares the set's bytes, not its path
    options |= {"precision": meta.precision_policy, "layers": (meta.layer,),
                "pooling": ("mean",) if meta.pooling == "mean" else ("mean", meta.pooling)}
    return options | {k: v for k, v in given.items() if v is not None}


def search(queries: Sequences, index: str | Path, *, model: str | Path | None = None, k: int = 10,
           quiet: bool = True, limits: FastaLimits = FASTA_LIMITS, **options: Any) -> Hits:
    """One call: embed ``queries`` as the index's store was (its model unless ``model`` is given,
    its options unless named in ``options``) and return each one's ``k`` nearest IDs."""
    index = Path(index)
    meta = read_meta(index)
    spec = str(model) if model is not None else meta.model_source
    if not spec:
        raise EmbedpipeError(f"{index}: records no model; give the model of its store")
    with Embedder(spec, quiet=quiet, limits=limits, **query_options(meta, options)) as embedder:
        return search_with(embedder, queries, index, k=k)
