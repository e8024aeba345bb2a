"""Deeply nested JSON in a model directory (``config.json``, an ESM C or ProtT5
``tokenizer.json``, ``model.safetensors.index.json``, a safetensors header's metadata) is one
line naming the file from ``embed`` and ``model-info``, through the bounded parser store
attributes use (embedpipe/core/jsonbounds.py); before, each was a RecursionError traceback.

Independent computation: the nesting depth each test writes is known from how it is built
(the error quotes it), and the file each refusal must name is the file the test edited."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.jsonbounds import MAX_JSON_DEPTH
from embedpipe.model.random_hf import make_hf_test_model
from helpers.embed_helpers import write_fasta

#: the nesting the issue's files held: far past Python's recursion limit
DEEP = 100_000
NESTED = "[" * DEEP + "]" * DEEP


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: make_hf_test_model(root / family, family=family, layers=1, dim=16, heads=2, seed=0)
            for family in ("hf-esm", "prot-t5", "esmc")}


def _copy(source: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(source, out)
    return out


def _nest_key(path: Path) -> None:
    """Add the key ``deep`` holding :data:`NESTED` to the JSON object in ``path`` (depth DEEP + 1)."""
    text = path.read_text().rstrip()
    assert text.endswith("}")
    path.write_text(text[:-1] + ', "deep": ' + NESTED + "}")


def _run(args: list[str]) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, args)
    return result.exit_code, result.stderr.strip().splitlines()


def _embed(model: Path, tmp_path: Path) -> tuple[int, list[str]]:
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKTAYIAKQR")])
    code, lines = _run(["embed", str(fasta), "--model", str(model), "--out", str(tmp_path / "o.h5"),
                        "--device", "cpu", "--quiet"])
    assert not (tmp_path / "o.h5").exists()
    return code, lines


def _refused(lines: list[str], what: str, depth: int) -> None:
    assert lines == [f"embedpipe: error: {what} is JSON nested {depth} levels deep, more than {MAX_JSON_DEPTH}: "
                     "refusing to parse it"], lines


@pytest.mark.parametrize("family", ["hf-esm", "prot-t5", "esmc"])
def test_a_nested_config_json_is_one_line_from_embed_and_model_info(dirs, tmp_path, family) -> None:
    model = _copy(dirs[family], tmp_path)
    _nest_key(model / "config.json")
    for code, lines in (_run(["model-info", str(model)]), _embed(model, tmp_path)):
        assert code == 1
        _refused(lines, str(model / "config.json"), DEEP + 1)


@pytest.mark.parametrize("family", ["prot-t5", "esmc"])
def test_a_nested_tokenizer_json_is_one_line(dirs, tmp_path, family) -> None:
    """The tokenizer is read when the model loads (model-info reads none: it has nothing to refuse)."""
    model = _copy(dirs[family], tmp_path)
    _nest_key(model / "tokenizer.json")
    code, lines = _embed(model, tmp_path)
    assert code == 1
    _refused(lines, str(model / "tokenizer.json"), DEEP + 1)
    code, lines = _run(["model-info", str(model)])
    assert code == 0, lines


def test_a_nested_weight_index_is_one_line(dirs, tmp_path) -> None:
    """model-info counts no weights it cannot find (as for a directory not fetched yet); embed refuses."""
    model = _copy(dirs["hf-esm"], tmp_path)
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1},
                                 "weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    _nest_key(index)
    code, lines = _embed(model, tmp_path)
    assert code == 1
    _refused(lines, str(index), DEEP + 1)
    code, lines = _run(["model-info", str(model)])
    assert code == 0 and not any("Traceback" in line for line in lines), lines


def test_a_nested_safetensors_header_is_one_line(dirs, tmp_path) -> None:
    """The header's ``__metadata__`` nested: model-info counts parameters from the header."""
    model = _copy(dirs["hf-esm"], tmp_path)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header)
    text = re.sub(r'"__metadata__": \{"format": "pt"\}', '"__metadata__": {"deep": ' + NESTED + "}", text)
    raw = text.encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size :])
    for code, lines in (_run(["model-info", str(model)]), _embed(model, tmp_path)):
        assert code == 1
        _refused(lines, f"{weights}: the safetensors header", DEEP + 2)


def test_a_config_within_the_bounds_still_loads(dirs, tmp_path) -> None:
    """Nesting up to the bound is read as before (the bound refuses only what json cannot parse safely)."""
    model = _copy(dirs["hf-esm"], tmp_path)
    text = (model / "config.json").read_text().rstrip()
    (model / "config.json").write_text(text[:-1] + ', "deep": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
                                       + "}")
    code, lines = _run(["model-info", str(model), "--json"])
    assert code == 0, lines
