"""``embedpipe decide-precision``: ``precision: auto`` decided once for a run
(embedpipe.extraction.auto_decision), registered on the one ``app`` of :mod:`embedpipe.cli.commands`,
whose option constants it shares. It takes the options of ``embed`` that decide the numbers, so
the workflow gives it the embed jobs' own (docs/precision.md, "One decision per run")."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from embedpipe.cli.commands import (
    DEVICE,
    EMBED,
    INT8_SMOOTHING,
    LONG_SEQUENCES,
    MAX_ID_LENGTH,
    MAX_RECORD_LENGTH,
    STORAGE_DTYPE,
    THREADS,
    _int_list,
    _one_of,
    app,
)
from embedpipe.cli.exit import user_errors
from embedpipe.core import options


@app.command("decide-precision")
@user_errors
def decide_precision(
    fasta: list[Path] = typer.Argument(..., help="The run's input: its shards (short to long) or any protein FASTAs."),
    model: str = typer.Option(..., "--model", help="The model, as embed takes it."),
    out: Path = typer.Option(..., "--out", help="The decision file (JSON, written atomically; kept when it holds "
                             "this model and options), for embed --precision auto:FILE."),
    precision: str = typer.Option(options.AUTO, "--precision", help="auto, the one precision decided here."),
    layers: list[str] = typer.Option([",".join(map(str, EMBED.layers))], "--layers", metavar="K[,K...]",
                                     help="As embed's: the layers the jobs store."),
    per_residue: bool = typer.Option(EMBED.per_residue, "--per-residue/--no-per-residue", help="As embed's."),
    pooling: list[str] = typer.Option(list(EMBED.pooling), "--pooling", metavar="NAME",
                                      help=f"As embed's: {_one_of(options.POOLINGS)}; repeatable."),
    device: str = DEVICE, storage_dtype: str = STORAGE_DTYPE, long_sequences: str = LONG_SEQUENCES,
    overflow_margin: Optional[float] = typer.Option(EMBED.overflow_margin, "--overflow-margin", help="As embed's."),
    threads: Optional[int] = THREADS, int8_smoothing: str = INT8_SMOOTHING,
    accept_platform_mix: bool = typer.Option(EMBED.accept_platform_mix, "--accept-platform-mix",
                                             help="As embed's (how stores are compared: no part of the decision)."),
    auto_measure: str = typer.Option(EMBED.auto_measure, "--auto-measure", metavar="auto|always",
                                     help="auto: measure where the run is large enough to pay for the probe "
                                          "(--run-residues), else fp32 or the table's row for this CPU class at a "
                                          "similar model size; always: measure whatever the run's size."),
    run_residues: Optional[int] = typer.Option(None, "--run-residues", min=1, metavar="N",
                                               help="The residues the whole run embeds (the workflow gives the "
                                                    "shards' total); not given: measure."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
    max_record_length: int = MAX_RECORD_LENGTH, max_id_length: int = MAX_ID_LENGTH,
) -> None:
    """Decide --precision auto once for a run: measure on records drawn across the whole input,
    write the decision every embed job then runs (embed --precision auto:FILE)."""
    from embedpipe.extraction.auto_decision import decide_run
    from embedpipe.extraction.run import start_checks

    smoothing, calibration = options.split_int8_smoothing(int8_smoothing)  # smoothquant:FASTA
    chosen = options.EmbedOptions(
        precision=precision, layers=_int_list(layers, "--layers"), per_residue=per_residue, pooling=tuple(pooling),
        device=device, storage_dtype=storage_dtype, long_sequences=long_sequences, overflow_margin=overflow_margin,
        threads=threads, int8_smoothing=smoothing, int8_calibration=calibration,
        auto_measure=auto_measure, accept_platform_mix=accept_platform_mix)
    _, limits = start_checks(fasta, model, chosen, (), options.FastaLimits(max_record_length, max_id_length))
    print(decide_run(fasta, model=model, options=chosen, out=out, limits=limits, run_residues=run_residues,
                     quiet=quiet), file=sys.stderr)
