"""embedpipe.workflow.cluster on the text SLURM's clients print (the real cluster: test_slurm.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from embedpipe.workflow import cluster

CONFIG = "AccountingStorageType   = accounting_storage/none\nMinJobAge               = 600 sec\nOther = x\n"


def test_config_and_ages_are_read() -> None:
    conf = cluster.slurm_config(CONFIG)
    assert conf["AccountingStorageType"] == cluster.ACCOUNTING_OFF and conf["Other"] == "x"
    assert [cluster.seconds(v) for v in ("600 sec", "300", "1h", "2 min", "", None)] == [600, 300, 3600, 120, None, None]


def test_sacct_without_accounting_becomes_squeue_and_says_so() -> None:
    settings = SimpleNamespace(status_command="sacct", init_seconds_before_status_checks=40)
    line = cluster.choose_status_command(settings, cluster.slurm_config(CONFIG))
    assert settings.status_command == "squeue" and line is not None and "job status from squeue" in line
    assert cluster.choose_status_command(settings, cluster.slurm_config(CONFIG)) is None  # squeue already


def test_with_accounting_nothing_changes() -> None:
    settings = SimpleNamespace(status_command="sacct", init_seconds_before_status_checks=40)
    conf = cluster.slurm_config("AccountingStorageType = accounting_storage/slurmdbd\nMinJobAge = 300\n")
    assert cluster.choose_status_command(settings, conf) is None and settings.status_command == "sacct"


def test_a_min_job_age_too_short_for_squeue_stops_the_run_with_the_options() -> None:
    settings = SimpleNamespace(status_command="sacct", init_seconds_before_status_checks=40)
    conf = cluster.slurm_config("AccountingStorageType = accounting_storage/none\nMinJobAge = 60 sec\n")
    with pytest.raises(cluster.ClusterError, match=r"MinJobAge \(60 sec\) is under the 120 s squeue needs: set "
                                                   r"MinJobAge >= 120 .* to 20 and pass --slurm-status-command squeue"):
        cluster.choose_status_command(settings, conf)
    assert settings.status_command == "sacct"


def test_requests_above_every_node_are_named() -> None:
    nodes = cluster.nodes("a 2 24105\nb 8 4000+\nb 8 4000+\nbad line\n")
    assert nodes == [cluster.Node("a", 2, 24105), cluster.Node("b", 8, 4000)]
    lines = cluster.oversized({"embed": (16, 9728), "crosscheck": (4, 30000), "merge": (None, None)}, nodes)
    assert lines == [
        "rule crosscheck asks for mem_mb=30000, more than any SLURM node has (the most: 24105 MB, a); its jobs "
        "would stay PENDING: set `set-resources: crosscheck: mem_mb: 24105` in the profile",
        "rule embed asks for 16 threads, more than any SLURM node has (the most: 8 CPUs, b); its jobs would stay "
        "PENDING: set `set-threads: embed: 8` in the profile"]
    assert cluster.oversized({"embed": (16, 9728)}, []) == []  # sinfo said nothing: no guess


def test_rule_requests_read_numbers_and_leave_out_local_rules() -> None:
    class FakeResource:  # what snakemake.resources.Resource holds a value in
        def __init__(self, value: object) -> None:
            self._value = value

    def rule(name: str, **resources: object) -> SimpleNamespace:
        return SimpleNamespace(name=name, resources={key: FakeResource(value) for key, value in resources.items()})

    rules = [rule("embed", _cores=4, mem_mb=lambda wildcards, attempt: 1), rule("merge", _cores=1, mem_mb=3000),
             rule("fetch_model", _cores=1, mem_mb=10**9), rule("all", _cores=True)]
    workflow = SimpleNamespace(rules=rules, is_local=lambda r: r.name == "fetch_model")
    assert cluster.rule_requests(workflow, {"embed": 2560}) == {
        "embed": (4, 2560), "merge": (1, 3000), "all": (None, None)}
