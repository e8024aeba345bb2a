"""The workflow's config, checked before Snakemake's own schema validation.

``snakemake --config KEY=VALUE`` parses a list or mapping value with YAML's BaseLoader, which
keeps every scalar inside it a string (``layers=[0,-1]`` gives ``['0', '-1']``). ``coerce``
converts such strings to the types the schema declares, so a command-line override works as
the same value in a config file does. ``check`` turns schema errors into one line naming the
key (and, for a misspelled key, the nearest valid one) instead of a dump of the schema.
The Snakefile side is a few lines in workflows/rules/common.smk, which takes the command-line
options of its jobs from here (:func:`embed_args`, :func:`fasta_limit_args`): the one mapping
from config keys to ``embedpipe`` options; and its jobs' threads (:func:`job_threads`,
:func:`threads_option`) and a retry's batch budget (:func:`retry_tokens_per_batch`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import AUTO, MIN_TOKENS_PER_BATCH, EmbedOptions, join_int8_smoothing
from embedpipe.extraction.combinations import CombinationError, check_embed
from embedpipe.model.facts import ModelFacts
from embedpipe.model.registry import inspect

_INTEGER = re.compile(r"[+-]?[0-9]+")
_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}
_NULL = {"null", "~", ""}


class ConfigError(EmbedpipeError):
    """A workflow config value the schema refuses; the message is one line."""


def load_schema(path: Path | str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def coerce(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` with strings converted to the scalar types ``schema`` declares, recursively
    through arrays, objects and ``oneOf``/``anyOf``; values that do not convert stay as they are
    (validation then names them)."""
    for combinator in ("oneOf", "anyOf"):
        if combinator in schema:
            for branch in schema[combinator]:
                converted = coerce(value, branch)
                if _has_type(converted, branch.get("type")):
                    return converted
            return value
    kind = schema.get("type")
    if isinstance(value, list) and kind == "array" and isinstance(schema.get("items"), dict):
        return [coerce(item, schema["items"]) for item in value]
    if isinstance(value, dict) and kind == "object":
        properties = schema.get("properties", {})
        return {key: coerce(item, properties[key]) if key in properties else item for key, item in value.items()}
    if isinstance(value, str):
        return _coerce_scalar(value, kind)
    return value


def _coerce_scalar(text: str, kind: Any) -> Any:
    word = text.strip()
    if kind == "integer" and _INTEGER.fullmatch(word):
        return int(word)
    if kind == "number":
        try:
            return int(word) if _INTEGER.fullmatch(word) else float(word)
        except ValueError:
            return text
    if kind == "boolean" and word.lower() in _TRUE | _FALSE:
        return word.lower() in _TRUE
    if kind == "null" and word.lower() in _NULL:
        return None
    return text


def _has_type(value: Any, kind: Any) -> bool:
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "string": lambda v: isinstance(v, str),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    return kind is None or (kind in checks and checks[kind](value))


def unknown_keys(config: Any, schema: dict[str, Any], prefix: str = "") -> list[tuple[str, list[str]]]:
    """(dotted key, nearest valid keys) for every key a closed object of the schema does not have."""
    found: list[tuple[str, list[str]]] = []
    if not isinstance(config, dict):
        return found
    for branch in schema.get("oneOf", []) + schema.get("anyOf", []):
        if branch.get("type") == "object":
            return unknown_keys(config, branch, prefix)
    properties = schema.get("properties", {})
    for key, value in config.items():
        name = f"{prefix}{key}"
        if key in properties:
            found += unknown_keys(value, properties[key], f"{name}.")
        elif schema.get("additionalProperties") is False:
            found.append((name, difflib.get_close_matches(str(key), list(properties), n=1, cutoff=0.6)))
    return found


