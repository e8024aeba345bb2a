"""The Snakemake workflow, end to end on the CPU with a tiny random-weight test model.

Every test here runs `snakemake` (the root Snakefile) in a temporary working directory, so
the checkout stays clean. The model is written by the workflow's own make_test_model rule
(the offline-demo path); nothing is downloaded.

Covered: `--lint` is clean; dry-runs list the expected jobs and validate the config; an
offline run of the default config fails at once with the fix; a full run leaves the four
contract outputs, a valid merged store in which every input ID resolves, per-shard logs and
benchmarks, a report with the cross-check page, and nothing to do on rerun; one embed job per
group of shards (`max_jobs`); a run killed during embedding resumes (`--rerun-incomplete`) to
the same store, keeping the group's finished shard stores; one failing shard under
`--keep-going` leaves the other shard stores valid.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.stores import store_uuid
from helpers.workflow_helpers import (
    CONTRACT_OUTPUTS,
    CORES,
    EXAMPLE,
    ROOT,
    SNAKEFILE,
    _env,
    assert_same_store,
    demo_config,
    job_counts,
    nothing_to_do,
    read_manifest,
    run_workflow,
    snakemake,
    validate,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- static checks


@pytest.mark.parametrize("configfile", [None, "configs/offline-demo.yaml", "configs/gpu-proteome.yaml"])
def test_lint_is_clean(configfile: str | None, tmp_path: Path) -> None:
    # gpu-proteome's input glob matches nothing in a checkout; give it a file to find.
    args = ["--lint"]
    if configfile:
        args += ["--configfile", str(ROOT / configfile)]
    if configfile == "configs/gpu-proteome.yaml":
        args += ["--config", f"input={EXAMPLE}"]
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), *args],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Lints for" not in proc.stdout + proc.stderr




def test_dry_run_default_config(checkout_like: Path) -> None:
    proc = snakemake(checkout_like, "--dry-run", "--cores", "8", "--config", "precision=fp16")
    out = proc.stdout + proc.stderr
    # Before the shard checkpoint has run, the embed jobs are not known yet.
    assert job_counts(out) == {"fetch_model": 1, "shard": 1, "merge": 1, "crosscheck": 1, "all": 1}
    assert "results/embeddings.h5" in out
    assert "results/crosscheck/crosscheck.html" in out


def test_dry_run_offline_demo_config(checkout_like: Path) -> None:
    proc = snakemake(checkout_like, "--dry-run", "--cores", "2", "--configfile", "configs/offline-demo.yaml")
    out = proc.stdout + proc.stderr
    assert job_counts(out) == {"make_test_model": 1, "shard": 1, "merge": 1, "crosscheck": 1, "all": 1}
    assert "results-demo/model/esm2_demo_t2_64.pt" in out


def test_exports_add_one_job_per_format(checkout_like: Path) -> None:
    proc = snakemake(checkout_like, "--dry-run", "--printshellcmds", "--cores", "2", "--configfile",
                     "configs/offline-demo.yaml", "--config", 'exports=["h5-per-id","parquet","npy"]')
    out = proc.stdout + proc.stderr
    assert job_counts(out)["export"] == 3
    for ext, fmt in (("h5", "h5-per-id"), ("parquet", "parquet"), ("npy", "npy")):
        assert f"--format {fmt} --out results-demo/exports/embeddings.{ext}" in out
    err = _short_error(snakemake(checkout_like, "--dry-run", "--cores", "1", "--config", 'exports=["csv"]', check=False))
    assert "exports" in err


def test_input_glob_and_list(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("b.fasta", "a.fasta"):
        (data / name).write_text(f">{name}\nMKV\n")
    (tmp_path / "extra.fa").write_text(">x\nMKW\n")
    config = demo_config(tmp_path, input=["data/*.fasta", "extra.fa"])
    proc = run_workflow(tmp_path, config, "--dry-run", "--printshellcmds")
    assert "embedpipe shard data/a.fasta data/b.fasta extra.fa --out out/shards" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("precision=fp8", "precision"),
        ("device=gpu0", "device"),
        ("tokens_per_batch=0", "tokens_per_batch"),
        ("precison=fp16", "precison"),  # typo: unknown keys are refused
    ],
)
def test_config_is_validated_at_start(checkout_like: Path, override: str, message: str) -> None:
    proc = snakemake(checkout_like, "--dry-run", "--cores", "1", "--config", override, check=False)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "validat" in err.lower() and message in err, err[-3000:]


@pytest.mark.parametrize(
    "override, shown",
    [
        ("layers=[0,-1]", None),  # snakemake hands the list over as ['0', '-1']
        ('crosscheck={"sample":8}', "--sample 8 --seed 0"),
        ("test_model={layers: 2, dim: 32, heads: 4, seed: 1}", "--seed 1"),
    ],
)
def test_list_and_mapping_overrides_work_from_the_command_line(checkout_like: Path, override: str, shown: str | None) -> None:
    proc = snakemake(checkout_like, "--dry-run", "--printshellcmds", "--cores", "1",
                     "--configfile", "configs/offline-demo.yaml", "--config", override)
    if shown:
        assert shown in proc.stdout + proc.stderr


def _short_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0
    err = proc.stderr + proc.stdout
    assert len(err.strip().splitlines()) <= 8 and "Traceback" not in err, err
    return err


def test_misspelled_config_key_is_one_line_naming_the_nearest_key(checkout_like: Path) -> None:
    err = _short_error(snakemake(checkout_like, "--dry-run", "--cores", "1", "--config", "precison=fp16", check=False))
    assert "unknown key 'precison'; did you mean 'precision'?" in err
    err = _short_error(snakemake(checkout_like, "--dry-run", "--cores", "1", "--config",
                                 'crosscheck={"smaple":8}', check=False))
    assert "unknown key 'crosscheck.smaple'; did you mean 'sample'?" in err


def test_outdir_that_is_a_file_fails_in_one_line(checkout_like: Path) -> None:
    (checkout_like / "taken").write_text("not a directory\n")
    err = _short_error(snakemake(checkout_like, "--dry-run", "--cores", "1", "--config", "outdir=taken", check=False))
    assert "config 'outdir': taken exists and is not a directory" in err


def test_input_glob_matching_nothing_fails_clearly(checkout_like: Path) -> None:
    proc = snakemake(checkout_like, "--dry-run", "--cores", "1", "--config", "input=nowhere/*.fasta", check=False)
    assert proc.returncode != 0
    assert "matches no file" in proc.stdout + proc.stderr


def test_offline_default_model_fails_at_once_with_the_fix(checkout_like: Path, tmp_path: Path) -> None:
    """No model in the cache and no network: the first job fails, nothing is sharded."""
    torch_home = tmp_path / "empty-torch-home"
    env = _env(TORCH_HOME=str(torch_home), EMBEDPIPE_OFFLINE="1", https_proxy="http://127.0.0.1:9",
               HTTPS_PROXY="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9", no_proxy="", NO_PROXY="")
    start = time.monotonic()
    proc = snakemake(checkout_like, "--cores", "1", check=False, env=env, timeout=120)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "fetch-model" in out and "snakemake --cores 2 --configfile configs/offline-demo.yaml" in out, out[-3000:]
    assert "Execute" not in out and "rule fetch_model" not in out  # stopped before any job
    assert len(out.strip().splitlines()) <= 8 and "Traceback" not in out, out  # only the fix
    assert not (checkout_like / "results" / "shards" / "manifest.tsv").exists()
    assert elapsed < 60


def test_default_config_with_a_cached_model(checkout_like: Path, tmp_path: Path) -> None:
    """The README command on a fresh checkout: default config (fair-esm name, fetched into the
    torch hub cache) with `--config precision=fp16`. A random-weight stand-in is put in the
    cache under the default model's name, so fetch-model finds it and nothing is downloaded."""
    torch_home = tmp_path / "torch-home"
    checkpoint = torch_home / "hub" / "checkpoints" / "esm2_t6_8M_UR50D.pt"
    subprocess.run([sys.executable, "-m", "embedpipe.cli", "make-test-model", str(checkpoint)],
                   check=True, capture_output=True, env=_env())
    env = _env(TORCH_HOME=str(torch_home))
    snakemake(checkout_like, "--cores", CORES, "--config", "precision=fp16", env=env)
    results = checkout_like / "results"
    for name in CONTRACT_OUTPUTS:
        assert (results / name).is_file(), name
    assert (results / "model" / "esm2_t6_8M_UR50D.fetched").read_text().strip() == str(checkpoint)
    assert validate(results / "embeddings.h5").returncode == 0
    import embedpipe

    with embedpipe.open_store(results / "embeddings.h5") as store:
        assert store.provenance["precision_policy"] == "fp16"
        assert store.provenance["model_name"] == "esm2_t6_8M_UR50D"


