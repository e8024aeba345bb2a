"""What `model-info`, `info` and the identity's refusals print reads as text, not as Python
(issue 34: `parameters: None`, `fair-esm ?` on T5 stores, `True` and dicts in messages)."""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.extraction.identity import IDENTITY_VERSION, describe_difference
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.model.random_hf import make_hf_test_model
from helpers.embed_helpers import embed_store

PYTHON_WORDS = re.compile(r"\b(None|True|False)\b|\{'")


def test_model_info_of_a_hf_directory_prints_no_python_values(tmp_path: Path) -> None:
    directory = make_hf_test_model(tmp_path / "pt5", family="prot-t5", layers=1, dim=16, heads=2)
    result = CliRunner().invoke(app, ["model-info", str(directory)])
    assert result.exit_code == 0 and not PYTHON_WORDS.search(result.stdout), result.stdout
    facts = json.loads(CliRunner().invoke(app, ["model-info", str(directory), "--json"]).stdout)
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["trained"] == ("yes" if facts["trained"] else "no") == "no"
    # counted from the safetensors headers: the values the weight file holds, loaded independently
    from safetensors.torch import load_file

    stored = sum(t.numel() for t in load_file(str(directory / "model.safetensors")).values())
    assert lines["parameters"] == str(facts["parameters"]) == str(stored)
    assert lines["token_layout"] == "bos=no, eos=yes, window=none"
    assert lines["num_layers"] == str(facts["num_layers"]) == "1"


def test_model_info_of_bin_weights_says_unknown_parameters(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    directory = make_hf_test_model(tmp_path / "esm", family="hf-esm", layers=1, dim=16, heads=2)
    weights = directory / "model.safetensors"
    torch.save(load_file(str(weights)), directory / "pytorch_model.bin")
    weights.unlink()
    result = CliRunner().invoke(app, ["model-info", str(directory)])
    assert result.exit_code == 0, result.stdout
    assert dict(line.split(": ", 1) for line in result.stdout.splitlines())["parameters"] == "unknown"


def test_a_corrupt_safetensors_header_is_one_line(tmp_path: Path) -> None:
    directory = make_hf_test_model(tmp_path / "esm", family="hf-esm", layers=1, dim=16, heads=2)
    (directory / "model.safetensors").write_bytes((12).to_bytes(8, "little") + b"not json !!")
    result = CliRunner().invoke(app, ["model-info", str(directory)])
    assert result.exit_code != 0
    assert "model.safetensors: not a safetensors file (its header is not JSON)" in result.output


def test_info_names_fair_esm_only_for_stores_it_made(tmp_path: Path) -> None:
    records = [("a", "MKTAYIAKQRQISFVKSHFSRQ")]
    t5 = embed_store(tmp_path, make_hf_test_model(tmp_path / "ankh", family="ankh", layers=1, dim=16, heads=2),
                     records, name="t5", device="cpu")
    model = tmp_path / "esm2_test.pt"
    make_test_model(model, layers=1, dim=16, heads=2, seed=0)
    esm = embed_store(tmp_path, model, records, name="esm", device="cpu")
    software = {}
    for store in (t5, esm):
        result = CliRunner().invoke(app, ["info", str(store)])
        assert result.exit_code == 0, result.stderr
        software[store] = next(line for line in result.stdout.splitlines() if line.strip().startswith("software"))
    assert "fair-esm" not in software[t5] and "?" not in software[t5], software[t5]
    assert f"fair-esm {importlib.metadata.version('fair-esm')}" in software[esm], software[esm]


def test_an_identity_difference_reads_as_config_values() -> None:
    theirs = json.dumps({"identity_version": IDENTITY_VERSION, "per_residue": True, "pooling": ["mean"]})
    ours = json.dumps({"identity_version": IDENTITY_VERSION, "per_residue": False, "pooling": ["mean"]})
    assert describe_difference(theirs, ours) == "embedded with per_residue true, this run false"
    theirs = json.dumps({"identity_version": IDENTITY_VERSION, "pooling": ["mean", "bos"]})
    ours = json.dumps({"identity_version": IDENTITY_VERSION, "pooling": ["mean"]})
    assert describe_difference(theirs, ours) == "embedded with pooling ['mean', 'bos'], this run ['mean']"


def test_a_job_that_copied_records_does_not_report_them_as_embedded_per_second() -> None:
    from embedpipe.extraction.run import EmbedSummary

    def summary(reused: int) -> list[str]:
        return EmbedSummary(out=Path("o.h5"), records=10, residues=1000, seconds=2.0, precision="fp32", device="cpu",
                            fallback={}, padding_efficiency=1.0, tokens_per_batch=4096, tokens_per_batch_auto=False,
                            reused=reused).render().splitlines()

    computed = summary(0)
    assert computed[0].startswith("embedded 10 records (1000 residues) in 2.0s (500 residues/s)")
    partly = summary(4)
    assert partly[0].startswith("wrote 10 records (1000 residues) in 2.0s (copies included: no rate)")
    assert "residues/s" not in "\n".join(partly) and partly[-1].endswith("computed 6")


def test_plain_info_shows_the_precision_requested_and_why_the_policy_was_chosen(tmp_path: Path,
                                                                               tiny_model_path: Path) -> None:
    """``--precision auto``: ``info`` showed ``precision_requested`` and ``precision_reason`` only
    with ``--json``; the plain summary says them too, right under the policy chosen."""
    import h5py

    store = embed_store(tmp_path, tiny_model_path, [("a", "MKTAYIAKQRQISFVKSHFSRQ")], device="cpu", precision="auto")
    with h5py.File(store, "r") as f:
        policy, requested, reason = (str(f.attrs[k]) for k in ("precision_policy", "precision_requested",
                                                              "precision_reason"))
    assert requested == "auto" and reason.startswith(f"auto -> {policy}: ")
    result = CliRunner().invoke(app, ["info", str(store)])
    assert result.exit_code == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    at = next(i for i, line in enumerate(lines) if line.startswith(f"precision   policy {policy}:"))
    assert lines[at + 1] == f"requested   precision {requested}: {reason}"
    plain = CliRunner().invoke(app, ["info", str(embed_store(tmp_path, tiny_model_path, [("a", "MKT")], name="fp32",
                                                               device="cpu"))])
    assert "requested" not in plain.stdout  # a named policy: nothing was chosen for it
