"""Every option default and every allowed value, defined once.

The library validates against these, the CLI takes its defaults and the choices in its help
from them, and tests/core/test_schema_matches_library.py checks that the workflow's
``workflows/schemas/config.schema.yaml`` says the same. Plain Python only (no torch, numpy or
h5py): ``embedpipe --help`` imports this module. What each policy computes in
(torch dtypes) lives in :mod:`embedpipe.runtime.precision`, which builds its policies from
:data:`POLICY_KINDS`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from embedpipe.core import export_formats
from embedpipe.core import long_sequences as long_modes
from embedpipe.core.errors import EmbedpipeError

# ------------------------------------------------------------------------------ allowed values

#: precision policies, the fp32 reference first (docs/precision.md): name -> (kind, dtype of the
#: matmuls). The one list of their names: :mod:`embedpipe.runtime.precision` builds the policy objects
#: from it (kind plain: everything in that dtype; autocast: fp32 weights under torch.autocast;
#: mixed: 16-bit weights and matmuls with fp32 islands; int8: the linear layers in int8 with
#: fp32 islands, CPU only)
POLICY_KINDS = {
    "fp32": ("plain", "float32"),
    "fp16": ("plain", "float16"),
    "bf16": ("plain", "bfloat16"),
    "amp-fp16": ("autocast", "float16"),
    "amp-bf16": ("autocast", "bfloat16"),
    "fp16-mixed": ("mixed", "float16"),
    "bf16-mixed": ("mixed", "bfloat16"),
    "int8-mixed": ("int8", "int8"),
}
POLICY_NAMES = tuple(POLICY_KINDS)
#: policies that keep rotary tables, attention softmax, layer norms and the residual stream in fp32
FP32_ISLAND_POLICIES = tuple(name for name, (kind, _) in POLICY_KINDS.items() if kind in ("mixed", "int8"))
#: dtypes of the stored vectors (docs/store-format.md)
STORAGE_DTYPES = ("float32", "float16")
#: what happens to sequences longer than the model's trained window (each mode, with what the
#: store records of it, in core/long_sequences.py)
LONG_SEQUENCE_MODES = long_modes.NAMES
#: int8-mixed's per-input-channel smoothing (docs/precision.md, "int8-mixed"): none, or
#: smoothquant (SmoothQuant, alpha 0.5, calibrated in fp32 on the FASTA of
#: ``--int8-smoothing smoothquant:FASTA``: by default the 16 records shipped as
#: embedpipe/data/int8_calibration.fasta)
INT8_SMOOTHINGS = ("none", "smoothquant")
#: pooled vectors a store can hold besides per-residue ones; the mean is always stored
#: (docs/store-format.md, "Pooling")
POOLINGS = ("mean", "bos")
#: formats of ``embedpipe export`` and the workflow key ``exports`` (docs/exports.md)
EXPORT_FORMATS = export_formats.NAMES  # defined with their files and modules in core/export_formats.py
#: what ``shard`` does with an invalid FASTA record: stop, or list it as skipped in the manifest
ON_INVALID = ("error", "skip")

# ------------------------------------------------------------------------------ shard

#: token budget per shard (residues plus the model family's special tokens per record, 2 for
#: ESM-2): the unit of length sorting and of resume;
#: an embed job embeds a group of shards (:data:`MAX_JOBS`)
TOKENS_PER_SHARD = 1_000_000
#: the default of ``--on-invalid``
ON_INVALID_DEFAULT = "error"
#: most embed jobs a run has: ``shard`` groups consecutive shards into at most this many
#: groups, one embed job each, so the job graph stays this size whatever the input
#: (docs/cluster.md, "A UniRef50-sized run"; docs/benchmarks.md, "Workflow overhead")
MAX_JOBS = 1000


@dataclass(frozen=True)
class FastaLimits:
    """The most one FASTA record may hold, checked while the file streams (``shard`` and
    ``embed``), so that a hostile input (a 2 MB gzip holding one 2 GiB record) stops at
    once at bounded memory instead of being read whole (docs/store-format.md, "Input limits").

    ``max_length``: residues of one record; the longest known proteins are about 35,000
    (human titin) to 45,000 residues, so 100,000 is far above any real protein. ``max_id_length``:
    characters of one ID (UniProt's are under 30; stores index IDs in memory). ``keep_case``:
    keep each record's case instead of upper-casing it, for a family whose token layout says
    case is input (ProstT5: amino acids upper case, 3Di lower case); set from the model, never
    by a flag (:mod:`embedpipe.inputs.residue_rules`). ``chars_per_residue``: 2 for a family
    that reads structure-aware sequences (SaProt: amino-acid x 3Di pairs), from its layout too;
    ``max_length`` still counts residues."""

    max_length: int = 100_000
    max_id_length: int = 1_000
    keep_case: bool = False
    chars_per_residue: int = 1

    def check(self, error: type[EmbedpipeError]) -> None:
        """Refuse a limit below 1 (a typo must not make every record an error)."""
        for flag, value in (("--max-record-length", self.max_length), ("--max-id-length", self.max_id_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise error(f"{flag} must be a positive integer, not {value!r}")


#: the defaults of ``--max-record-length`` and ``--max-id-length``
FASTA_LIMITS = FastaLimits()

# ------------------------------------------------------------------------------ embed

#: the smallest batch budget: one residue plus up to two special tokens (ESM-2's BOS and EOS,
#: the most a model family's token layout has); a window longer than the budget runs alone
MIN_TOKENS_PER_BATCH = 3
#: ``--tokens-per-batch auto``: sized from free device memory on CUDA, :data:`CPU_TOKENS_PER_BATCH`
#: on the CPU (docs/precision.md, "Batch size")
AUTO = "auto"
CPU_TOKENS_PER_BATCH = 4096
#: what ``--precision`` takes: a policy, or ``auto``: the policy measured fastest on the job's
#: hardware, chosen when the job starts (docs/precision.md, "precision: auto")
PRECISION_CHOICES = (*POLICY_NAMES, AUTO)
#: ``--auto-measure``: when ``--precision auto`` measures. ``auto``: where the job is large enough
#: to pay for the probe (else fp32, unless the table has a row for the CPU class at a similar
#: model size); ``always``: regardless of the job's size (docs/precision.md, "precision: auto")
AUTO_MEASURE_ALWAYS = "always"
AUTO_MEASURE_CHOICES = (AUTO, AUTO_MEASURE_ALWAYS)
#: where ``--precision auto`` keeps each node's measurement when ``auto_cache`` is not given:
#: site configuration, so an environment variable (the workflow sets it for its jobs), not a flag
AUTO_CACHE_VARIABLE = "EMBEDPIPE_AUTO_CACHE"
#: ``auto`` = CUDA when available, else the CPU
DEFAULT_DEVICE = "auto"
#: options an older embedpipe had and recorded in a store's ``config``: the engine choices the
#: run now derives (``EMBEDPIPE_ENGINE`` overrides them) and the compiled path, gone. A store
#: holding them is read as any other (docs/store-format.md); they are never an option now.
REMOVED_OPTIONS = ("attention", "batch_layout", "attention_inputs", "fallback_device", "compile", "compile_cache")


@dataclass(frozen=True)
class EmbedOptions:
    """How the worker embeds; every field is stored in the store's ``config``.

    What is computed: ``precision``, ``layers``, ``per_residue``, ``pooling`` (what is
    stored besides the mean, which always is), ``storage_dtype``, ``long_sequences``,
    ``overflow_margin`` (which records fall back) and ``device`` (rounding differs with the
    hardware). How it runs, not what: ``tokens_per_batch`` and ``threads`` (a record's numbers
    never depend on its batch: docs/precision.md, "Reproducibility"), and ``auto_cache`` and
    ``auto_measure`` (where and when ``auto`` measures: the policy it chose is what the store
    records and compares); how stores are compared,
    not what: ``accept_platform_mix``. The engine choices (attention kernel, batch layout, q/k/v
    dtype, where fallback records run) are no options: the run derives them
    (embedpipe.extraction.resolved, docs/precision.md "Engine choices").
    """

    precision: str = "fp32"  # a policy, or auto (resolved when the job starts: extraction/auto_precision.py)
    layers: tuple[int, ...] = (-1,)
    per_residue: bool = False
    pooling: tuple[str, ...] = ("mean",)
    tokens_per_batch: int | str = AUTO
    device: str = DEFAULT_DEVICE
    storage_dtype: str = "float32"
    long_sequences: str = long_modes.DEFAULT
    overflow_margin: float | None = None
    threads: int | None = None
    int8_smoothing: str = "none"
    int8_calibration: str | None = None  # a FASTA; None = the shipped calibration set
    #: where --precision auto's measurements are kept; None: $EMBEDPIPE_AUTO_CACHE, else the user's cache
    auto_cache: str | None = None
    auto_measure: str = AUTO  # when --precision auto measures: auto (a job large enough) or always
    #: keep and reuse stores computed on another platform (CPU class, GPU model, torch, oneDNN):
    #: the platform is still recorded, only left out of the comparison (docs/cluster.md)
    accept_platform_mix: bool = False

    def validate(self) -> None:
        """One-line ``EmbedpipeError`` for the first option outside its allowed values."""
        if self.precision not in PRECISION_CHOICES:
            raise EmbedpipeError(
                f"unknown precision policy {self.precision!r}; choose one of: {', '.join(PRECISION_CHOICES)}"
            )
        for pooling in self.pooling:
            check_choice("--pooling", pooling, POOLINGS)
        check_choice("--storage-dtype", self.storage_dtype, STORAGE_DTYPES)
        check_choice("--long-sequences", self.long_sequences, LONG_SEQUENCE_MODES)
        self._validate_int8_smoothing()
        check_choice("--auto-measure", self.auto_measure, AUTO_MEASURE_CHOICES)
        if self.auto_measure != AUTO and self.precision != AUTO:
            raise EmbedpipeError(f"--auto-measure {self.auto_measure} applies to --precision auto only, "
                                 f"not {self.precision}")
        if self.tokens_per_batch == AUTO:
            pass
        elif isinstance(self.tokens_per_batch, bool) or not isinstance(self.tokens_per_batch, int):
            raise EmbedpipeError(f"--tokens-per-batch must be {AUTO} or a whole number, not {self.tokens_per_batch!r}")
        elif self.tokens_per_batch < MIN_TOKENS_PER_BATCH:
            raise EmbedpipeError(f"--tokens-per-batch must be at least {MIN_TOKENS_PER_BATCH} "
                                 "(one residue and a model's special tokens: ESM-2's BOS and EOS)")
        margin = self.overflow_margin
        if margin is not None and not (isinstance(margin, (int, float)) and 0.0 < margin <= 1.0):  # nan fails too
            raise EmbedpipeError(f"--overflow-margin must be a number in (0, 1], not {margin!r}")

    def _validate_int8_smoothing(self) -> None:
        """Smoothing is int8-mixed's; a calibration set is smoothquant's: refused elsewhere, not ignored."""
        check_choice("--int8-smoothing", self.int8_smoothing, INT8_SMOOTHINGS)
        if self.int8_smoothing != "none" and self.precision != "int8-mixed":
            raise EmbedpipeError(f"--int8-smoothing {self.int8_smoothing} applies to --precision int8-mixed only, "
                                 f"not {self.precision}")
        if self.int8_calibration is not None and self.int8_smoothing == "none":
            raise EmbedpipeError("a calibration FASTA (workflow: int8_calibration) applies with --int8-smoothing "
                                 f"smoothquant only, not {self.int8_smoothing}")


# ------------------------------------------------------------------------------ crosscheck

#: records re-embedded in fp32 (all when the store has fewer)
CROSSCHECK_SAMPLE = 64
#: sampling seed
CROSSCHECK_SEED = 0
#: neighbours per query for overlap@k (fewer when the store holds fewer other records)
CROSSCHECK_K = 10
#: folds of the downstream fit on the user's labels (``--labels``); also the fewest labelled
#: records a class must have (docs/crosscheck.md, "Downstream: your own labels")
CROSSCHECK_FOLDS = 5
#: bootstrap resamples of the paired score difference (its 95% interval)
CROSSCHECK_BOOTSTRAP = 2000
#: what the labels are: ``auto`` decides from the values (docs/crosscheck.md), ``classes``
#: (logistic regression, accuracy) or ``numbers`` (ridge regression, R² and Spearman)
LABEL_KINDS = ("auto", "classes", "numbers")


@dataclass(frozen=True)
class Thresholds:
    """Verdict thresholds of the cross-check (docs/crosscheck.md, "Verdict").

    * ``pass_cosine``: every sampled record's pooled cosine to fp32, in every stored layer,
      must be at least this for ``pass`` (below it: ``warn``).
    * ``fail_cosine``: any pooled cosine below this is ``fail``.
    * ``pass_overlap``: each layer's median overlap@k must be at least this for ``pass``
      (below it: ``warn``).
    * ``residue_cosine``: with per-residue vectors stored, any sampled residue whose cosine
      to fp32 is below this makes the verdict at least ``warn``.
    * ``determinism_cosine``: for a store computed in fp32 (a determinism check) the pass
      threshold is ``max(pass_cosine, determinism_cosine)``.
    * ``downstream_tolerance``: with ``--labels``, the 95% bootstrap interval of each layer's
      paired score difference (stored minus fp32: accuracy, or R²) must lie within
      ``±downstream_tolerance`` for ``pass`` (0.01: one point); an interval that only reaches
      past it is ``warn``, one wholly outside it is ``fail``.
    """

    pass_cosine: float = 0.999
    fail_cosine: float = 0.99
    pass_overlap: float = 0.9
    residue_cosine: float = 0.99
    determinism_cosine: float = 0.99999
    downstream_tolerance: float = 0.01

    def validate(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not -1.0 <= value <= 1.0:
                raise EmbedpipeError(f"threshold {name} must be a number in [-1, 1], not {value!r}")
        if self.fail_cosine > self.pass_cosine:
            raise EmbedpipeError(
                f"the fail cosine ({self.fail_cosine}) must not exceed the pass cosine ({self.pass_cosine})"
            )
        if not 0.0 <= self.pass_overlap <= 1.0:
            raise EmbedpipeError(f"the pass overlap must be in [0, 1], not {self.pass_overlap}")
        if not 0.0 <= self.downstream_tolerance <= 1.0:
            raise EmbedpipeError(f"the downstream tolerance must be in [0, 1], not {self.downstream_tolerance}")

    def pass_cosine_for(self, determinism: bool) -> float:
        return max(self.pass_cosine, self.determinism_cosine) if determinism else self.pass_cosine


# ------------------------------------------------------------------------------ helpers


def check_choice(option: str, value: object, allowed: Sequence[str],
                 error: type[EmbedpipeError] = EmbedpipeError) -> None:
    """Raise ``error`` ("--option must be one of a, b, not 'x'") unless ``value`` is allowed."""
    if value not in allowed:
        raise error(f"{option} must be one of {', '.join(allowed)}, not {value!r}")


def parse_tokens_per_batch(text: str) -> int | str:
    """``--tokens-per-batch`` as typed: :data:`AUTO` or a whole number (its minimum is checked by
    :meth:`EmbedOptions.validate`, with the reason)."""
    word = text.strip()
    if word == AUTO:
        return AUTO
    try:
        return int(word, 10)
    except ValueError:
        raise EmbedpipeError(f"--tokens-per-batch must be {AUTO} or a whole number, not {text!r}") from None


def split_int8_smoothing(text: str) -> tuple[str, str | None]:
    """``--int8-smoothing`` as typed: the smoothing, and the calibration FASTA after a colon
    (``smoothquant:FASTA``; None: the shipped set). The FASTA is a parameter of smoothquant, as
    a decision file is of ``--precision auto:FILE``; an empty one is refused."""
    smoothing, colon, fasta = text.partition(":")
    if colon and not fasta:
        raise EmbedpipeError(f"--int8-smoothing {text}: name the calibration FASTA after the colon, or leave it out")
    return smoothing, fasta if colon else None


def join_int8_smoothing(smoothing: str, calibration: str | None) -> str:
    """The ``--int8-smoothing`` value of ``smoothing`` and its calibration FASTA: the inverse of
    :func:`split_int8_smoothing` (the workflow's keys ``int8_smoothing``, ``int8_calibration``)."""
    return smoothing if calibration is None else f"{smoothing}:{calibration}"


__all__ = [
    "AUTO",
    "AUTO_CACHE_VARIABLE",
    "AUTO_MEASURE_ALWAYS",
    "AUTO_MEASURE_CHOICES",
    "REMOVED_OPTIONS",
    "CPU_TOKENS_PER_BATCH",
    "CROSSCHECK_BOOTSTRAP",
    "CROSSCHECK_FOLDS",
    "CROSSCHECK_K",
    "CROSSCHECK_SAMPLE",
    "CROSSCHECK_SEED",
    "DEFAULT_DEVICE",
    "EmbedOptions",
    "FASTA_LIMITS",
    "FastaLimits",
    "FP32_ISLAND_POLICIES",
    "INT8_SMOOTHINGS",
    "LABEL_KINDS",
    "LONG_SEQUENCE_MODES",
    "MAX_JOBS",
    "MIN_TOKENS_PER_BATCH",
    "ON_INVALID",
    "ON_INVALID_DEFAULT",
    "POLICY_KINDS",
    "POLICY_NAMES",
    "PRECISION_CHOICES",
    "STORAGE_DTYPES",
    "TOKENS_PER_SHARD",
    "Thresholds",
    "check_choice",
    "join_int8_smoothing",
    "parse_tokens_per_batch",
    "split_int8_smoothing",
]
