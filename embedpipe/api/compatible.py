"""Whether queries embedded by a run can be searched in an index: one line naming what differs.

Why the identity check: vectors of another model, layer, pooling, policy or storage dtype live in
another space, and their neighbours are meaningless without any error. The queries' run is
resolved (:func:`~embedpipe.extraction.resolved.resolve_run`, through the Embedder) and its identity
compared with the store's (:func:`embedpipe.extraction.identity.describe_difference`). What only
rounds differently (the platform, the device type, the batch layout, q/k/v's dtype at attention,
compiled kernels) is not compared: a store embedded on a GPU can be searched with queries
embedded on a CPU.
"""

from __future__ import annotations

from pathlib import Path

from embedpipe.core.errors import EmbedpipeError
from embedpipe.extraction.identity import PLATFORM, describe_difference
from embedpipe.extraction.resolved import ResolvedRun
from embedpipe.neighbours.index_file import IndexMeta

__all__ = ["NOT_COMPARED", "STORE_OPTIONS", "check_compatible"]

#: identity fields a query's run need not share with the store: the index holds one layer and
#: pooling (checked apart), and what only rounds differently
NOT_COMPARED = ("layers", "pooling", "per_residue", PLATFORM, "computed_as.device_type", "computed_as.batch_layout",
                "computed_as.attention_inputs", "computed_as.compiled")
#: the store's options that decide what its numbers are, given to the queries' run unless named
#: (not the options an older embedpipe recorded, :data:`~embedpipe.core.options.REMOVED_OPTIONS`:
#: the queries' run derives the attention kernel as the store's did, and the identity compares it)
STORE_OPTIONS = ("storage_dtype", "long_sequences", "overflow_margin", "int8_smoothing", "int8_calibration")


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
