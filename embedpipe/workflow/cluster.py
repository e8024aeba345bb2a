"""What the SLURM cluster a run meets can do, checked when the run starts (the workflow's
``onstart``, main process, before the first job is submitted).

Two ways a run on SLURM waited in silence:

- **job status.** snakemake-executor-plugin-slurm asks ``sacct`` by default. Where accounting
  is off (``AccountingStorageType=accounting_storage/none``) ``sacct`` never reports the job
  finished, and the main process waits forever with nothing on the terminal. Then the status
  command is switched to ``squeue`` (said in one line), which sees a finished job for
  ``MinJobAge`` seconds; when that is too short for the plugin (it wants 3 x
  ``--slurm-init-seconds-before-status-checks``) the run stops with the options to change.
- **requests no node can hold.** A rule asking for more CPUs or memory than every node has
  stays ``PENDING`` forever; a warning names the rule and the profile line to change.

docs/cluster.md, "A silent wait".
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from embedpipe.core.errors import EmbedpipeError

ACCOUNTING_OFF = "accounting_storage/none"
#: the plugin's default seconds before the first status check, when the settings do not say
PLUGIN_INIT_SECONDS = 40


class ClusterError(EmbedpipeError):
    """A SLURM setting under which the run could not see its jobs finish; one line."""


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    mem_mb: int


def _run(args: list[str]) -> str | None:
    """A SLURM client's stdout; None when it is missing, fails or hangs."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def slurm_config(text: str | None = None) -> dict[str, str]:
    """``scontrol show config`` as key -> value ({} when it cannot be read)."""
    text = _run(["scontrol", "show", "config"]) if text is None else text
    out = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def seconds(value: str | None) -> int | None:
    """``600 sec``, ``1h``, ``300`` as seconds (None when unreadable)."""
    words = (value or "").split()
    if not words:
        return None
    number = "".join(c for c in words[0] if c.isdigit())
    unit = (words[0][len(number):] or (words[1] if len(words) > 1 else "")).lower()
    if not number:
        return None
    return int(number) * (3600 if unit.startswith("h") else 60 if unit.startswith("min") else 1)


def status_command(settings: Any, config: Mapping[str, str]) -> str | None:
    """The status command the run must use on this cluster: ``squeue`` where accounting is off
    and the plugin would ask ``sacct``; None when the plugin's choice works. Raises
    :class:`ClusterError` when neither can see a job finish."""
    chosen = getattr(settings, "status_command", None)
    if config.get("AccountingStorageType") != ACCOUNTING_OFF or chosen not in ("sacct", None):
        return None
    age = seconds(config.get("MinJobAge"))
    init = getattr(settings, "init_seconds_before_status_checks", None) or PLUGIN_INIT_SECONDS
    if age is None or age < 3 * init:
        raise ClusterError(
            f"SLURM accounting is off on this cluster ({ACCOUNTING_OFF}), so sacct never sees a job finish, and "
            f"MinJobAge ({config.get('MinJobAge', 'unknown')}) is under the {3 * init} s squeue needs: set MinJobAge "
            f">= {3 * init} in slurm.conf, or lower --slurm-init-seconds-before-status-checks to {max(1, (age or 0) // 3)} "
            "and pass --slurm-status-command squeue (docs/cluster.md, \"A silent wait\")")
    return "squeue"


def choose_status_command(settings: Any, config: Mapping[str, str]) -> str | None:
    """Set the plugin's status command to what works here (see :func:`status_command`); the
    line to print when it was changed, else None."""
    chosen = status_command(settings, config)
    if chosen is None:
        return None
    settings.status_command = chosen
    return (f"SLURM accounting is off on this cluster ({ACCOUNTING_OFF}): job status from squeue, not sacct "
            "(set slurm-status-command: squeue in the profile to say so; docs/cluster.md, \"A silent wait\")")


def nodes(text: str | None = None) -> list[Node]:
    """Every node ``sinfo`` lists, with its CPUs and memory (MB); [] when it cannot say."""
    text = _run(["sinfo", "-h", "-N", "-o", "%N %c %m"]) if text is None else text
    found: dict[str, Node] = {}
    for line in (text or "").splitlines():
        words = line.split()
        if len(words) == 3 and words[1].isdigit() and words[2].rstrip("+").isdigit():
            found[words[0]] = Node(words[0], int(words[1]), int(words[2].rstrip("+")))
    return list(found.values())


def oversized(requests: Mapping[str, tuple[int | None, int | None]], cluster: list[Node]) -> list[str]:
    """A warning per rule whose threads or mem_mb exceed every node's (its jobs would pend forever)."""
    if not cluster:
        return []
    most_cpus = max(cluster, key=lambda n: n.cpus)
    most_mem = max(cluster, key=lambda n: n.mem_mb)
    out = []
    for rule, (threads, mem_mb) in sorted(requests.items()):
        if threads is not None and threads > most_cpus.cpus:
            out.append(f"rule {rule} asks for {threads} threads, more than any SLURM node has (the most: "
                       f"{most_cpus.cpus} CPUs, {most_cpus.name}); its jobs would stay PENDING: set "
                       f"`set-threads: {rule}: {most_cpus.cpus}` in the profile")
        if mem_mb is not None and mem_mb > most_mem.mem_mb:
            out.append(f"rule {rule} asks for mem_mb={mem_mb}, more than any SLURM node has (the most: "
                       f"{most_mem.mem_mb} MB, {most_mem.name}); its jobs would stay PENDING: set "
                       f"`set-resources: {rule}: mem_mb: {most_mem.mem_mb}` in the profile")
    return out


def rule_requests(workflow: Any, computed_mem_mb: Mapping[str, int]) -> dict[str, tuple[int | None, int | None]]:
    """rule -> (threads, mem_mb) of Snakemake's ``workflow`` as the profile leaves them (its
    set-threads, set-resources); ``computed_mem_mb`` for a rule whose mem_mb is a function of
    the job. Local rules run on the submitting host and are left out."""
    out = {}
    for rule in workflow.rules:
        if workflow.is_local(rule):
            continue
        threads, mem_mb = _number(rule.resources.get("_cores")), _number(rule.resources.get("mem_mb"))
        out[rule.name] = (threads, computed_mem_mb.get(rule.name) if mem_mb is None else mem_mb)
    return out


def _number(resource: Any) -> int | None:
    """A resource's number when it is one (not a function of the job), else None."""
    value = getattr(resource, "_value", resource)  # snakemake.resources.Resource keeps it there
    return value if isinstance(value, int) and not isinstance(value, bool) else None
