"""Every option combination ``embedpipe embed`` refuses is refused by the workflow at parse time,
with the same line (issue 34, item 1): one function decides for both (embedpipe.extraction.combinations).

Each case is run twice, independently: the CLI (``embedpipe embed ...``, its one stderr line) and
the workflow's config parsing (the schema's coercion, then the check common.smk calls); two
cases also through ``snakemake -n``. The CLI's single-value refusals (an unknown precision, a
pooling, a tokens_per_batch under 3, ...) are the schema's enums and minimums in the workflow
(tests/workflow/test_workflow_config.py); ``--overflow-margin`` is not a workflow key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.extraction.combinations import CHECKS
from embedpipe.model import describe
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.workflow.config import ConfigError, check_embed_config, load_schema, normalise
from helpers.embed_helpers import write_fasta
from helpers.workflow_helpers import EXAMPLE, ROOT, snakemake

SCHEMA = load_schema(ROOT / "workflows" / "schemas" / "config.schema.yaml")
ESM2 = "esm2_t6_8M_UR50D"  # described from the name table: no file is read

#: check (embedpipe.extraction.combinations.CHECKS) -> cases: (model, config overrides, CLI options)
CASES: dict[str, list[tuple[str, dict[str, Any], list[str]]]] = {
    "_values": [
        (ESM2, {"precision": "fp32", "int8_smoothing": "smoothquant"}, ["--int8-smoothing", "smoothquant"]),
        (ESM2, {"int8_calibration": "CALIB"}, ["--int8-smoothing", "none:CALIB"]),
    ],
    "_device": [(ESM2, {"precision": "int8-mixed", "device": "cuda"}, ["--precision", "int8-mixed", "--device", "cuda"])],
    "_family": [
        ("T5", {"pooling": ["mean", "bos"]}, ["--pooling", "mean", "--pooling", "bos"]),
    ],
    "_layers": [
        (ESM2, {"layers": [99]}, ["--layers", "99"]),
        ("TEST", {"layers": [0, -4]}, ["--layers", "0,-4"]),
    ],
    "_reuse": [(ESM2, {"reuse": ["old/embeddings.h5"]}, ["--reuse", "old/embeddings.h5"])],
    "_calibration": [
        (ESM2, {"precision": "int8-mixed", "int8_smoothing": "smoothquant", "int8_calibration": "missing.fasta"},
         ["--precision", "int8-mixed", "--int8-smoothing", "smoothquant:missing.fasta"]),
        (ESM2, {"precision": "int8-mixed", "int8_smoothing": "smoothquant", "int8_calibration": "EMPTY"},
         ["--precision", "int8-mixed", "--int8-smoothing", "smoothquant:EMPTY"]),
    ],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


def test_every_check_has_a_case() -> None:
    """A new refusal in extraction/combinations.py needs its case here (so the workflow is asked too)."""
    assert sorted(check.__name__ for check in CHECKS) == sorted(CASES)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    t5 = make_hf_test_model(root / "ankh", family="ankh", layers=1, dim=16, heads=2)
    test = root / "esm2_test_t2_32.pt"
    make_test_model(test, layers=2, dim=32, heads=4, seed=0)
    (root / "calib.fasta").write_text(">a\nMKTAYIAK\n")
    (root / "empty.fasta").write_text("")
    return {"T5": str(t5), "TEST": str(test), ESM2: ESM2, "CALIB": str(root / "calib.fasta"),
            "EMPTY": str(root / "empty.fasta")}


def _filled(value: Any, models: dict[str, str]) -> Any:
    """The case with the fixture's paths put in for their names (T5, TEST, CALIB, EMPTY), also
    after a colon (``smoothquant:EMPTY``)."""
    if isinstance(value, dict):
        return {key: _filled(v, models) for key, v in value.items()}
    if isinstance(value, list):
        return [_filled(v, models) for v in value]
    if not isinstance(value, str):
        return value
    head, colon, name = value.rpartition(":")
    return f"{head}{colon}{models.get(name, name)}"


def _cli_line(tmp_path: Path, model: str, options: list[str]) -> str:
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKTAYIAK")])
    out = tmp_path / "o.h5"
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", model, "--out", str(out), "--quiet", *options])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.stderr
    assert not out.exists()
    return lines[0].removeprefix("embedpipe: error: ")


def _workflow_line(config: dict[str, Any], model: str) -> tuple[str, dict[str, Any]]:
    """The workflow's refusal, and its config as Snakemake's validation fills it (defaults)."""
    config = {"input": str(EXAMPLE), "outdir": "out", "model": model, **config}
    if model.endswith(".pt"):  # as the workflow sees its test model: the depth from test_model
        config["test_model"] = {"layers": 2, "dim": 32, "heads": 4, "seed": 0}
    normalise(config, SCHEMA)
    config = {key: spec["default"] for key, spec in SCHEMA["properties"].items() if "default" in spec} | config
    with pytest.raises(ConfigError) as refused:
        check_embed_config(config, describe(model))
    return str(refused.value), config


def _as_written(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


@pytest.mark.parametrize(("check", "model", "config", "options"), ALL, ids=[f"{c[0]}-{i}" for i, c in enumerate(ALL)])
def test_the_workflow_refuses_what_the_cli_refuses_with_the_same_line(
        tmp_path: Path, models: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        check: str, model: str, config: dict[str, Any], options: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    config, options = _filled(config, models), _filled(options, models)
    cli = _cli_line(tmp_path, models[model], options)
    workflow, filled = _workflow_line(config, models[model])
    named = dict.fromkeys(flag.replace("-", "_") for flag in re.findall(r"--([a-z0-9-]+)", cli))
    assert named and set(named) <= set(filled), (named, cli)  # the line names workflow keys only
    assert workflow == f"config {', '.join(f'{key}={_as_written(filled[key])}' for key in named)}: {cli}"


@pytest.mark.parametrize(("model", "config"), [(ESM2, "precision=fp32 int8_smoothing=smoothquant"),
                                               (ESM2, "precision=int8-mixed device=cuda")])
def test_snakemake_dry_run_stops_before_any_job(tmp_path: Path, models: dict[str, str], model: str,
                                                config: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"input": str(EXAMPLE), "outdir": "out", "model": models[model], "device": "cpu"}))
    proc = snakemake(tmp_path, "-n", "--config", *config.split(), configfile=path, check=False)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Job stats" not in proc.stdout + proc.stderr
    head, _, reason = line.partition(": --")
    assert head.startswith("embedpipe: config ") and set(config.split()) <= set(head[18:].split(", ")), line
    assert all(f"--{word.split('=')[0].replace('_', '-')}" in "--" + reason for word in config.split()), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["layers of a .pt by path", "calibration's second record"])
def test_snakemake_dry_run_refuses_what_the_job_would_refuse(tmp_path: Path, models: dict[str, str], case: str) -> None:
    """``snakemake -n`` passed, and the embed job then refused: ``layers: [5]`` with a 2-layer
    checkpoint given by path (its depth read from its header now), and a calibration FASTA
    whose second record is invalid (read in full now, with the job's reader)."""
    bad = tmp_path / "calib.fasta"
    bad.write_text(">a\nMKTAYIAK\n>b\nMKT@AYIAK\n")
    config, options = {
        "layers of a .pt by path": ({"model": models["TEST"], "layers": [5]}, ["--layers", "5"]),
        "calibration's second record": (
            {"model": models["TEST"], "precision": "int8-mixed", "int8_smoothing": "smoothquant",
             "int8_calibration": str(bad)},
            ["--precision", "int8-mixed", "--int8-smoothing", f"smoothquant:{bad}"]),
    }[case]
    cli = _cli_line(tmp_path, models["TEST"], options)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"input": str(EXAMPLE), "outdir": "out", "device": "cpu", **config}))
    proc = snakemake(tmp_path, "-n", configfile=path, check=False)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Job stats" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert line.startswith("embedpipe: config ") and line.endswith(f": {cli}"), (line, cli)
    assert not (tmp_path / "out").exists()


def test_snakemake_dry_run_stops_in_one_line_on_a_model_directory_embedpipe_refuses(
        tmp_path: Path, models: dict[str, str]) -> None:
    """A model directory whose config.json embedpipe refuses (here nested past the JSON bound)
    stops ``snakemake -n`` with the refusal as one line, the line ``embedpipe model-info`` gives;
    before, a multi-line ModelError traceback."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(models["T5"], model)
    config_json = model / "config.json"
    config_json.write_text(config_json.read_text().rstrip()[:-1] + ', "deep": ' + "[" * 1000 + "]" * 1000 + "}")
    cli = CliRunner().invoke(app, ["model-info", str(model)])
    assert cli.exit_code == 1
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"input": str(EXAMPLE), "outdir": "out", "model": str(model), "device": "cpu"}))
    proc = snakemake(tmp_path, "-n", configfile=path, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [cli.stderr.strip().replace("embedpipe: error: ", "embedpipe: ", 1)]
    assert "Traceback" not in proc.stdout + proc.stderr and not (tmp_path / "out").exists()
