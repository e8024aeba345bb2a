# Helpers shared by the rules: config validation, input and model resolution, and the
# command-line options every rule passes to `embedpipe`. Rules stay declarative; all the
# Python lives here.

import functools
import glob
import json
import os
import shlex
import sys
import time
from pathlib import Path

from snakemake.utils import validate

if workflow.basedir not in sys.path:
    sys.path.append(workflow.basedir)  # the checkout's embedpipe when none is installed
from embedpipe import model as embedpipe_model
from embedpipe.workflow import checks as workflow_checks
from embedpipe.workflow import cluster as workflow_cluster
from embedpipe.workflow import config as workflow_config
from embedpipe.workflow import jobs as workflow_jobs
from embedpipe.model import fetch as model_fetch
from embedpipe.core import export_formats
from embedpipe.core import stats as workflow_stats



def fail(message):
    """Stop at parse time with one clean line (a WorkflowError adds `File ... in <module>`)."""
    print(f"embedpipe: {message}", file=sys.stderr)
    raise SystemExit(1)


# `--config layers=[0,-1]` arrives as strings inside the list: coerce to the schema's types,
# then one-line errors (unknown key, bad value) before Snakemake's validation fills defaults.
_SCHEMA = "workflows/schemas/config.schema.yaml"
try:
    workflow_config.normalise(
        config, workflow_config.load_schema(Path(workflow.basedir) / _SCHEMA), _SCHEMA
    )
except workflow_config.ConfigError as exc:
    fail(exc)

validate(config, schema="../schemas/config.schema.yaml")

try:
    workflow_config.check_outdir(config["outdir"])
    workflow_config.check_reuse(config.get("reuse") or [], config["outdir"])
except workflow_config.ConfigError as exc:
    fail(exc)

OUTDIR = os.path.normpath(config["outdir"])
#: where `precision: auto` keeps each node's measurement (`EMBEDPIPE_AUTO_CACHE`; docs/precision.md,
#: "precision: auto"): the run's jobs on one node measure once
AUTO_CACHE = shlex.quote(os.path.join(OUTDIR, ".cache", "auto-precision"))
MODEL = config["model"]
#: `precision: auto`: the run's one decision, made by rule decide_precision before any embed job,
#: which every embed job runs (docs/precision.md, "One decision per run")
DECISION = f"{OUTDIR}/precision-decision.json"
DECIDES_ONCE = config["precision"] == "auto"
#: the threads of the embed, decide_precision and crosscheck jobs, from the package
#: (embedpipe.workflow.config): what the rules ask the scheduler for (the config's `threads`, else
#: the package's default), and `--threads {threads}` on their shell lines only when the config
#: sets `threads`; without it Snakemake's OMP_NUM_THREADS (the job's threads) bounds each job
JOB_THREADS = workflow_config.job_threads(config)
THREADS_OPTION = workflow_config.threads_option(config)

# What embedpipe knows about the model without loading it (`embedpipe model-info MODEL`):
# whether it is a registered name (fair-esm ESM-2) or a checkpoint path, and its size. A model
# directory embedpipe refuses (its config.json, tokenizer, weight index) stops here in one line.
try:
    MODEL_FACTS = embedpipe_model.describe(MODEL)
except workflow_checks.EmbedpipeError as exc:
    fail(exc)

# Every option combination `embedpipe embed` refuses (with this model, these reuse paths) is
# refused here, before any job, by the same function (embedpipe.extraction.combinations).
try:
    workflow_config.check_embed_config(config, MODEL_FACTS)
except workflow_config.ConfigError as exc:
    fail(exc)

if config.get("test_model"):
    MODEL_KIND = "test"  # written by rule make_test_model
elif MODEL_FACTS.kind == "name" and not Path(MODEL).exists():
    MODEL_KIND = "name"  # fetched by rule fetch_model
else:
    MODEL_KIND = "path"  # a checkpoint the user provides

# A fair-esm name that is neither cached nor downloadable stops the run here, before any job,
# with the fix as the one message (cluster jobs' inner Snakemake does not ask again).
if MODEL_KIND == "name" and not workflow.remote_exec:
    _problem = model_fetch.download_problem(MODEL)
    if _problem:
        fail(_problem.removeprefix("embedpipe: "))

# A group marker whose stores were deleted or changed since it was written is removed before
# the DAG is built, with embeddings.h5, which pins those stores (Snakemake does not rerun a
# job for a missing intermediate file while the final one is up to date). By the main process
# only, a stat per store (embedpipe.extraction.group_marker; docs/cluster.md, "Resuming, rerunning").
if not workflow.remote_exec:
    for _problem in workflow_checks.stale_markers(OUTDIR, remove=True):
        print(f"embedpipe: {_problem}", file=sys.stderr)