def check(config: dict[str, Any], schema: dict[str, Any], schema_name: str = "the config schema") -> None:
    """Raise ``ConfigError`` (one line) for the first problem the schema finds in ``config``."""
    for key, near in unknown_keys(config, schema):
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"config: unknown key {key!r}{hint} (validated against {schema_name})")
    defaults = {key: spec["default"] for key, spec in schema.get("properties", {}).items() if "default" in spec}
    validator = jsonschema.Draft202012Validator(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(defaults | config))  # as Snakemake fills them
    if error is not None:
        where = ".".join(str(part) for part in error.absolute_path) or "(top level)"
        raise ConfigError(f"config: invalid value for {where!r}: {_one_line(error.message)} (validated against {schema_name})")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def normalise(config: dict[str, Any], schema: dict[str, Any], schema_name: str = "the config schema") -> None:
    """Coerce ``config`` in place to the schema's types, then ``check`` it."""
    coerced = coerce(config, schema)
    config.clear()
    config.update(coerced)
    check(config, schema, schema_name)


def check_outdir(outdir: str) -> None:
    """``outdir`` must be a directory, or not exist yet."""
    path = Path(outdir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"config 'outdir': {outdir} exists and is not a directory; choose another outdir")


def check_reuse(reuse: list[str], outdir: str) -> None:
    """No ``reuse`` store inside ``outdir``: the run writes there (``{outdir}/embeddings.h5`` is
    its own merge, made from the embed jobs that would read it: a cycle, and every rerun fails).
    Symlinks resolved; docs/cluster.md, "Release to release"."""
    root = Path(outdir).resolve()
    for item in reuse:
        if Path(item).resolve().is_relative_to(root):
            raise ConfigError(f"config 'reuse': {item} lies inside outdir {outdir}, which this run writes "
                              f"(it would reuse its own output); move the earlier release out of {outdir} "
                              "or choose another outdir")


#: config keys of the FASTA limits, options of both steps that read FASTA (shard and embed)
FASTA_LIMIT_KEYS = ("max_record_length", "max_id_length")


def embed_keys(config: Collection[str]) -> list[str]:
    """The config's keys that are ``embedpipe embed`` options: every :class:`EmbedOptions` field
    of the same name (``int8_smoothing`` is ``--int8-smoothing``), in the fields' order."""
    return [f.name for f in fields(EmbedOptions) if f.name in config]


def embed_options(config: dict[str, Any]) -> EmbedOptions:
    """The options every embed job of ``config`` runs with (schema defaults filled in)."""
    values: dict[str, Any] = {key: tuple(config[key]) if isinstance(config[key], list) else config[key]
                              for key in embed_keys(config)}
    return EmbedOptions(**values)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


#: options passed only when set to other than their default: added after runs existed, whose
#: jobs' command lines (Snakemake reruns a job whose params changed) they must leave alone
ONLY_WHEN_SET = ("auto_measure",)
#: keys given inside another key's flag: ``int8_calibration`` is ``--int8-smoothing smoothquant:FASTA``
FOLDED = ("int8_calibration",)
#: options the rules put on the shell line themselves, never in the params: ``threads`` is how a
#: job runs, not what it computes (:func:`threads_option`)
SHELL_ONLY = ("threads",)
#: the threads an embed, decide_precision or crosscheck job asks the scheduler for when the
#: config sets no ``threads`` (a profile's ``set-threads`` overrides either; docs/cluster.md)
DEFAULT_THREADS = 4


def job_threads(config: dict[str, Any]) -> int:
    """The ``threads:`` of the embed and crosscheck rules (decide_precision takes embed's): the
    config's ``threads`` when set, else :data:`DEFAULT_THREADS`."""
    return int(config.get("threads") or DEFAULT_THREADS)


def threads_option(config: dict[str, Any]) -> str:
    """The jobs' ``--threads`` on the shell line, as a Snakemake template: ``--threads {threads}``
    (the job's threads as Snakemake scheduled them: ``--cores`` and ``set-threads`` may lower
    the config's) only when the config sets ``threads``; else nothing. Without it a job counts
    its own CPUs (embedpipe.core.cpus.allocated), and ``OMP_NUM_THREADS`` bounds them: Snakemake
    exports it, with ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and others, as the job's
    threads to every shell command (snakemake/shell.py, ``shell.__new__``:
    ``envvars["OMP_NUM_THREADS"] = threads``), so the job runs that many threads where it owns
    that many CPUs, and its stores' ``threads_from`` says ``OMP_NUM_THREADS=N``."""
    return "--threads {threads}" if config.get("threads") else ""


