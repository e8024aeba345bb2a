"""embedpipe.workflow.config: --config overrides coerced to the schema's types, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from embedpipe.workflow.config import ConfigError, check, check_outdir, coerce, load_schema, normalise, unknown_keys

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
    """`precision: auto` passes the schema as written; the rules pass it on verbatim (each embed job
    chooses on its own node: docs/precision.md, "precision: auto"), never resolved at parse time."""
    check(_base() | {"precision": "auto"}, schema)
    common = (ROOT / "workflows" / "rules" / "common.smk").read_text()
    assert 'args = ["--precision", config["precision"]]' in common
    with pytest.raises(ConfigError, match=r"'precision'.*'automatic'"):
        check(_base() | {"precision": "automatic"}, schema)
