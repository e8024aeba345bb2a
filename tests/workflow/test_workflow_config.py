"""embedpipe.workflow.config: --config overrides coerced to the schema's types, one-line errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from embedpipe.core.options import EmbedOptions, FastaLimits
from embedpipe.workflow.config import (
    DEFAULT_THREADS,
    ConfigError,
    check,
    check_outdir,
    coerce,
    embed_args,
    embed_keys,
    embed_options,
    job_threads,
    load_schema,
    normalise,
    retry_tokens_per_batch,
    threads_option,
    unknown_keys,
)

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = ROOT / "workflows" / "schemas" / "config.schema.yaml"


@pytest.fixture(scope="module")
def schema():
    return load_schema(SCHEMA_PATH)


def _base() -> dict:
    return yaml.safe_load((ROOT / "configs" / "offline-demo.yaml").read_text())


def _as_snakemake_parses(text: str):
    """How `snakemake --config key=TEXT` reads a list or mapping: YAML BaseLoader, all strings."""
    return yaml.load(text, Loader=yaml.BaseLoader)


def test_command_line_lists_and_mappings_equal_their_config_file_form(schema):
    for key, text in [("layers", "[0,-1]"), ("crosscheck", '{"sample": 8, "seed": -3}'),
                      ("test_model", "{layers: 2, dim: 32, heads: 4, seed: 1}"), ("input", "[a.fa, 'b*.fa']")]:
        parsed = _as_snakemake_parses(text)
        assert parsed != yaml.safe_load(text) or key == "input"  # the strings snakemake hands over
        config = _base() | {key: parsed}
        normalise(config, schema)
        assert config[key] == yaml.safe_load(text), key


def test_coerce_leaves_what_does_not_convert_for_validation_to_name(schema):
    assert coerce(["1", "x", "2.5"], schema["properties"]["layers"]) == [1, "x", "2.5"]
    assert coerce("null", schema["properties"]["test_model"]) is None
    assert coerce({"sample": "8"}, schema["properties"]["crosscheck"]) == {"sample": 8}
    assert coerce("yes", {"type": "boolean"}) is True and coerce("Off", {"type": "boolean"}) is False
    assert coerce("1e3", {"type": "number"}) == 1000.0 and coerce("-7", {"type": "number"}) == -7
    assert coerce("007", {"type": "string"}) == "007"
    with pytest.raises(ConfigError, match=r"invalid value for 'layers\.1': 'x' is not of type 'integer'"):
        normalise(_base() | {"layers": ["0", "x"]}, schema)


def test_misspelled_keys_name_the_nearest_valid_key(schema):
    config = _base() | {"precison": "fp16", "crosscheck": {"smaple": 8}}
    assert sorted(unknown_keys(config, schema)) == [("crosscheck.smaple", ["sample"]), ("precison", ["precision"])]
    with pytest.raises(ConfigError, match=r"unknown key 'precison'; did you mean 'precision'\?"):
        check(config | {"crosscheck": {"sample": 8}}, schema)
    with pytest.raises(ConfigError) as info:
        check(_base() | {"zzzz": 1}, schema)
    assert "did you mean" not in str(info.value) and "\n" not in str(info.value)


def test_bad_values_are_one_line(schema):
    with pytest.raises(ConfigError) as info:
        check(_base() | {"precision": "fp8"}, schema)
    message = str(info.value)
    assert "\n" not in message and "'precision'" in message and "fp8" in message
    check(_base(), schema)  # the shipped configs pass
    check({"input": "x.fa"}, schema)  # missing keys take the schema's defaults
    check(yaml.safe_load((ROOT / "configs" / "config.yaml").read_text()), schema)


def test_outdir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"outdir.*f exists and is not a directory"):
        check_outdir(str(tmp_path / "f"))
    check_outdir(str(tmp_path))
    check_outdir(str(tmp_path / "new"))


def test_tokens_per_batch_is_auto_or_a_number_of_at_least_3(schema):
    for text, expected in [("auto", "auto"), ("8192", 8192), (" 3", 3)]:
        config = _base() | {"tokens_per_batch": text}  # a string, as `--config tokens_per_batch=...` may give
        normalise(config, schema)
        assert config["tokens_per_batch"] == expected, text
    for bad in ("2", "Auto", "lots", 4096.5):
        with pytest.raises(ConfigError) as info:
            normalise(_base() | {"tokens_per_batch": bad}, schema)
        assert "'tokens_per_batch'" in str(info.value) and "\n" not in str(info.value), bad
    check({"input": "x.fa"}, schema)  # the default, auto, passes


@pytest.mark.parametrize("key", ["batch_layout", "attention_inputs", "fallback_device", "compile", "attention"])
def test_the_engine_choices_are_no_workflow_keys(schema, key):
    """The run derives them (docs/precision.md, "Engine choices"): a config that sets one is refused
    as an unknown key, like any other."""
    with pytest.raises(ConfigError, match=rf"'{key}'"):
        check(_base() | {key: "auto"}, schema)


def test_precision_auto_is_accepted_and_left_for_the_job_to_resolve(schema):
    """`precision: auto` passes the schema as written; the rules pass it on verbatim (decided once
    for the run by a job, docs/precision.md, "One decision per run"), never resolved at parse time."""
    check(_base() | {"precision": "auto"}, schema)
    args = embed_args(_filled(schema) | {"precision": "auto"})
    assert args[args.index("--precision") + 1] == "auto"
    with pytest.raises(ConfigError, match=r"'precision'.*'automatic'"):
        check(_base() | {"precision": "automatic"}, schema)


def test_precision_auto_runs_the_runs_one_decision_file(schema):
    """Given the decision file (rule decide_precision's output), `precision: auto` becomes
    `--precision auto:FILE`; a named policy is passed as it is (docs/precision.md, "One decision per run")."""
    auto = embed_args(_filled(schema) | {"precision": "auto"}, decision="out/precision-decision.json")
    assert auto[auto.index("--precision") + 1] == "auto:out/precision-decision.json"
    named = embed_args(_filled(schema) | {"precision": "bf16-mixed"}, decision="out/precision-decision.json")
    assert named[named.index("--precision") + 1] == "bf16-mixed"


def test_auto_measure_is_passed_only_when_set(schema):
    """`auto_measure` came after runs existed: at its default the jobs' command lines are as
    before (Snakemake reruns a job whose params changed); `always` reaches the run's decision
    (decide-precision takes embed's options), not the jobs that run it (they measure nothing)."""
    config = _filled(schema) | {"precision": "auto"}
    assert config["auto_measure"] == "auto" and "--auto-measure" not in embed_args(config)
    args = embed_args(config | {"auto_measure": "always"})
    assert args[args.index("--auto-measure") + 1] == "always"
    assert "--auto-measure" not in embed_args(config | {"auto_measure": "always"}, decision="out/d.json")
    with pytest.raises(ConfigError, match=r"'auto_measure'.*'sometimes'"):
        check(_base() | {"precision": "auto", "auto_measure": "sometimes"}, schema)
    from embedpipe.core.errors import EmbedpipeError
    with pytest.raises(EmbedpipeError, match="--auto-measure always applies to --precision auto only, not fp32"):
        embed_options(_filled(schema) | {"auto_measure": "always"}).validate()


def _filled(schema) -> dict:
    """The demo config with the schema's defaults filled in, as Snakemake's ``validate`` fills them."""
    defaults = {key: spec["default"] for key, spec in schema["properties"].items() if "default" in spec}
    return defaults | _base()


def _other(spec: dict):
    """A value of a config key other than its default, from its schema entry alone."""
    default = spec.get("default")
    number = next((branch for branch in spec.get("oneOf", []) if branch.get("type") == "integer"), None)
    if number is not None and default is None:  # a number or null (threads)
        return number.get("minimum", 1) + 1
    if spec.get("type") == "boolean":
        return not default
    if "enum" in spec:
        return next(v for v in reversed(spec["enum"]) if v != default)
    if spec.get("type") == "array":
        items = spec["items"]
        return list(items["enum"]) if "enum" in items else [0, -1]
    if spec.get("type") == "integer":
        return default // 2
    if "pattern" in spec:
        return "cpu"
    return "calibration.fasta"  # a path (int8_calibration)


def _parsed_by_the_cli(args: list[str], monkeypatch, command: str = "embed") -> dict:
    """What ``embedpipe embed``'s (or ``decide-precision``'s) own parser makes of ``args``: the
    keywords its library call gets (``options``, ``limits``, embed's ``decision``), nothing run."""
    from typer.testing import CliRunner

    from embedpipe.cli import app
    from embedpipe.extraction import auto_decision, run

    seen: dict = {}
    if command == "embed":
        monkeypatch.setattr(run, "embed_command", lambda *a, **kw: seen.update(kw))
        head = ["embed", "in.fa", "--model", "m.pt", "--out", "o.h5", "-q"]
    else:
        monkeypatch.setattr(run, "start_checks", lambda fastas, model, options, reuse, limits: (
            seen.update(options=options, limits=limits), (None, limits))[1])
        monkeypatch.setattr(auto_decision, "decide_run", lambda *a, **kw: "")
        head = ["decide-precision", "in.fa", "--model", "m.pt", "--out", "d.json", "-q"]
    result = CliRunner().invoke(app, [*head, *args])
    assert "options" in seen, result.output
    return seen


@pytest.mark.parametrize("changed", ["defaults", "demo", "all"])
def test_the_embed_args_are_the_config_s_options_as_the_cli_parses_them(schema, monkeypatch, changed):
    """The one mapping from config to command line (common.smk passes it to every embed job):
    the CLI's own parser gives back every embed option and FASTA limit the config holds. Under
    ``precision: auto`` the jobs run the run's decision (``auto_measure`` is the decision's, not
    theirs), and ``decide-precision`` gets the options as given, ``auto_measure`` included."""
    config = _filled(schema)
    if changed == "defaults":  # every switch off
        config = {key: spec["default"] for key, spec in schema["properties"].items() if "default" in spec}
    if changed == "all":
        config |= {key: _other(schema["properties"][key]) for key in [*embed_keys(config), "max_record_length",
                                                                       "max_id_length"]}
        assert all(config[key] != schema["properties"][key].get("default") for key in embed_keys(config))
        assert config["precision"] == "auto" and config["int8_calibration"] is not None
    decision = "out/precision-decision.json" if config["precision"] == "auto" else None
    limits = FastaLimits(config["max_record_length"], config["max_id_length"])
    job = _parsed_by_the_cli(embed_args(config, leave=("tokens_per_batch",), decision=decision), monkeypatch)
    # threads: the rules put it on the shell line themselves (threads_option), never in the params
    as_run = {"tokens_per_batch": EmbedOptions.tokens_per_batch, "auto_measure": EmbedOptions.auto_measure,
              "threads": None}
    assert job["options"] == embed_options(config | as_run) and job["limits"] == limits
    assert job["decision"] == (Path(decision) if decision else None)
    if decision is not None:
        decided = _parsed_by_the_cli(embed_args(config, leave=("tokens_per_batch",)), monkeypatch, "decide-precision")
        assert decided["options"] == embed_options(config | {"tokens_per_batch": EmbedOptions.tokens_per_batch, "threads": None})
        assert decided["limits"] == limits


def test_every_switch_is_off_by_default():
    """embed_args passes a bool option as its flag when on, nothing when off: right only while
    every bool option is off by default."""
    switches = {name: value for name, value in vars(EmbedOptions()).items() if isinstance(value, bool)}
    assert switches and not any(switches.values()), switches


def test_the_rules_spell_no_embed_option(schema):
    """The embed rule and common.smk's embed_options take every embed option from embed_args:
    no second mapping by hand (other commands' flags of the same name, crosscheck's --device,
    make-test-model's --layers, are theirs)."""
    rules = ROOT / "workflows" / "rules"
    common = rules.joinpath("common.smk").read_text(encoding="utf-8")
    function = re.search(r"\ndef embed_options\(\):\n(.*?)\n(?=\S)", common, re.S)
    assert function and "workflow_config.embed_args(config" in function.group(1)
    for text in (function.group(1), rules.joinpath("embed.smk").read_text(encoding="utf-8")):
        code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
        for key in embed_keys(schema["properties"]):
            if key != "tokens_per_batch":  # the embed rule's resource: smaller on each retry
                assert not re.search(rf"--{key.replace('_', '-')}(?![\w-])", code), key


def test_the_jobs_threads_come_from_the_package_and_reach_the_shell_line_only_when_set(schema):
    """The rules ask the scheduler for the config's `threads` (the package's default when unset)
    and pass `--threads` (the job's scheduled count, a Snakemake template) only when it is set;
    it is never a param, so changing it re-embeds nothing. No rule spells a count of its own."""
    config = _filled(schema)
    assert config["threads"] is None  # the schema's default: unset
    assert (job_threads(config), threads_option(config)) == (DEFAULT_THREADS, "")
    assert (job_threads(config | {"threads": 6}), threads_option(config | {"threads": 6})) == (6, "--threads {threads}")
    assert "--threads" not in embed_args(config | {"threads": 6})
    given = _base() | {"threads": "3"}  # --config threads=3
    normalise(given, schema)
    assert given["threads"] == 3
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'threads'"):
        check(_base() | {"threads": 0}, schema)
    rules = ROOT / "workflows" / "rules"
    for name in ("embed.smk", "crosscheck.smk", "precision.smk"):
        code = "\n".join(line.split("#", 1)[0] for line in (rules / name).read_text(encoding="utf-8").splitlines())
        assert not re.search(r"threads:\s*\d", code) and "--threads" not in code and "THREADS_OPTION" in code, name


def test_a_retried_job_s_batch_budget_stops_at_the_package_s_minimum():
    from embedpipe.core.options import MIN_TOKENS_PER_BATCH

    assert [retry_tokens_per_batch(4096, attempt) for attempt in (1, 2, 3)] == [4096, 2048, 1365]
    assert retry_tokens_per_batch(MIN_TOKENS_PER_BATCH + 1, 2) == MIN_TOKENS_PER_BATCH
    common = (ROOT / "workflows" / "rules" / "common.smk").read_text(encoding="utf-8")
    assert "workflow_config.retry_tokens_per_batch(" in common and not re.search(r"max\(\d", common)