def retry_tokens_per_batch(tokens: int, attempt: int) -> int:
    """A retried embed job's batch budget: ``tokens // attempt``, never below
    :data:`~embedpipe.core.options.MIN_TOKENS_PER_BATCH` (BOS, one residue, EOS)."""
    return max(MIN_TOKENS_PER_BATCH, tokens // attempt)


def embed_args(config: dict[str, Any], *, leave: Collection[str] = (), decision: str | None = None) -> list[str]:
    """``embedpipe embed``'s options for every job of ``config``, the FASTA limits included: a
    list is its flag repeated, a switch (a bool field, off by default) its flag when on, an
    unset value (None) nothing, an :data:`ONLY_WHEN_SET` option nothing at its default, a
    :data:`FOLDED` key inside its flag.
    ``leave``: keys the rule passes itself (``tokens_per_batch``: smaller on each retry), as
    :data:`SHELL_ONLY` always are.
    ``decision``: under ``precision: auto``, the run's one decision (``--precision auto:FILE``;
    docs/precision.md, "One decision per run")."""
    options, args = embed_options(config), []
    for key in embed_keys(config):
        value = getattr(options, key)
        if key == "precision" and value == AUTO and decision is not None:
            value = f"{AUTO}:{decision}"
        elif key == "int8_smoothing":
            value = join_int8_smoothing(value, options.int8_calibration)
        if key in leave or key in FOLDED or key in SHELL_ONLY or value is None or value is False:
            continue
        if key in ONLY_WHEN_SET and (value == getattr(EmbedOptions(), key) or decision is not None):
            continue  # at its default; or a job given the run's decision, which measures nothing
        if value is True:
            args.append(_flag(key))
        else:
            args += [word for item in (value if isinstance(value, tuple) else (value,)) for word in (_flag(key), str(item))]
    return [*args, *fasta_limit_args(config)]


def fasta_limit_args(config: dict[str, Any]) -> list[str]:
    """``--max-record-length N --max-id-length N`` for ``embedpipe shard`` and ``embed`` (embed
    reads the shards through the same reader: the same limits)."""
    return [word for key in FASTA_LIMIT_KEYS for word in (_flag(key), str(config[key]))]


def check_embed_config(config: dict[str, Any], facts: ModelFacts) -> None:
    """The embed jobs' options checked as ``embedpipe embed`` checks them (the same function:
    embedpipe.extraction.combinations), before any job: ``ConfigError`` naming the keys and their
    values, then the line the job would have failed with. ``test_model``'s depth counts as the
    model's (its file is written by the first job); a checkpoint given by path has its depth read
    from its header (weights unread: :func:`_with_depth`)."""
    test_model = config.get("test_model")
    if isinstance(test_model, dict) and facts.num_layers is None:
        facts = replace(facts, num_layers=test_model["layers"])
    facts = _with_depth(facts, config.get("layers") or [])
    try:
        check_embed(embed_options(config), facts, config.get("reuse") or [])
    except CombinationError as exc:
        named = ", ".join(f"{key}={_shown(config[key])}" if key in config else key for key in exc.keys)
        raise ConfigError(f"config {named}: {exc}") from None


def _with_depth(facts: ModelFacts, layers: list[Any]) -> ModelFacts:
    """``facts`` with the model's layer count read from the checkpoint's header (memory-mapped:
    the weights stay unread; torch imported) when ``layers`` asks for one the count decides
    (other than 0 and -1) and the file is there; as given otherwise, so the default config
    parses torch-free. A file that cannot be read is left to the job's one-line error."""
    if facts.num_layers is not None or facts.weights_bytes is None or all(k in (0, -1) for k in layers):
        return facts
    try:
        return inspect(facts.spec)
    except EmbedpipeError:
        return facts


def _shown(value: Any) -> str:
    """A config value as the user writes it (``[0, -1]``, ``true``, ``null``), not a Python repr."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
