"""The `embedpipe` command line: typer commands that parse options and call library functions.

No logic lives here. Defaults, and the allowed values the help lists, come from
:mod:`embedpipe.core.options` (plain Python). Heavy imports (torch, h5py) happen inside each
command so that `embedpipe --help` stays fast. Every user-facing failure is an ``EmbedpipeError`` and is
printed as one line on stderr with a non-zero exit code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from embedpipe.cli.exit import run_app, user_errors
from embedpipe.core import export_formats, options  # export_formats: the registry, no format module
from embedpipe.core.cpus import set_wait_policy
from embedpipe.core.errors import EmbedpipeError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    # plain help: option names never cut, on/off flags as --x/--no-x, wrapped to the terminal
    rich_markup_mode=None,
    help="Batch protein embeddings from protein language models (ESM-2, ESM-1b/1v, SaProt, ProtT5, ProstT5, Ankh, "
         "ESM C, ESM++): shard, embed, merge, cross-check.",
)

DEVICE_HELP = "auto, cpu, cuda or cuda:N."
LIMITS = options.FASTA_LIMITS
# shard and embed read FASTA through the same reader, held to the same limits (docs/store-format.md)
MAX_RECORD_LENGTH = typer.Option(LIMITS.max_length, "--max-record-length", min=1,
                                 help="Most residues one record may hold; a longer one stops the run.")
MAX_ID_LENGTH = typer.Option(LIMITS.max_id_length, "--max-id-length", min=1,
                             help="Most characters one ID may hold; a longer one stops the run.")
PRECISION_HELP = (", ".join(options.PRECISION_CHOICES) + " (auto: the policy measured fastest on this machine), or "
                  "auto:FILE (the run's one decision, written by decide-precision; docs/precision.md).")
THREADS_HELP = ("CPU threads for torch (default: the CPUs the job may use: affinity, cgroup quota, "
                "SLURM_CPUS_PER_TASK, OMP_NUM_THREADS).")
#: defaults of the commands' options, from the library (embedpipe/core/options.py)
EMBED = options.EmbedOptions()
THRESHOLDS = options.Thresholds()


def _one_of(names: tuple[str, ...], notes: dict[str, str] | None = None) -> str:
    """Help text listing the allowed values: ``a (note), b or c``."""
    notes = notes or {}
    shown = [f"{name} ({notes[name]})" if name in notes else name for name in names]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


# the embed command's longer help texts
TOKENS_PER_BATCH_HELP = (
    f"Token budget per batch, BOS/EOS included: {options.AUTO} (from free GPU memory on CUDA, "
    f"{options.CPU_TOKENS_PER_BATCH} on the CPU) or a number of at least {options.MIN_TOKENS_PER_BATCH}.")
INT8_SMOOTHING_HELP = "int8-mixed only: per-input-channel smoothing, " + _one_of(options.INT8_SMOOTHINGS, {
    "smoothquant": "SmoothQuant alpha 0.5, calibrated in fp32 on the 16 Swiss-Prot records shipped with embedpipe"}) + (
    "; smoothquant:FASTA calibrates on that FASTA. See docs/precision.md.")
#: flags embed once had, and where each went: a usage error naming one says so (embedpipe.cli.exit)
MOVED_OPTIONS = {
    "--auto-cache": f"where --precision auto keeps its measurements is set by {options.AUTO_CACHE_VARIABLE}=DIR "
                    "in the environment",
    "--auto-measure": "to measure whatever the job's size, run embedpipe decide-precision (its --auto-measure "
                      "always), then embed --precision auto:FILE",
    "--int8-calibration": "give the FASTA as --int8-smoothing smoothquant:FASTA",
}


def _version_callback(value: bool) -> None:
    if value:
        from embedpipe import __version__

        print(__version__)
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """embedpipe: FASTA -> length-sorted shards -> embeddings (HDF5) -> fp32 cross-check."""


@app.command()
@user_errors
def shard(
    inputs: list[Path] = typer.Argument(..., help="FASTA files, plain or gzip."),
    out: Path = typer.Option(..., "--out", help="Output directory for shards and manifest."),
    tokens_per_shard: int = typer.Option(
        options.TOKENS_PER_SHARD, "--tokens-per-shard", min=1,
        help="Token budget per shard (residues plus the model's special tokens per record: 2 for ESM-2)."
    ),
    on_invalid: str = typer.Option(
        options.ON_INVALID_DEFAULT, "--on-invalid",
        help=_one_of(options.ON_INVALID, {"error": "stop at the first invalid record",
                                          "skip": "record it as skipped"}) + ".",
    ),
    max_jobs: int = typer.Option(
        options.MAX_JOBS, "--max-jobs", min=1, help="Most embed jobs: shards.json groups the shards into at most this many."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
    model: Optional[str] = typer.Option(
        None, "--model", help="The model the shards are for: its family's special tokens count per record "
                              "(default: ESM-2's BOS and EOS), and a family whose case is input (ProstT5) keeps "
                              "each record's case. Its config is read (a .pt's says whether it is SaProt's), "
                              "its weights never."),
    max_record_length: int = MAX_RECORD_LENGTH,
    max_id_length: int = MAX_ID_LENGTH,
) -> None:
    """Validate, normalise and deduplicate FASTA input and cut it into length-sorted shards."""
    from embedpipe.shard.passes import TOKENS_PER_RECORD, shard_fasta

    per_record, keep_case, per_residue = TOKENS_PER_RECORD, False, 1
    if model is not None:
        from embedpipe.model import inspect

        layout = inspect(model).token_layout
        per_record, keep_case, per_residue = layout.extra_tokens, layout.keeps_case, layout.chars_per_residue
    summary = shard_fasta(inputs, out=out, tokens_per_shard=tokens_per_shard, on_invalid=on_invalid,
                          max_jobs=max_jobs, quiet=quiet, tokens_per_record=per_record,
                          limits=options.FastaLimits(max_record_length, max_id_length, keep_case, per_residue))
    if not quiet:
        print(summary.render(), file=sys.stderr)


def _int_list(values: list[str], flag: str) -> tuple[int, ...]:
    """``--layers 0,-1`` and ``--layers 0 --layers -1`` alike: integers, in the order given."""
    try:
        return tuple(int(part) for value in values for part in value.split(",") if part.strip())
    except ValueError:
        raise EmbedpipeError(f"{flag} takes integers, one per flag or a comma list (e.g. {flag} 0,-1), "
                             f"not {' '.join(values)!r}") from None


REUSE_HELP = ("Copy records whose sequence this earlier store (or its reuse-index) holds, embedded with the same "
              "model and options, instead of computing them; repeatable (docs/cluster.md, \"Release to release\").")


EXPORT_FORMAT_HELP = f"{_one_of(export_formats.NAMES, {f.name: f.what for f in export_formats.REGISTRY if f.what})}."
LONG_SEQUENCES_HELP = f"Over the model's window (ESM-2: 1022 residues): {_one_of(options.LONG_SEQUENCE_MODES)}."


# embed's options, declared once here so the command itself stays short (decide-precision shares those it
# takes alike: --device, --storage-dtype, --long-sequences, --threads, --int8-smoothing)
FASTAS = typer.Argument(..., help="A shard (or any protein FASTA); several with --out-dir.")
MODEL = typer.Option(..., "--model", help="fair-esm name (ESM-2, ESM-1b, ESM-1v) or checkpoint (.pt), an ESM C "
                     "release of the esm package (esmc_300m, esmc_600m) or its .pth, a Hugging Face model "
                     "directory, or a hub name in the local hub cache (docs/models.md).")
OUT = typer.Option(None, "--out", help="Output store (.h5) of one FASTA, written atomically.")
OUT_DIR = typer.Option(None, "--out-dir", help="A store DIR/NAME.h5 per FASTA, one model load; complete stores of "
                       "the same shard, model and options that pass validate are kept; each store is locked for "
                       "the job (a second job on it is refused).")
DONE = typer.Option(None, "--done", help="With --out-dir: a JSON listing of the stores with their size, mtime and "
                    "uuid, written last.")
PRECISION = typer.Option(EMBED.precision, "--precision", help=PRECISION_HELP)
LAYERS = typer.Option([",".join(map(str, EMBED.layers))], "--layers", metavar="K[,K...]",
                      help="Layers to store (0 = token embedding, -1 = last): a comma list, or the flag repeated.")
PER_RESIDUE = typer.Option(EMBED.per_residue, "--per-residue/--no-per-residue", help="Also store per-residue vectors.")
POOLING = typer.Option(list(EMBED.pooling), "--pooling", metavar="NAME",
                       help=f"Pooled vectors to store: {_one_of(options.POOLINGS, {'bos': 'the BOS token'})}; "
                            "repeatable. The mean is always stored.")
TOKENS_PER_BATCH = typer.Option(str(EMBED.tokens_per_batch), "--tokens-per-batch", metavar="auto|N",
                                help=TOKENS_PER_BATCH_HELP)
DEVICE = typer.Option(EMBED.device, "--device", help=DEVICE_HELP)
STORAGE_DTYPE = typer.Option(EMBED.storage_dtype, "--storage-dtype", help=_one_of(options.STORAGE_DTYPES) + ".")
LONG_SEQUENCES = typer.Option(EMBED.long_sequences, "--long-sequences", help=LONG_SEQUENCES_HELP)
OVERFLOW_MARGIN = typer.Option(EMBED.overflow_margin, "--overflow-margin", help="Fall back to fp32 when a record's "
                               "max |activation| exceeds this fraction of the low dtype's maximum.")
THREADS = typer.Option(EMBED.threads, "--threads", min=1, help=THREADS_HELP)
INT8_SMOOTHING = typer.Option(EMBED.int8_smoothing, "--int8-smoothing", metavar="none|smoothquant[:FASTA]",
                              help=INT8_SMOOTHING_HELP)
REUSE = typer.Option([], "--reuse", metavar="STORE.h5", help=REUSE_HELP)
ACCEPT_PLATFORM_MIX = typer.Option(
    EMBED.accept_platform_mix, "--accept-platform-mix",
    help="Keep (--out-dir) and --reuse stores computed on another platform (CPU instruction-set class, GPU model, "
         "torch or oneDNN version; their numbers differ slightly). The platform is still recorded.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bar or summary.")


@app.command()
@user_errors
def embed(
    fasta: list[Path] = FASTAS, model: str = MODEL, out: Optional[Path] = OUT, out_dir: Optional[Path] = OUT_DIR,
    done: Optional[Path] = DONE, precision: str = PRECISION, layers: list[str] = LAYERS,
    per_residue: bool = PER_RESIDUE, pooling: list[str] = POOLING, tokens_per_batch: str = TOKENS_PER_BATCH,
    device: str = DEVICE, storage_dtype: str = STORAGE_DTYPE, long_sequences: str = LONG_SEQUENCES,
    overflow_margin: Optional[float] = OVERFLOW_MARGIN, threads: Optional[int] = THREADS,
    int8_smoothing: str = INT8_SMOOTHING, reuse: list[Path] = REUSE, accept_platform_mix: bool = ACCEPT_PLATFORM_MIX,
    quiet: bool = QUIET, max_record_length: int = MAX_RECORD_LENGTH, max_id_length: int = MAX_ID_LENGTH,
) -> None:
    """Embed every record of a FASTA file into one HDF5 store (or a group of shards, --out-dir)."""
    from embedpipe.extraction.auto_decision import split_precision
    from embedpipe.extraction.run import embed_command

    precision, decision = split_precision(precision)  # auto:FILE: the run's one decision
    smoothing, calibration = options.split_int8_smoothing(int8_smoothing)  # smoothquant:FASTA
    chosen = options.EmbedOptions(
        precision=precision, layers=_int_list(layers, "--layers"), per_residue=per_residue, pooling=tuple(pooling),
        tokens_per_batch=options.parse_tokens_per_batch(tokens_per_batch), device=device, storage_dtype=storage_dtype,
        long_sequences=long_sequences, overflow_margin=overflow_margin, threads=threads,
        int8_smoothing=smoothing, int8_calibration=calibration, accept_platform_mix=accept_platform_mix)
    summary = embed_command(fasta, model=model, out=out, out_dir=out_dir, done=done, options=chosen, quiet=quiet, reuse=reuse,
                            limits=options.FastaLimits(max_record_length, max_id_length), decision=decision)
    if not quiet:
        print(summary.render(), file=sys.stderr)


@app.command("reuse-index")
@user_errors
def reuse_index(
    store: Path = typer.Argument(..., help="A shard store or merged embeddings.h5 of an earlier release."),
    out: Path = typer.Option(..., "--out", help="The index file (written atomically), for embed --reuse."),
) -> None:
    """Index a store's sequences by sha256, once, so embed --reuse jobs read only what they need."""
    from embedpipe.store.reuse_index import build_index

    print(f"indexed {build_index(store, out)} distinct sequences of {store} -> {out}", file=sys.stderr)