# --------------------------------------------------------------------------- a full run


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run of the demo config; other tests compare against it."""
    workdir = tmp_path_factory.mktemp("wf-demo")
    config = demo_config(workdir)
    run_workflow(workdir, config)
    return workdir


def test_contract_outputs(demo_run: Path) -> None:
    for name in CONTRACT_OUTPUTS:
        assert (demo_run / "out" / name).is_file(), name
    report = json.loads((demo_run / "out" / "crosscheck" / "crosscheck.json").read_text())
    assert report["verdict"] == "pass"
    assert "<html" in (demo_run / "out" / "crosscheck" / "crosscheck.html").read_text().lower()


def test_merged_store_is_valid_and_every_input_id_resolves(demo_run: Path) -> None:
    import embedpipe

    merged = demo_run / "out" / "embeddings.h5"
    proc = validate(merged)
    assert proc.returncode == 0, proc.stderr
    rows = read_manifest(demo_run / "out" / "shards" / "manifest.tsv")
    assert len(rows) == 100
    assert {r["status"] for r in rows} <= {"ok", "duplicate"}
    assert sum(r["status"] == "duplicate" for r in rows) > 0  # the example has duplicates
    with embedpipe.open_store(merged) as store:
        assert len(store.ids) == sum(r["status"] == "ok" for r in rows)
        for row in rows:
            assert row["id"] in store, row["id"]
            assert store.mean_vector(row["id"]).shape == (store.dim,)
    shards = json.loads((demo_run / "out" / "shards" / "shards.json").read_text())["shards"]
    assert len(shards) == 3
    for shard in shards:
        assert validate(demo_run / "out" / "stores" / f"{Path(shard['path']).stem}.h5").returncode == 0


def test_merge_does_not_copy_per_residue_data(demo_run: Path) -> None:
    stores = sum(p.stat().st_size for p in (demo_run / "out" / "stores").glob("*.h5"))
    merged = (demo_run / "out" / "embeddings.h5").stat().st_size
    assert merged < stores / 4, (merged, stores)


def test_every_rule_logs_and_embed_jobs_are_benchmarked(demo_run: Path) -> None:
    logs = demo_run / "out" / "logs"
    for name in ("make_test_model.log", "shard.log", "merge.log", "crosscheck.log"):
        assert (logs / name).is_file(), name
    groups = json.loads((demo_run / "out" / "shards" / "shards.json").read_text())["groups"]
    assert groups == [[0], [1], [2]]  # fewer shards than max_jobs: one job per shard
    for k in range(len(groups)):
        assert (logs / "embed" / f"group-{k:05d}.log").is_file()
        bench = (demo_run / "out" / "benchmarks" / "embed" / f"group-{k:05d}.tsv").read_text().splitlines()
        assert bench[0].split("\t")[0] == "s" and float(bench[1].split("\t")[0]) > 0


def test_rerun_has_nothing_to_do(demo_run: Path) -> None:
    assert nothing_to_do(demo_run, demo_run / "config.yaml")


def test_without_threads_each_job_is_bounded_by_the_omp_num_threads_snakemake_sets(demo_run: Path,
                                                                                      tmp_path: Path) -> None:
    """No `threads` in the config: the rules ask for the package's default, pass no --threads,
    and Snakemake exports OMP_NUM_THREADS as each job's threads (the default, lowered to
    --cores), which bounds the job as its affinity and cgroup do; the stores say which bound.
    With `threads` set the job's scheduled count is passed, and no store is embedded again."""
    import h5py

    from embedpipe.core import cpus
    from embedpipe.workflow.config import DEFAULT_THREADS

    scheduled = min(DEFAULT_THREADS, int(CORES))
    owned = cpus.allocated({}).count  # what a job owns here without any variable
    stores = sorted((demo_run / "out" / "stores").glob("shard-*.h5"))
    assert len(stores) == 3
    for store in stores:
        with h5py.File(store, "r") as f:
            threads, source = int(f.attrs["threads"]), str(f.attrs["threads_from"])
        assert threads == min(scheduled, owned), store
        # Snakemake's OMP_NUM_THREADS is named wherever it binds: alone, or tied with the affinity or cgroup
        assert (f"OMP_NUM_THREADS={scheduled}" in source.split(", ")) == (threads == scheduled), (store, source)

    def shell_lines(*config: str) -> list[str]:
        proc = run_workflow(demo_run, demo_run / "config.yaml", "--dry-run", "--printshellcmds", "--forcerun",
                            "embed", "crosscheck", *config)
        return [line for line in (proc.stdout + proc.stderr).splitlines()
                if "embedpipe embed " in line or "embedpipe crosscheck " in line]

    unset = shell_lines()
    assert len(unset) == 4 and not any("--threads" in line for line in unset)
    given = shell_lines("--config", "threads=3")
    assert len(given) == 4 and all(f"--threads {min(3, int(CORES))} " in line for line in given)

    # in a copy of the run: one group embedded again with one thread scheduled (a profile's
    # set-threads), which its store records as OMP_NUM_THREADS=1 where the job owns more CPUs
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(demo_run, copy, symlinks=True)
    (copy / "out" / "stores" / "shard-00000.h5").unlink()
    (copy / "out" / "stores" / "group-00000.json").unlink()
    run_workflow(copy, copy / "config.yaml", "--set-threads", "embed=1")
    with h5py.File(copy / "out" / "stores" / "shard-00000.h5", "r") as f:
        assert int(f.attrs["threads"]) == 1
        assert "OMP_NUM_THREADS=1" in str(f.attrs["threads_from"]).split(", ")  # alone, or tied with a 1-CPU mask
    # setting `threads` changes the jobs' command lines, so they run again, and keep every
    # finished shard store: threads are how a job runs, not what it computes
    kept = {p.name: store_uuid(p) for p in (copy / "out" / "stores").glob("shard-*.h5")}
    run_workflow(copy, copy / "config.yaml", "--config", "threads=3")
    assert {p.name: store_uuid(p) for p in (copy / "out" / "stores").glob("shard-*.h5")} == kept


