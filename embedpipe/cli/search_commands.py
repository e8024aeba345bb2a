"""``embedpipe index`` and ``embedpipe search``: nearest neighbours of stored vectors
(embedpipe.neighbours, embedpipe.api.querying), registered on the one ``app`` of
:mod:`embedpipe.cli.commands`, whose option constants they share."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from embedpipe.cli.commands import (
    DEVICE,
    MAX_ID_LENGTH,
    MAX_RECORD_LENGTH,
    THREADS,
    TOKENS_PER_BATCH,
    _one_of,
    app,
)
from embedpipe.cli.exit import user_errors
from embedpipe.core import options


@app.command()
@user_errors
def index(
    store: Path = typer.Argument(..., help="Store whose vectors to index."),
    out: Path = typer.Option(..., "--out", help="The index (FAISS), with OUT.json (what it holds, of which store) "
                             "and OUT.ids.txt beside it; written atomically."),
    layer: int = typer.Option(-1, "--layer", help="Stored layer to index (-1 = the highest stored)."),
    pooling: str = typer.Option("mean", "--pooling", help=f"Pooled vectors to index: {_one_of(options.POOLINGS)} (if stored)."),
    kind: str = typer.Option("exact", "--kind", help="exact (cosine, every row compared) or hnsw (approximate, for "
                             "tens of millions of rows; recall in docs/python.md)."),
) -> None:
    """Build a nearest-neighbour index over one stored layer and pooling (the search extra: faiss)."""
    from embedpipe.neighbours.build import build_index

    print(build_index(store, out, layer=layer, pooling=pooling, kind=kind).render(), file=sys.stderr)


@app.command()
@user_errors
def search(
    queries: Optional[Path] = typer.Argument(None, help="Protein FASTA of the queries (or --ids instead)."),
    index_path: Path = typer.Option(..., "--index", help="An index built by embedpipe index."),
    out: Path = typer.Option(..., "--out", help="TSV of hits: query, hit, score (cosine), rank; written atomically."),
    k: int = typer.Option(10, "--k", min=1, help="Neighbours per query."),
    ids: Optional[list[str]] = typer.Option(None, "--ids", metavar="ID[,ID...]",
                                            help="Query with records of the index's store, by ID: their stored "
                                            "vectors, no model loaded (repeatable)."),
    include_self: bool = typer.Option(False, "--include-self", help="With --ids: keep each ID's own record and "
                                      "aliases in its hits (left out by default)."),
    collapse_aliases: bool = typer.Option(False, "--collapse-aliases", help="One hit per alias group (the IDs of one "
                                          "sequence in a merged store), its IDs in a group column."),
    model: Optional[str] = typer.Option(None, "--model", help="Default: the model the index's store was embedded with."),
    precision: Optional[str] = typer.Option(None, "--precision", help="Default: the store's policy (another is refused)."),
    layer: Optional[int] = typer.Option(None, "--layer", help="Default: the index's layer (another is refused)."),
    storage_dtype: Optional[str] = typer.Option(None, "--storage-dtype", help="Default: the store's."),
    device: str = DEVICE,
    threads: Optional[int] = THREADS,
    tokens_per_batch: str = TOKENS_PER_BATCH,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
    max_record_length: int = MAX_RECORD_LENGTH, max_id_length: int = MAX_ID_LENGTH,
) -> None:
    """Embed the queries as the index's store was embedded (or take stored records' vectors,
    --ids), and write each one's nearest IDs."""
    from embedpipe.api.querying import check_query_input, parse_ids, search_fasta, search_ids

    given = {"model": model, "precision": precision, "layer": layer, "storage_dtype": storage_dtype}
    check_query_input(queries is not None, bool(ids), include_self,
                      [name for name, value in given.items() if value is not None], cli=True)
    if ids:
        hits = search_ids(parse_ids(ids), index_path, out, k=k, include_self=include_self,
                          collapse_aliases=collapse_aliases)
    else:
        hits = search_fasta(queries, index_path, out, model=model, k=k, quiet=quiet,  # type: ignore[arg-type]
                            limits=options.FastaLimits(max_record_length, max_id_length),
                            collapse_aliases=collapse_aliases, precision=precision, layers=layer,
                            storage_dtype=storage_dtype, device=device,
                            options=options.EmbedOptions(threads=threads, tokens_per_batch=options.parse_tokens_per_batch(
                                tokens_per_batch)))
    if not quiet:
        print(f"searched {len(hits.queries)} {'IDs' if ids else 'queries'} in {index_path} -> {out}", file=sys.stderr)
