"""What the workflow checks about the files on disk before it trusts them (the rules call these
from workflows/rules/common.smk; docs/cluster.md says when each runs):

- the configured input paths exist (a typo must not run "Nothing to be done" on old results);
- every shard path of ``shards.json`` stays inside the shard directory;
- each group marker still describes its stores (embedpipe.extraction.group_marker); a stale one is
  removed, so its group runs again;
- one run per ``outdir``: an ``flock`` held by the main Snakemake process (embedpipe.core.locks);
- what ``--report`` says is read from the stores, not from the config.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.locks import acquire
from embedpipe.extraction.group_marker import marker_problem

RUN_LOCK = ".embedpipe-run.lock"


class WorkflowCheckError(EmbedpipeError):
    """A refusal of the workflow; the message is one line."""


def input_paths(items: str | Iterable[str]) -> list[str]:
    """The configured FASTA files: each item a path or a glob; a path that does not exist and a
    glob that matches nothing are refused, naming the item."""
    paths: list[str] = []
    for item in [items] if isinstance(items, str) else list(items):
        if glob.has_magic(item):
            matched = sorted(glob.glob(item))
            if not matched:
                raise WorkflowCheckError(f"config 'input': the pattern {item!r} matches no file (relative to {Path.cwd()})")
            paths.extend(matched)
        elif not os.path.isfile(item):
            what = "is not a file" if os.path.exists(item) else "does not exist"
            raise WorkflowCheckError(f"config 'input': {item} {what} (relative to {Path.cwd()})")
        else:
            paths.append(item)
    return paths


def shard_paths(listing: Mapping[str, Any], shard_dir: str) -> list[str]:
    """``shard_dir/PATH`` for every shard of ``shards.json``; a path that is absolute, climbs out
    with ``..`` or resolves (through symlinks) outside ``shard_dir`` is refused."""
    root = os.path.realpath(shard_dir)
    out: list[str] = []
    for shard in listing["shards"]:
        rel = str(shard["path"])
        full = os.path.join(shard_dir, rel)
        if os.path.isabs(rel) or ".." in Path(rel).parts or not _resolves_inside(full, rel, root):
            raise WorkflowCheckError(f"{shard_dir}/shards.json: shard path {rel!r} is outside the shard directory "
                                     f"{shard_dir}; refusing to read it (rerun `embedpipe shard`)")
        out.append(full)
    return out


def _resolves_inside(full: str, rel: str, root: str) -> bool:
    """A flat name (what `embedpipe shard` writes) costs one lstat unless it is a symlink;
    anything else is resolved in full."""
    if len(Path(rel).parts) == 1 and not os.path.islink(full):
        return True
    return os.path.commonpath([root, os.path.realpath(full)]) == root


def stale_markers(outdir: str, *, remove: bool) -> list[str]:
    """The problem of each stale group marker in ``outdir/stores``. With ``remove``, each is
    deleted, and ``outdir/embeddings.h5`` too (it pins the stores: a changed one makes it
    unreadable), so Snakemake runs the group and the merge again."""
    problems = []
    for marker in sorted(Path(outdir, "stores").glob("group-*.json")):
        problem = marker_problem(marker)
        if problem is not None:
            problems.append(f"{problem}; its group is embedded again")
            if remove:
                marker.unlink(missing_ok=True)
    merged = Path(outdir, "embeddings.h5")
    if problems and remove and merged.exists():
        merged.unlink()
        problems.append(f"{merged} removed: it pins those stores; merged again")
    return problems


def lock_run(outdir: str) -> IO[str]:
    """The run lock inside ``outdir``, held by the caller (the main Snakemake process) until it
    exits. Jobs do not take it: they run under the main process's lock."""
    return acquire(Path(outdir) / RUN_LOCK, f"outdir {outdir} (another workflow run uses it)")


class StoreFacts(Mapping[str, str]):
    """What ``embeddings.h5`` says (model, precision policy, storage dtype, ...), read on first
    use: the report's text shows these, not the config's values, which may differ from what
    was run. A missing or unreadable store reads "unknown (...)" for every fact."""

    KEYS = ("model_name", "precision_policy", "storage_dtype", "layers", "per_residue", "records", "sources")

    def __init__(self, merged: str) -> None:
        self.merged = merged
        self._facts: dict[str, str] | None = None

    def _load(self) -> dict[str, str]:
        if self._facts is None:
            self._facts = _read_facts(self.merged)
        return self._facts

    def __getitem__(self, key: str) -> str:
        return self._load()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)


def _read_facts(merged: str) -> dict[str, str]:
    import h5py

    from embedpipe.store.format import read_root_attrs

    try:
        with h5py.File(merged, "r") as f:
            attrs = read_root_attrs(f)
            records = str(f["ids"].shape[0]) if "ids" in f else "unknown"
    except (OSError, ValueError) as exc:
        return dict.fromkeys(StoreFacts.KEYS, f"unknown ({merged}: {type(exc).__name__})")
    sources = attrs.get("merged_from")
    facts = {key: str(attrs.get(key, "unknown")) for key in StoreFacts.KEYS}
    facts["layers"] = ", ".join(str(k) for k in attrs.get("layers", [])) or "unknown"
    facts["records"] = records
    facts["sources"] = str(len(sources)) if isinstance(sources, (list, tuple)) else "unknown"
    return facts
