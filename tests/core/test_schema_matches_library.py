"""One source of truth: the workflow schema and the CLI say what embedpipe/core/options.py says.

Every enum and default of workflows/schemas/config.schema.yaml that is also a library option
must equal the Python one, and every default of a CLI option must be the library's, so that
changing a default or adding an allowed value in embedpipe/core/options.py cannot leave the
workflow or the command line behind.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from embedpipe.cli import app
from embedpipe.core import options
from embedpipe.core.options import EmbedOptions, Thresholds
from embedpipe.runtime import engine_override

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = yaml.safe_load((ROOT / "workflows" / "schemas" / "config.schema.yaml").read_text())
PROPERTIES = SCHEMA["properties"]
EMBED = EmbedOptions()

#: schema key -> (allowed values, default) in the library
CHOICES = {
    "precision": (options.PRECISION_CHOICES, EMBED.precision),
    "storage_dtype": (options.STORAGE_DTYPES, EMBED.storage_dtype),
    "long_sequences": (options.LONG_SEQUENCE_MODES, EMBED.long_sequences),
    "int8_smoothing": (options.INT8_SMOOTHINGS, EMBED.int8_smoothing),
    "on_invalid": (options.ON_INVALID, options.ON_INVALID_DEFAULT),
}
#: schema key -> the library's default
DEFAULTS = {
    "layers": list(EMBED.layers),
    "per_residue": EMBED.per_residue,
    "tokens_per_batch": EMBED.tokens_per_batch,
    "tokens_per_shard": options.TOKENS_PER_SHARD,
    "max_jobs": options.MAX_JOBS,
    "max_record_length": options.FASTA_LIMITS.max_length,
    "max_id_length": options.FASTA_LIMITS.max_id_length,
    "device": EMBED.device,
    "int8_calibration": EMBED.int8_calibration,
    "accept_platform_mix": EMBED.accept_platform_mix,
}


def _command(name: str) -> Any:
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def _cli_defaults(name: str) -> dict[str, Any]:
    return {param.name: param.default for param in _command(name).params}


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_schema_enums_and_defaults_equal_the_library_choices(key: str) -> None:
    allowed, default = CHOICES[key]
    assert PROPERTIES[key]["enum"] == list(allowed), key
    assert PROPERTIES[key]["default"] == default, key


@pytest.mark.parametrize("key", sorted(DEFAULTS))
def test_schema_defaults_equal_the_library_defaults(key: str) -> None:
    assert PROPERTIES[key]["default"] == DEFAULTS[key], key


def test_schema_minimums_and_device_pattern_match_the_library() -> None:
    number, word = PROPERTIES["tokens_per_batch"]["oneOf"]  # the number first: coercion tries it first
    assert number == {"type": "integer", "minimum": options.MIN_TOKENS_PER_BATCH}
    assert word == {"type": "string", "enum": [options.AUTO]}
    assert PROPERTIES["tokens_per_shard"]["minimum"] == 1
    assert PROPERTIES["max_jobs"]["minimum"] == 1
    assert PROPERTIES["max_record_length"]["minimum"] == PROPERTIES["max_id_length"]["minimum"] == 1
    pattern = re.compile(PROPERTIES["device"]["pattern"])
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:12", EMBED.device):
        assert pattern.fullmatch(device), device


@pytest.mark.parametrize("key, allowed, default", [
    ("pooling", options.POOLINGS, list(EMBED.pooling)),
    ("exports", options.EXPORT_FORMATS, []),
])
def test_schema_list_keys_allow_the_library_choices(key: str, allowed: tuple[str, ...], default: list[str]) -> None:
    assert PROPERTIES[key]["items"]["enum"] == list(allowed)
    assert PROPERTIES[key]["default"] == default


def test_schema_crosscheck_defaults_equal_the_library() -> None:
    crosscheck = PROPERTIES["crosscheck"]
    expected = {"sample": options.CROSSCHECK_SAMPLE, "seed": options.CROSSCHECK_SEED}
    assert crosscheck["default"] == expected
    assert {key: spec["default"] for key, spec in crosscheck["properties"].items() if "default" in spec} == expected
    assert crosscheck["properties"]["sample"]["minimum"] == 1
    # the optional label keys (issue 25): no default, the CLI's choices
    assert not {"labels", "label_kind", "ignore_unknown_ids"} & set(crosscheck["default"])
    assert crosscheck["properties"]["label_kind"]["enum"] == list(options.LABEL_KINDS)


#: EmbedOptions fields that are no embed flag of their own: where each is given instead
NOT_EMBED_FLAGS = {
    "auto_cache": "the environment (EMBEDPIPE_AUTO_CACHE)",
    "auto_measure": "decide-precision --auto-measure",
    "int8_calibration": "--int8-smoothing smoothquant:FASTA",
}


def test_every_embed_option_has_the_library_default_on_the_command_line() -> None:
    from embedpipe.cli.commands import _int_list

    cli = _cli_defaults("embed")
    cli["layers"] = list(_int_list(cli["layers"], "--layers"))  # a comma list on the command line
    assert set(NOT_EMBED_FLAGS) <= {field.name for field in dataclasses.fields(EmbedOptions)}
    assert not set(NOT_EMBED_FLAGS) & set(cli)
    for field in dataclasses.fields(EmbedOptions):
        if field.name not in NOT_EMBED_FLAGS:
            default = getattr(EMBED, field.name)
            assert cli[field.name] == (list(default) if isinstance(default, tuple) else default), field.name
    assert _cli_defaults("decide-precision")["auto_measure"] == EMBED.auto_measure
    assert options.split_int8_smoothing(cli["int8_smoothing"]) == (EMBED.int8_smoothing, EMBED.int8_calibration)


def test_shard_and_crosscheck_defaults_on_the_command_line_are_the_library_ones() -> None:
    shard = _cli_defaults("shard")
    assert (shard["tokens_per_shard"], shard["on_invalid"], shard["max_jobs"]) == (
        options.TOKENS_PER_SHARD, options.ON_INVALID_DEFAULT, options.MAX_JOBS)
    limits = options.FASTA_LIMITS
    for command in (shard, _cli_defaults("embed")):  # both read FASTA through the same reader
        assert (command["max_record_length"], command["max_id_length"]) == (limits.max_length, limits.max_id_length)
    crosscheck = _cli_defaults("crosscheck")
    for field in dataclasses.fields(Thresholds):
        assert crosscheck[field.name] == getattr(Thresholds(), field.name), field.name
    assert (crosscheck["sample"], crosscheck["seed"], crosscheck["k"], crosscheck["device"]) == (
        options.CROSSCHECK_SAMPLE, options.CROSSCHECK_SEED, options.CROSSCHECK_K, options.DEFAULT_DEVICE)


def test_library_functions_default_to_the_same_values() -> None:
    from embedpipe.crosscheck.run import run_crosscheck
    from embedpipe.model.random_checkpoint import make_test_model
    from embedpipe.shard.passes import shard_fasta

    def defaults(func: Any) -> dict[str, Any]:
        return {name: p.default for name, p in inspect.signature(func).parameters.items()
                if p.default is not inspect.Parameter.empty}

    assert defaults(shard_fasta)["on_invalid"] == options.ON_INVALID_DEFAULT
    assert defaults(shard_fasta)["max_jobs"] == options.MAX_JOBS
    assert defaults(shard_fasta)["limits"] == options.FASTA_LIMITS
    crosscheck = defaults(run_crosscheck)
    assert (crosscheck["sample"], crosscheck["seed"], crosscheck["k"], crosscheck["device"]) == (
        options.CROSSCHECK_SAMPLE, options.CROSSCHECK_SEED, options.CROSSCHECK_K, options.DEFAULT_DEVICE)
    cli = _cli_defaults("make-test-model")
    library = defaults(make_test_model)
    assert {key: cli[key] for key in ("layers", "dim", "heads", "seed")} == {
        key: library[key] for key in ("layers", "dim", "heads", "seed")}


def test_the_precision_module_defines_exactly_the_named_policies() -> None:
    from embedpipe.runtime.precision import POLICIES

    assert tuple(POLICIES) == options.POLICY_NAMES
    assert tuple(name for name, policy in POLICIES.items() if policy.fp32_islands) == options.FP32_ISLAND_POLICIES


@pytest.mark.parametrize(
    ("command", "option", "allowed"),
    [
        ("embed", "precision", options.POLICY_NAMES),
        ("embed", "storage_dtype", options.STORAGE_DTYPES),
        ("embed", "long_sequences", options.LONG_SEQUENCE_MODES),
        ("embed", "int8_smoothing", options.INT8_SMOOTHINGS),
        ("shard", "on_invalid", options.ON_INVALID),
    ],
)
def test_help_lists_every_allowed_value(command: str, option: str, allowed: tuple[str, ...]) -> None:
    (param,) = [p for p in _command(command).params if p.name == option]
    words = re.findall(r"[\w-]+", param.help)
    assert all(value in words for value in allowed), (option, param.help)


def test_tokens_per_batch_help_names_auto_its_cpu_budget_and_the_minimum() -> None:
    (param,) = [p for p in _command("embed").params if p.name == "tokens_per_batch"]
    words = re.findall(r"[\w-]+", param.help)
    assert options.AUTO in words and str(options.CPU_TOKENS_PER_BATCH) in words
    assert str(options.MIN_TOKENS_PER_BATCH) in words


def test_every_embed_option_is_a_workflow_key_or_set_by_the_rule() -> None:
    """A new EmbedOptions field must reach the workflow: a schema key, or one the embed rule sets."""
    set_by_the_rule = {"auto_cache"}  # the cache its jobs share (environment)
    not_in_the_workflow = {"overflow_margin"}  # command-line only, for now
    fields = {field.name for field in dataclasses.fields(EmbedOptions)}
    assert fields - set(PROPERTIES) - set_by_the_rule == not_in_the_workflow
    rule = (Path(__file__).resolve().parents[2] / "workflows" / "rules" / "embed.smk").read_text()
    assert '" {THREADS_OPTION}"' in rule and "--auto-cache" not in rule  # --threads only when the config sets it
    assert re.search(r'EMBEDPIPE_AUTO_CACHE=\{AUTO_CACHE\}"\s*" embedpipe embed ', rule)  # the job's environment


def test_the_engine_choices_are_no_option_workflow_key_or_rule_argument() -> None:
    """The run derives the engine choices (extraction/resolved.py); ``EMBEDPIPE_ENGINE`` is their only
    override: no ``EmbedOptions`` field, schema key, embed flag or rule argument names one, and
    ``--compile`` is gone with its cache."""
    removed = {*engine_override.CHOICES, "compile", "compile_cache"}
    assert not removed & {field.name for field in dataclasses.fields(EmbedOptions)}
    assert not removed & set(PROPERTIES)
    assert not removed & {p.name for p in _command("embed").params}
    rules = "".join(path.read_text() for path in (ROOT / "workflows" / "rules").glob("*.smk"))
    for name in removed:
        assert "--" + name.replace("_", "-") not in rules and f'config["{name}"]' not in rules, name