# What `--report` shows of the run is read from embeddings.h5 when the report is rendered
# (workflows/report/*.rst), not taken from this config, which may not be what ran.
config["_on_disk"] = workflow_checks.StoreFacts(f"{OUTDIR}/embeddings.h5")

USES_GPU = config["device"].startswith("cuda")

# Failed embed jobs are retried by the main Snakemake process only. Inside a cluster job the
# inner Snakemake (--mode remote) would apply the rule's `retries:` once more.
EMBED_RETRIES = 0 if workflow.remote_exec else 2


# ---------------------------------------------------------------- input


def input_fastas():
    """The configured FASTA files: `input` is a path, a glob, or a list of either; a path that
    does not exist or a glob matching nothing stops the run here (one line)."""
    try:
        return workflow_checks.input_paths(config["input"])
    except workflow_checks.WorkflowCheckError as exc:
        fail(exc)


# ---------------------------------------------------------------- one run per outdir
# Snakemake's own lock is in .snakemake/ of the working directory: two runs from two working
# directories on one outdir would not see each other. The main process (never a job: jobs run
# with --no-hooks) holds this lock until it exits (docs/cluster.md, "One run per outdir").


RUN_LOCK = []  # the open lock file: held while this process lives


onstart:
    try:
        RUN_LOCK.append(workflow_checks.lock_run(OUTDIR))
    except workflow_checks.EmbedpipeError as exc:
        fail(exc)
    if workflow.executor_plugin is not None and workflow.executor_plugin.name == "slurm":
        check_slurm()


# ---------------------------------------------------------------- SLURM
# Before the first job is submitted: a status command that sees jobs finish on this cluster,
# and a warning for requests no node can hold (docs/cluster.md, "A silent wait").


def check_slurm():
    try:
        _changed = workflow_cluster.choose_status_command(workflow.executor_settings, workflow_cluster.slurm_config())
    except workflow_cluster.ClusterError as exc:
        fail(exc)
    if _changed:
        print(f"embedpipe: {_changed}", file=sys.stderr)
    _requests = workflow_cluster.rule_requests(workflow, {"embed": model_mem_mb(1), "crosscheck": model_mem_mb(1)})
    for _line in workflow_cluster.oversized(_requests, workflow_cluster.nodes()):
        print(f"embedpipe: warning: {_line}", file=sys.stderr)


# ---------------------------------------------------------------- failures
# A failed run ends with each failed embed job's last log line (on SLURM the job's stderr is in
# a file the terminal never shows; docs/cluster.md, "When a job fails").

RUN_STARTED = time.time()


onerror:
    _groups = Path(OUTDIR, "logs", "embed").glob("group-*.log")
    _jobs = [(log, Path(OUTDIR, "stores", log.with_suffix(".json").name)) for log in _groups]
    for _line in workflow_jobs.failure_lines(_jobs, RUN_STARTED):
        print(f"embedpipe: embed job failed: {_line}", file=sys.stderr)


# ---------------------------------------------------------------- model


def fetched_model_record():
    """The record fetch_model writes (the checkpoint path `embedpipe fetch-model` printed)."""
    return f"{OUTDIR}/model/{MODEL}.fetched"


def model_input():
    """The model as a rule input, so embed jobs wait for (and rerun after) the model."""
    if MODEL_KIND == "name":
        # The record is rewritten whenever fetch_model runs; its content never changes,
        # so its timestamp must not trigger re-embedding.
        return ancient(fetched_model_record())
    return MODEL


def model_arg(wildcards, input):
    """`--model` of embed and crosscheck: the fair-esm name, or the checkpoint path (input)."""
    return MODEL if MODEL_KIND == "name" else input.model


def model_gate():
    """Makes fetch_model the first job, so an offline run fails before any work starts."""
    return [model_input()] if MODEL_KIND == "name" else []


def test_model_companion():
    """make-test-model also writes fair-esm's `NAME-contact-regression.pt` next to NAME.pt."""
    stem = MODEL[:-3] if MODEL.endswith(".pt") else MODEL
    return f"{stem}-contact-regression.pt"


def model_mem_mb(attempt=1):
    """Host memory for a job that loads the model: a few copies of the weights + slack
    (embedpipe.model.facts), more on each retry."""
    return MODEL_FACTS.host_mem_mb(attempt)


# ---------------------------------------------------------------- shards and groups


