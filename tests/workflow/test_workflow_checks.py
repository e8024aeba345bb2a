"""embedpipe.workflow.checks without Snakemake (the workflow tests run them end to end):
shard paths stay inside the shard directory, symlinks included; input paths must exist; the
report's facts come from the store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from embedpipe.workflow.checks import StoreFacts, WorkflowCheckError, input_paths, shard_paths


@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside.fasta", "sub/../../outside.fasta", "link.fasta",
                                 "sub/linked-dir/x.fasta"])
def test_shard_paths_outside_the_directory_are_refused(tmp_path: Path, bad: str) -> None:
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    (shards / "link.fasta").symlink_to("/etc/passwd")
    (shards / "sub" / "linked-dir").symlink_to(tmp_path)
    assert shard_paths({"shards": [{"path": "shard-00000.fasta"}]}, str(shards)) == [f"{shards}/shard-00000.fasta"]
    with pytest.raises(WorkflowCheckError, match="is outside the shard directory"):
        shard_paths({"shards": [{"path": "shard-00000.fasta"}, {"path": bad}]}, str(shards))


def test_input_paths_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("a.fasta").write_text(">a\nMKV\n")
    os.mkdir("adir")
    assert input_paths(["a.fasta", "*.fasta"]) == ["a.fasta", "a.fasta"]
    for item, why in (("typo.fasta", "typo.fasta does not exist"), ("adir", "adir is not a file"),
                      ("none/*.fa", "matches no file")):
        with pytest.raises(WorkflowCheckError, match=why):
            input_paths(["a.fasta", item])


def test_store_facts_of_a_missing_store_say_unknown(tmp_path: Path) -> None:
    facts = StoreFacts(str(tmp_path / "embeddings.h5"))
    assert facts["precision_policy"].startswith("unknown (") and set(facts) >= {"model_name", "storage_dtype"}