def test_changed_precision_re_embeds_every_shard(demo_run: Path) -> None:
    proc = run_workflow(demo_run, demo_run / "config.yaml", "--dry-run", "--config", "precision=bf16")
    counts = job_counts(proc.stdout + proc.stderr)
    assert counts == {"embed": 3, "merge": 1, "crosscheck": 1, "all": 1}, counts


@pytest.mark.parametrize("profile", [None, "local", "slurm", "slurm-ci"])
def test_cuda_device_requests_one_gpu_per_job(demo_run: Path, profile: str | None) -> None:
    """device: cuda -> every embed and crosscheck job declares gpu=1 (locally a slot of
    --resources gpu=N, on SLURM --gpus=1); profiles parse (dry-run, no cluster needed)."""
    args = ["--dry-run", "--config", "device=cuda"]
    if profile:
        args += ["--workflow-profile", str(ROOT / "workflows" / "profiles" / profile)]
    else:
        args += ["--cores", CORES]
    proc = snakemake(demo_run, *args, configfile=demo_run / "config.yaml")
    out = proc.stdout + proc.stderr
    jobs = re.findall(r"^(?:local)?rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", out, flags=re.M)
    gpu = {rule: [("gpu=1" in res.split(", ")) for r, res in jobs if r == rule] for rule in ("embed", "crosscheck", "merge")}
    assert gpu["embed"] == [True] * 3 and gpu["crosscheck"] == [True] and gpu["merge"] == [False], jobs


