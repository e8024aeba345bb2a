# Helpers shared by the rules: config validation, input and model resolution, and the
# command-line options every rule passes to `embedpipe`. Rules stay declarative; all the
# Python lives here.

import glob
import json
import math
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

if workflow.basedir not in sys.path:
    sys.path.append(workflow.basedir)  # the checkout's embedpipe when none is installed
from embedpipe import workflow_config


# `--config layers=[0,-1]` arrives as strings inside the list: coerce to the schema's types,
# then one-line errors (unknown key, bad value) before Snakemake's validation fills defaults.
_SCHEMA = "workflows/schemas/config.schema.yaml"
try:
    workflow_config.normalise(
        config, workflow_config.load_schema(Path(workflow.basedir) / _SCHEMA), _SCHEMA
    )
except workflow_config.ConfigError as exc:
    raise WorkflowError(str(exc)) from None

validate(config, schema="../schemas/config.schema.yaml")

try:
    workflow_config.check_outdir(config["outdir"])
except workflow_config.ConfigError as exc:
    raise WorkflowError(str(exc)) from None

OUTDIR = os.path.normpath(config["outdir"])
MODEL = config["model"]

# fair-esm ESM-2 names (esm2_t6_8M_UR50D ... esm2_t48_15B_UR50D); `embedpipe fetch-model`
# checks the exact list. Anything else is a checkpoint path.
_MODEL_NAME = re.compile(r"esm2_t(?P<layers>\d+)_(?P<size>\d+)(?P<unit>[MB])_UR50D")

if config.get("test_model"):
    MODEL_KIND = "test"  # written by rule make_test_model
elif _MODEL_NAME.fullmatch(MODEL) and not Path(MODEL).exists():
    MODEL_KIND = "name"  # fetched by rule fetch_model
else:
    MODEL_KIND = "path"  # a checkpoint the user provides

USES_GPU = config["device"].startswith("cuda")

# Failed embed jobs are retried by the main Snakemake process only. Inside a cluster job the
# inner Snakemake (--mode remote) would apply the rule's `retries:` once more.
EMBED_RETRIES = 0 if workflow.remote_exec else 2


# ---------------------------------------------------------------- input


def input_fastas():
    """The configured FASTA files: `input` is a path, a glob, or a list of either."""
    items = config["input"]
    if isinstance(items, str):
        items = [items]
    paths = []
    for item in items:
        if glob.has_magic(item):
            matched = sorted(glob.glob(item))
            if not matched:
                raise WorkflowError(
                    f"config 'input': the pattern {item!r} matches no file "
                    f"(relative to {Path.cwd()})"
                )
            paths.extend(matched)
        else:
            paths.append(item)
    return paths


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
    """Host memory for a job that loads the model: a few copies of the fp32 weights + slack."""
    match = _MODEL_NAME.fullmatch(Path(MODEL).stem) if MODEL_KIND != "test" else None
    if match:
        params = int(match["size"]) * (10**9 if match["unit"] == "B" else 10**6)
        weights_mb = params * 4 / 2**20
    elif MODEL_KIND == "path" and Path(MODEL).is_file():
        weights_mb = Path(MODEL).stat().st_size / 2**20
    else:
        weights_mb = 50
    return int(math.ceil((2048 + 3 * weights_mb) * attempt / 512) * 512)


# ---------------------------------------------------------------- shards


def shard_stores(wildcards):
    """One store per shard that the shard checkpoint wrote (listed in shards.json)."""
    listing = checkpoints.shard.get().output.listing
    with open(listing, encoding="utf-8") as fh:
        shards = json.load(fh)["shards"]
    return [f"{OUTDIR}/stores/{Path(s['path']).stem}.h5" for s in shards]


# ---------------------------------------------------------------- command-line options


def _join(args):
    return " ".join(shlex.quote(str(a)) for a in args)


def embed_options():
    """Options of `embedpipe embed` taken from the config (a param: changing one re-embeds)."""
    args = ["--precision", config["precision"]]
    for layer in config["layers"]:
        args += ["--layers", layer]
    args.append("--per-residue" if config["per_residue"] else "--no-per-residue")
    args += [
        "--device",
        config["device"],
        "--storage-dtype",
        config["storage_dtype"],
        "--long-sequences",
        config["long_sequences"],
    ]
    if config["fallback_device"] != "auto":  # not passed by default: existing runs stay up to date
        args += ["--fallback-device", config["fallback_device"]]
    return _join(args)


def tokens_per_batch(wildcards, attempt):
    """A retried embed job gets a smaller batch: tokens_per_batch // attempt."""
    return max(3, config["tokens_per_batch"] // attempt)


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


# ---------------------------------------------------------------- targets


def final_outputs():
    return [
        f"{OUTDIR}/shards/manifest.tsv",
        f"{OUTDIR}/embeddings.h5",
        f"{OUTDIR}/crosscheck/crosscheck.json",
        f"{OUTDIR}/crosscheck/crosscheck.html",
    ]
