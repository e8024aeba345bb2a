"""The workflow trusts nothing on disk unchecked (issue 19, B and E): a deleted shard store is
embedded again; an input path that does not exist is refused at start; `--report` says what
the stores say; one run per outdir (a lock inside it); shard paths outside the shard directory
are refused; a parse-time refusal is one clean line. One demo run is shared by the tests."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from embedpipe.core.locks import acquire
from helpers.stores import store_uuid
from helpers.workflow_helpers import demo_config, job_counts, read_manifest, run_workflow, snakemake, validate

pytestmark = pytest.mark.slow


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0
    lines = [line for line in (proc.stderr + proc.stdout).strip().splitlines()
             if not line.startswith("Config file ")]  # Snakemake's note on --config overrides
    assert len(lines) == 1 and "Traceback" not in lines[0] and "File " not in lines[0], lines
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("wf-integrity")
    run_workflow(workdir, demo_config(workdir, crosscheck={"sample": 4, "seed": 0}))
    return workdir



def test_a_deleted_shard_store_is_embedded_again(run: Path) -> None:
    stores = run / "out" / "stores"
    kept = {p.name: store_uuid(p) for p in stores.glob("shard-*.h5") if p.name != "shard-00001.h5"}
    (stores / "shard-00001.h5").unlink()
    proc = run_workflow(run, run / "config.yaml", "--dry-run")
    out = proc.stdout + proc.stderr
    assert "Nothing to be done" not in out
    assert job_counts(out) == {"embed": 1, "merge": 1, "crosscheck": 1, "all": 1}, out[-3000:]
    run_workflow(run, run / "config.yaml")
    assert (stores / "shard-00001.h5").is_file()
    assert {name: store_uuid(stores / name) for name in kept} == kept  # the others untouched
    assert validate(run / "out" / "embeddings.h5").returncode == 0
    proc = run_workflow(run, run / "config.yaml", "--dry-run")
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_an_input_that_does_not_exist_is_refused_at_start(run: Path) -> None:
    proc = run_workflow(run, run / "config.yaml", "--config", "input=/nonexistent.fasta", check=False)
    line = _one_line_error(proc)
    assert line.startswith("embedpipe: ") and "/nonexistent.fasta does not exist" in line


def test_the_report_says_what_the_stores_say(run: Path) -> None:
    """The run was fp32 / float32; a report asked for with fp16 in the config still says fp32."""
    report = run / "report.html"
    run_workflow(run, run / "config.yaml", "--report", str(report), "--config", "precision=fp16",
                 "storage_dtype=float16")
    text = re.sub(r"<[^>]*>", "", report.read_text(errors="replace").replace('\\"', '"').replace("\\n", " "))
    records = sum(r["status"] == "ok" for r in read_manifest(run / "out" / "shards" / "manifest.tsv"))
    shards = len(json.loads((run / "out" / "shards" / "shards.json").read_text())["shards"])
    assert (f"precision policy fp32, storage dtype float32, layers 2, per-residue True; {records} records from "
            f"{shards} shard stores") in text, text[:2000]
    assert "embedded under the precision policy fp32 (as embeddings.h5 records it)" in text
    assert "fp16" not in text and "float16" not in text


def test_a_second_run_on_the_outdir_is_refused_naming_the_holder(run: Path) -> None:
    holder = acquire(run / "out" / ".embedpipe-run.lock", "stand-in for another run")
    try:
        proc = run_workflow(run, run / "config.yaml", "--forcerun", "merge", check=False)
    finally:
        holder.close()
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("embedpipe: ")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert ".embedpipe-run.lock" in lines[0] and f"pid {os.getpid()} on host {socket.gethostname()}" in lines[0]
    assert "Finished job" not in proc.stdout + proc.stderr  # nothing ran
    # a lock left by a dead process (its record still names it) is taken over
    (run / "out" / ".embedpipe-run.lock").write_text("pid=999999999 host=gone\n")
    run_workflow(run, run / "config.yaml", "--forcerun", "merge")
    assert f"pid={os.getpid()}" not in (run / "out" / ".embedpipe-run.lock").read_text()


def test_shard_paths_outside_the_shard_directory_are_refused(tmp_path: Path) -> None:
    config = demo_config(tmp_path)
    run_workflow(tmp_path, config, "out/shards/shards.json")  # the checkpoint only
    listing_path = tmp_path / "out" / "shards" / "shards.json"
    listing = json.loads(listing_path.read_text())
    listing["shards"][1]["path"] = "../../../../../../../../etc/passwd"
    listing_path.write_text(json.dumps(listing))
    proc = run_workflow(tmp_path, config, check=False)  # refused when the DAG is built, after the banner
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("embedpipe: ")]
    assert proc.returncode != 0 and len(errors) == 1 and "Traceback" not in out and "File " not in out, out
    line = errors[0]
    assert "shard path '../../../../../../../../etc/passwd' is outside the shard directory" in line
    assert not list((tmp_path / "out" / "stores").glob("*.h5"))


def test_an_offline_run_fails_at_parse_time_in_one_clean_line(tmp_path: Path) -> None:
    from helpers.workflow_helpers import _env

    (tmp_path / "configs").symlink_to(Path(__file__).resolve().parents[2] / "configs")
    env = _env(TORCH_HOME=str(tmp_path / "empty"), EMBEDPIPE_OFFLINE="1")
    line = _one_line_error(snakemake(tmp_path, "--cores", "1", check=False, env=env))
    assert line.startswith("embedpipe: ") and "fetch-model" in line