def test_one_embed_job_per_group_of_shards(tmp_path: Path) -> None:
    """max_jobs: 2 over 3 shards: two embed jobs, one of them embedding two shards."""
    config = demo_config(tmp_path, max_jobs=2)
    run_workflow(tmp_path, config, "out/shards/shards.json")  # the checkpoint only
    proc = run_workflow(tmp_path, config, "--dry-run", "--printshellcmds")
    out = proc.stdout + proc.stderr
    assert job_counts(out)["embed"] == 2, out[-3000:]
    assert "embedpipe embed out/shards/shard-00001.fasta out/shards/shard-00002.fasta " in out
    assert "--out-dir out/stores --done out/stores/group-00001.json" in out
    assert "printf '%s\\n' out/stores/shard-00000.h5 out/stores/shard-00001.h5 out/stores/shard-00002.h5 " in out
    assert "embedpipe merge --stores-from out/stores/merge-stores.txt " in out


def test_the_report_landing_page_points_to_where_the_crosscheck_is() -> None:
    """The landing page said the cross-check was "below": Snakemake lists it under Results, in
    the category the crosscheck rule gives its page (read from the rule, not assumed)."""
    landing = (ROOT / "workflows" / "report" / "workflow.rst").read_text()
    rule = (ROOT / "workflows" / "rules" / "crosscheck.smk").read_text()
    category = re.search(r'category="([^"]+)"', rule)
    assert category, rule
    assert "below" not in landing
    assert f"under Results, {category.group(1)}." in " ".join(landing.split())