@app.command()
@user_errors
def merge(
    stores: Optional[list[Path]] = typer.Argument(None, help="Shard stores to merge."),
    out: Path = typer.Option(..., "--out", help="Merged store (.h5), written atomically."),
    manifest: Optional[Path] = typer.Option(
        None, "--manifest", help="shards/manifest.tsv: adds aliases so every input ID resolves."
    ),
    stores_from: Optional[Path] = typer.Option(
        None, "--stores-from", help="A file of shard stores, one path per line, merged after any given as "
                                    "arguments (for more stores than a command line holds)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Merge shard stores into one store (virtual datasets over the shard files)."""
    from embedpipe.store import merge_stores
    from embedpipe.store.merge import stores_from as read_stores

    listed = read_stores(stores_from) if stores_from is not None else []
    summary = merge_stores([*(stores or []), *listed], out=out, manifest=manifest)
    if not quiet:
        print(summary.render(), file=sys.stderr)


# --labels and its companions (docs/crosscheck.md, "Downstream: your own labels")
LABELS_HELP = ("id<TAB>label file (header first; IDs may be aliases): sample the labelled records and fit the same "
               "model on the stored and on the fp32 vectors (docs/crosscheck.md).")
LABEL_KIND_HELP = (f"{' | '.join(options.LABEL_KINDS)}: classes (logistic regression, accuracy) or numbers (ridge, "
                   "R2); auto reads numbers when most labels are numbers and not all integers.")
FOLDS_HELP = "Folds of the downstream fit; each class needs at least this many labelled records."
UNKNOWN_IDS_HELP = "Leave out label IDs that are not in the store (listed in crosscheck.json) instead of refusing the file."
TOLERANCE_HELP = "Pass needs the 95% interval of each layer's score difference (stored - fp32) within +- this."


@app.command()
@user_errors
def crosscheck(
    store: Path = typer.Argument(..., help="Store to check."),
    out: Path = typer.Option(..., "--out", help="Report directory (crosscheck.json, crosscheck.html)."),
    sample: int = typer.Option(
        options.CROSSCHECK_SAMPLE, "--sample", min=1,
        help="Records drawn at random to re-embed in fp32 (all when the store has fewer); the longest, those over "
             "the window and the fp32 fallbacks are re-embedded besides them, a bounded number (docs/crosscheck.md)."),
    seed: int = typer.Option(options.CROSSCHECK_SEED, "--seed", help="Sampling seed."),
    device: str = typer.Option(options.DEFAULT_DEVICE, "--device", help=DEVICE_HELP),
    model: Optional[str] = typer.Option(
        None, "--model", help="Override the store's model (e.g. a moved checkpoint); its sha256 must match."),
    allow_model_mismatch: bool = typer.Option(
        False, "--allow-model-mismatch",
        help="Compare even when the model's sha256 differs from the store's (verdict at best warn)."
    ),
    pass_cosine: float = typer.Option(
        THRESHOLDS.pass_cosine, "--pass-cosine", "--min-cosine",
        help="Pass needs every sampled pooled cosine to fp32 at or above this."
    ),
    fail_cosine: float = typer.Option(THRESHOLDS.fail_cosine, "--fail-cosine", help="Any pooled cosine below this fails."),
    pass_overlap: float = typer.Option(
        THRESHOLDS.pass_overlap, "--pass-overlap", help="Pass needs each layer's median overlap@k at or above this."
    ),
    residue_cosine: float = typer.Option(
        THRESHOLDS.residue_cosine, "--residue-cosine", help="With per-residue vectors: any residue cosine below this warns."
    ),
    determinism_cosine: float = typer.Option(
        THRESHOLDS.determinism_cosine, "--determinism-cosine",
        help="Pass cosine for a store computed in fp32 (a determinism check)."
    ),
    k: int = typer.Option(options.CROSSCHECK_K, "--k", min=1, help="Neighbours for overlap@k."),
    labels: Optional[Path] = typer.Option(None, "--labels", help=LABELS_HELP),
    label_kind: str = typer.Option(options.LABEL_KINDS[0], "--label-kind", help=LABEL_KIND_HELP),
    folds: int = typer.Option(options.CROSSCHECK_FOLDS, "--folds", min=2, help=FOLDS_HELP),
    ignore_unknown_ids: bool = typer.Option(False, "--ignore-unknown-ids", help=UNKNOWN_IDS_HELP),
    downstream_tolerance: float = typer.Option(THRESHOLDS.downstream_tolerance, "--downstream-tolerance",
                                               help=TOLERANCE_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help=THREADS_HELP),
    fail_on_threshold: bool = typer.Option(False, "--fail-on-threshold", help="Exit 1 when the verdict is fail."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Re-embed a sample in fp32 and report how far the store is from fp32 (with --labels: on your own task too)."""
    from embedpipe.crosscheck.run import LabelOptions, run_crosscheck

    report = run_crosscheck(
        store, out=out, sample=sample, seed=seed, device=device, model=model,
        thresholds=options.Thresholds(
            pass_cosine=pass_cosine, fail_cosine=fail_cosine, pass_overlap=pass_overlap, residue_cosine=residue_cosine,
            determinism_cosine=determinism_cosine, downstream_tolerance=downstream_tolerance),
        k=k,
        labels=None if labels is None else LabelOptions(labels, kind=label_kind, folds=folds,
                                                        ignore_unknown_ids=ignore_unknown_ids),
        allow_model_mismatch=allow_model_mismatch, threads=threads, quiet=quiet)
    if not quiet:
        print(report.render(), file=sys.stderr)
    if fail_on_threshold and report.verdict == "fail":
        raise typer.Exit(1)


@app.command()
@user_errors
def info(
    store: Path = typer.Argument(..., help="Store to describe."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Provenance, counts and sizes of a store; exits 1 when a merged store's sources are
    missing, unreadable or changed since the merge."""
    from embedpipe.store import render_info, store_info

    data = store_info(store)
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        print(render_info(data))
    if data.get("source_problems"):  # a merged store whose shard stores are missing or changed
        print(f"embedpipe: error: {store}: {data['source_problems'][0]}"
              + (f" (and {len(data['source_problems']) - 1} more)" if len(data["source_problems"]) > 1 else ""),
              file=sys.stderr)
        raise typer.Exit(1)


@app.command()
@user_errors
def validate(store: Path = typer.Argument(..., help="Store to check.")) -> None:
    """Exit 0 only for a complete, consistent, checksummed, finite store."""
    from embedpipe.store.validate import platform_notes, validate_report

    problems, notes = validate_report(store)
    for note in notes:  # what could not be checked (row digests not recorded): said, not a failure
        print(f"{store}: note: {note}", file=sys.stderr)
    for note in platform_notes(store):  # a merged store of several platforms: which records came from where
        print(f"{store}: {note}")
    if problems:
        for problem in problems:
            print(f"{store}: {problem}", file=sys.stderr)
        print(f"embedpipe: error: {store} is not valid ({len(problems)} problem(s))", file=sys.stderr)
        raise typer.Exit(1)
    print(f"{store}: ok")


@app.command("join-structure")
@user_errors
def join_structure(
    amino: Path = typer.Argument(..., help="Amino-acid FASTA (Foldseek convert2fasta of the structure database)."),
    three_di: Path = typer.Argument(..., help="3Di FASTA with the same IDs (convert2fasta of its _ss database)."),
    out: Path = typer.Option(..., "--out", help="Structure-aware FASTA to write (SaProt's input), atomically."),
) -> None:
    """Pair an amino-acid FASTA and a 3Di FASTA by ID into SaProt's structure-aware sequences."""
    from embedpipe.shard.structure import write_structure_aware

    print(f"{write_structure_aware(amino, three_di, out)} records -> {out}", file=sys.stderr)


@app.command()
@user_errors
def export(
    store: Path = typer.Argument(..., help="Store to export (a merged store exports every input ID, aliases too)."),
    fmt: str = typer.Option(..., "--format", help=EXPORT_FORMAT_HELP),
    out: Path = typer.Option(..., "--out", help="Output file (npy: OUT.npy plus OUT.ids.txt, OUT.provenance.json)."),
    layer: int = typer.Option(-1, "--layer", help="Stored layer to export (-1 = the highest stored)."),
    per_residue: bool = typer.Option(False, "--per-residue", help="Per-residue vectors instead of pooled ones."),
    pooling: str = typer.Option("mean", "--pooling", help=f"Pooled vectors to export: {_one_of(options.POOLINGS)} (if stored)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Write a store in the layout downstream tools read (docs/exports.md)."""
    from embedpipe.export import export_store

    summary = export_store(store, fmt=fmt, out=out, layer=layer, per_residue=per_residue, pooling=pooling,
                           quiet=quiet)
    if not quiet:
        print(summary.render(), file=sys.stderr)


def run() -> None:
    """Console entry point: ``app()`` with every failure, usage errors included, one line on
    stderr and a shell-like exit code (:mod:`embedpipe.cli.exit`). The OpenMP wait policy is
    chosen first, before any command imports torch (docs/cluster.md, "CPU threads")."""
    set_wait_policy()
    run_app(app, moved=MOVED_OPTIONS)


if __name__ == "__main__":  # pragma: no cover
    run()
