"""Scratch directories a ``kill -9`` leaves (no exit handler runs) are removed by the next run
that makes one of the same kind on that host once the owner's PID is gone (issue 30, round 4):
an external sort's (``reuse-index``, merge, validate) as the reuse job's."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from embedpipe.core.atomic import host_tag, make_owned_dir
from embedpipe.core.external_sort import ExternalSort


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_dead_sorts_directory_is_removed_by_the_next_sort(tmp_path):
    dead = tmp_path / f".embedpipe-sort-{_dead_pid()}-{host_tag()}-k1ll3d"
    live = tmp_path / f".embedpipe-sort-{os.getppid()}-{host_tag()}-al1ve0"
    for d in (dead, live):
        d.mkdir()
        (d / "run-0.npy").write_bytes(b"partial")
    rows = np.zeros(3, dtype=[("key", "S4"), ("row", "<i8")])
    rows["key"], rows["row"] = [b"c", b"a", b"b"], [0, 1, 2]
    with ExternalSort(["key", "row"], work=tmp_path) as sort:
        sort.add(rows)
        mine = [p for p in tmp_path.iterdir() if p.name.startswith(f".embedpipe-sort-{os.getpid()}-{host_tag()}-")]
        assert [b["key"].tolist() for b in sort] == [[b"a", b"b", b"c"]]
    assert not dead.exists() and live.exists()
    assert len(mine) == 1 and not mine[0].exists()  # its own, named by its PID, removed on close


def test_owned_dir_names_its_owner(tmp_path):
    path = make_owned_dir(".embedpipe-x-", tmp_path)
    assert path.parent == tmp_path and path.name.startswith(f".embedpipe-x-{os.getpid()}-{host_tag()}-")