@functools.lru_cache(maxsize=2)
def _read_listing(path, mtime_ns):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def shard_listing():
    """shards.json of the shard checkpoint, parsed once (not once per embed job)."""
    path = checkpoints.shard.get().output.listing
    return _read_listing(path, os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _shard_fastas(path, mtime_ns):
    return workflow_checks.shard_paths(_read_listing(path, mtime_ns), f"{OUTDIR}/shards")


def shard_fastas():
    """Every shard FASTA of shards.json; a path outside the shard directory stops the run."""
    path = checkpoints.shard.get().output.listing
    try:
        return _shard_fastas(path, os.stat(path).st_mtime_ns)
    except workflow_checks.WorkflowCheckError as exc:
        fail(exc)


def group_shards(wildcards):
    """The shard FASTAs of embed group {group} (shards.json `groups`, at most `max_jobs`)."""
    fastas = shard_fastas()
    return [fastas[k] for k in shard_listing()["groups"][int(wildcards.group)]]


def group_markers(wildcards):
    """One marker per embed group, written when every shard store of the group is complete."""
    return [f"{OUTDIR}/stores/group-{k:05d}.json" for k in range(len(shard_listing()["groups"]))]


def shard_stores(wildcards):
    """One store per shard that the shard checkpoint wrote (listed in shards.json)."""
    return [f"{OUTDIR}/stores/{Path(p).stem}.h5" for p in shard_fastas()]


# ---------------------------------------------------------------- memory of shard and merge
# Peak RSS grows with the records a job handles (docs/benchmarks.md, "Sharding at scale" and
# "Merging with the manifest"): a fixed part plus a measured cost per record, with the records
# estimated from the input's size in bytes. x attempt on a retry.

SHARD_MEM_BASE_MB = 256  # measured: 66 MiB at 0 records (fit over 1M, 3M, 10M)
SHARD_MEM_BYTES_PER_RECORD = 64  # measured: 55.5 B/record (596 MiB at 10M records)
MERGE_MEM_BASE_MB = 512
MERGE_MEM_BYTES_PER_RECORD = 8  # measured (issue 24): 202, 265, 281 MiB at 1M, 3M, 10M records (2.4 B/record past 3M)
FASTA_BYTES_PER_RECORD = 200  # shorter than UniProt's average (~350 B): over-counts records
GZIP_RATIO = 4  # a gzipped FASTA holds up to ~4x its size
MANIFEST_BYTES_PER_ROW = 100  # a manifest row is ~100-200 bytes (a 64-hex digest, the source)


def _records_in(paths, bytes_per_record):
    """An upper estimate of the records in ``paths`` from their size in bytes."""
    total = 0
    for path in paths:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        total += size * (GZIP_RATIO if str(path).endswith(".gz") else 1)
    return total // bytes_per_record


def shard_mem_mb(wildcards, input, attempt):
    """`embedpipe shard`: a fixed part + a few fixed-width integers per input record."""
    records = _records_in(input.fasta, FASTA_BYTES_PER_RECORD)
    return (SHARD_MEM_BASE_MB + records * SHARD_MEM_BYTES_PER_RECORD // 2**20) * attempt


def merge_mem_mb(wildcards, input, attempt):
    """`embedpipe merge --manifest`: a fixed part + a cost per record (the stores' count adds
    little: docs/benchmarks.md, "Store at scale")."""
    records = _records_in([input.manifest], MANIFEST_BYTES_PER_ROW)
    return (MERGE_MEM_BASE_MB + records * MERGE_MEM_BYTES_PER_RECORD // 2**20) * attempt


# ---------------------------------------------------------------- command-line options


def _join(args):
    return " ".join(shlex.quote(str(a)) for a in args)


def embed_options():
    """Options of `embedpipe embed` from the config (a param: changing one re-embeds), mapped
    by the package (embedpipe.workflow.config.embed_args); `tokens_per_batch` is the rule's
    resource (smaller on a retry). Under `precision: auto` every job runs the run's one decision
    (DECISION, given to embed_args)."""
    return _join(workflow_config.embed_args(config, leave=("tokens_per_batch",),
                                            decision=DECISION if DECIDES_ONCE else None))


def decide_options():
    """The embed jobs' options as given (precision auto), for `embedpipe decide-precision`:
    a changed one decides again (a param)."""
    return _join(workflow_config.embed_args(config, leave=("tokens_per_batch",)))


def decision_input():
    """The run's one `auto` decision as an input of every embed job; nothing for a named policy."""
    return [DECISION] if DECIDES_ONCE else []


def run_residues(wildcards):
    """The residues the run embeds (shards.json's count of the unique sequences' residues): a run
    too small to pay for the probe is not measured (docs/precision.md, "One decision per run")."""
    return int(shard_listing()["counts"]["residues"])


def decision_shards(wildcards):
    """The shards decide-precision draws its records from: evenly spaced over all of them (short to
    long), as many as it reads (DECISION_SAMPLE_FILES), so the command line
    stays short whatever the shard count."""
    return workflow_stats.spread(shard_fastas(), workflow_stats.DECISION_SAMPLE_FILES)


def embed_runtime(attempt):
    """Minutes of an embed job's attempt (and of decide_precision's, which runs as one)."""
    return 120 * attempt


def as_embed_job(job_rule):
    """Give ``job_rule`` the embed rule's threads and what a profile sets for embed (`set-threads`,
    `set-resources`: its partition, constraint, GPU type, memory, time), as Snakemake resolved
    them: decide_precision times the policies on the resources an embed job gets."""
    job_rule.resources["_cores"] = rules.embed.rule.resources["_cores"]
    job_rule.resources.update(workflow.resource_settings.overwrite_resources.get("embed", {}))


def shard_options():
    """`--model` of `embedpipe shard` (the family's token layout sets the shard budgets) and the
    FASTA limits (embedpipe.workflow.config.fasta_limit_args, embed's too)."""
    return _join(["--model", MODEL, *workflow_config.fasta_limit_args(config)])


def reuse_indexes():
    """The sha256 index of each `reuse` store (built by reuse_index), an input of every embed job."""
    return [f"{OUTDIR}/reuse/reuse-{k}.h5" for k in range(len(config["reuse"]))]


def calibration_input():
    """`int8_calibration`'s FASTA as an input of every embed job, so that a changed file reruns
    them (the stores' identity holds its sha256: docs/precision.md, "int8-mixed"); nothing unset."""
    return [config["int8_calibration"]] if config["int8_calibration"] is not None else []


def reuse_options():
    """`--reuse INDEX` per reuse store; nothing without `reuse`."""
    return _join([word for index in reuse_indexes() for word in ("--reuse", index)])


def tokens_per_batch(wildcards, attempt):
    """A retried embed job gets a smaller batch: tokens_per_batch // attempt. `auto` stays
    `auto`: each attempt sizes its batches from the device's free memory again, and a batch
    that runs out of GPU memory is split in halves inside the job (docs/precision.md)."""
    if config["tokens_per_batch"] == "auto":
        return "auto"
    return workflow_config.retry_tokens_per_batch(config["tokens_per_batch"], embed_attempt(wildcards, attempt))


def embed_log(wildcards):
    return f"{OUTDIR}/logs/embed/group-{wildcards.group}.log"


def embed_attempt(wildcards, attempt):
    """The attempt an embed job's resources are sized for: 1 again when the previous attempt
    refused its inputs or was interrupted by the user (more memory would not help:
    embedpipe.workflow.jobs)."""
    return workflow_jobs.attempt_for(embed_log(wildcards), attempt)


def embed_repeat(wildcards, attempt):
    """1 when this attempt retries a final failure (a refusal, the user's interrupt: the job
    repeats it at once), else 0."""
    return int(embed_attempt(wildcards, attempt) != attempt)


def gpus(wildcards):
    return 1 if USES_GPU else 0


def crosscheck_options():
    cc = config["crosscheck"]
    return _join(
        [
            "--sample",
            cc["sample"],
            "--seed",
            cc["seed"],
            "--device",
            config["device"],
        ]
    )


def crosscheck_labels():
    """The label file as an input (a changed file re-runs the cross-check), or none."""
    labels = config["crosscheck"].get("labels")
    return [labels] if labels else []


def crosscheck_label_options():
    """--labels and its companions from the `crosscheck` config key ("" without labels)."""
    cc = config["crosscheck"]
    if not cc.get("labels"):
        return ""
    words = ["--labels", cc["labels"], "--label-kind", cc.get("label_kind", "auto")]
    if cc.get("ignore_unknown_ids"):
        words.append("--ignore-unknown-ids")
    return _join(words)


# ---------------------------------------------------------------- targets


#: format -> the file the export rule writes, from the registry (embedpipe/core/export_formats.py)
EXPORT_NAMES = export_formats.workflow_files()


def export_path(fmt):
    """Where the export rule writes format ``fmt`` (config key `exports`)."""
    return f"{OUTDIR}/exports/{EXPORT_NAMES[fmt]}"


def export_format(wildcards):
    """The format the export rule writes to {outdir}/exports/embeddings.{ext}."""
    return next(fmt for fmt, name in EXPORT_NAMES.items() if name == f"embeddings.{wildcards.ext}")


def final_outputs():
    return [
        f"{OUTDIR}/shards/manifest.tsv",
        f"{OUTDIR}/embeddings.h5",
        f"{OUTDIR}/crosscheck/crosscheck.json",
        f"{OUTDIR}/crosscheck/crosscheck.html",
    ] + [export_path(fmt) for fmt in config["exports"]]