def test_report_includes_the_crosscheck_page(demo_run: Path) -> None:
    report = demo_run / "report.html"
    run_workflow(demo_run, demo_run / "config.yaml", "--report", str(report))
    text = report.read_text(errors="replace")
    assert "crosscheck.html" in text
    assert "Cross-check" in text


# --------------------------------------------------------------------------- faults



def test_killed_run_resumes_to_the_same_store(demo_run: Path, tmp_path: Path) -> None:
    """One embed job for all three shards (max_jobs: 1), killed after its first shard store:
    the rerun keeps that store (same uuid) and embeds the other two."""
    config = demo_config(tmp_path, max_jobs=1)
    stores = tmp_path / "out" / "stores"
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory", str(tmp_path),
           "--configfile", str(config), "--cores", CORES]
    # The same cores as the clean run, so the embed job runs with the same torch threads.
    log = open(tmp_path / "killed-run.log", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list(stores.glob("shard-*.h5")):
            assert proc.poll() is None, (tmp_path / "killed-run.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no shard store appeared"
            time.sleep(0.05)
        # A crash, not a clean stop: the whole process group (Snakemake and its embed job).
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    assert not (tmp_path / "out" / "embeddings.h5").exists(), "the run finished before it was killed"
    finished = {p: store_uuid(p) for p in stores.glob("shard-*.h5")}
    assert 0 < len(finished) < 3

    snakemake(tmp_path, "--unlock", configfile=config)
    run_workflow(tmp_path, config, "--rerun-incomplete")
    assert {p: store_uuid(p) for p in finished} == finished
    log = (tmp_path / "out" / "logs" / "embed" / "group-00000.log").read_text()
    assert f"{3 - len(finished)} embedded, {len(finished)} kept" in log
    assert validate(tmp_path / "out" / "embeddings.h5").returncode == 0
    # The kept store is the killed run's own (same uuid, above); the recomputed ones equal the
    # clean run's bit for bit: a record's numbers do not depend on its batch (the row tiles of
    # docs/precision.md, "Reproducibility"; before them CI once saw 1.5e-5 here).
    assert_same_store(tmp_path / "out" / "embeddings.h5", demo_run / "out" / "embeddings.h5", exact=True)
    assert nothing_to_do(tmp_path, config)


def test_one_failing_shard_leaves_the_others_valid(tmp_path: Path) -> None:
    # Shards are length-sorted: with 13k tokens per shard only the last one holds records
    # over 1022 residues, and `long_sequences: error` makes exactly that embed job fail.
    config = demo_config(tmp_path, tokens_per_shard=13000, long_sequences="error")
    proc = run_workflow(tmp_path, config, "--keep-going", "--printshellcmds", check=False)
    assert proc.returncode != 0
    # The failing job refused its input (a record over the window, the CLI's user error): its two
    # retries repeat the refusal at once, with the first attempt's budget and memory, not
    # smaller and larger ones (embedpipe.workflow.jobs; other failures: tests/workflow/test_job_failures.py).
    out = proc.stdout + proc.stderr
    assert f"--tokens-per-batch {4096} " in out and f"--tokens-per-batch {4096 // 2} " not in out
    assert out.count("(refused by the previous attempt; not run again)") == 2
    assert re.search(r"embedpipe: embed job failed: out/logs/embed/group-\d+\.log: embedpipe: error: record .* "
                     r"over the model's trained length of 1022", proc.stderr), proc.stderr[-3000:]
    shards = json.loads((tmp_path / "out" / "shards" / "shards.json").read_text())["shards"]
    failing = [s for s in shards if s["max_length"] > 1022]
    passing = [s for s in shards if s["max_length"] <= 1022]
    assert failing and passing
    for shard in passing:
        store = tmp_path / "out" / "stores" / f"{Path(shard['path']).stem}.h5"
        assert validate(store).returncode == 0, store
    for shard in failing:
        stem = Path(shard["path"]).stem
        assert not list((tmp_path / "out" / "stores").glob(f"{stem}*")), stem  # no partial file
        assert "1022" in (tmp_path / "out" / "logs" / "embed" / f"group-{shard['index']:05d}.log").read_text()
    assert not (tmp_path / "out" / "embeddings.h5").exists()
