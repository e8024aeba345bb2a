"""Issue 30, item 3: every writer takes the locks. The stores a command reads (``--reuse``
sources, merged stores) pin their sources against its outputs; the model's companion file is an
input; a single embed, merge, export, reuse-index or make-test-model holds the lock of each
output (the ``.NAME.lock`` a group job takes) for the whole run, so a second writer of the same
path is refused in one line naming the holder (embedpipe/core/output_guard.py,
``writing_outputs``); make-test-model replaces only a test model it wrote."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch

import embedpipe.extraction.run as embed_module
from embedpipe.core import locks
from embedpipe.core.checksums import file_sha256
from embedpipe.core.locks import holding
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta, embed_shards
from embedpipe.model.downloads import companion_path
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.store import merge_stores
from embedpipe.store.validate import validate_store
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.processes import wait_until

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = EmbedOptions(device="cpu", per_residue=True)
HOLDER = f"pid {os.getpid()} on host {socket.gethostname()}"


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _cli(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embedpipe.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=_env(), timeout=600, check=False)


def _error(result: subprocess.CompletedProcess) -> str:
    """The one line a refused command prints (it must fail, and print nothing else)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, (result.returncode, result.stderr)
    return lines[0]


def _shards(tmp: Path, n: int = 2) -> list[Path]:
    return [write_fasta(tmp / f"shard-{k:05d}.fasta", [(f"s{k}-{rid}", seq) for rid, seq in
                                                       random_sequences(3, (8, 30), seed=40 + k)]) for k in range(n)]


@pytest.fixture
def merged(tmp_path: Path, tiny_model_path: Path) -> tuple[Path, list[Path], list[Path]]:
    """``M.h5`` merged from ``stores/shard-0000{0,1}.h5`` (which it pins), and the shards."""
    shards = _shards(tmp_path)
    embed_shards(shards, model=str(tiny_model_path), out_dir=tmp_path / "stores", options=OPTIONS, quiet=True)
    stores = sorted((tmp_path / "stores").glob("*.h5"))
    merge_stores(stores, out=tmp_path / "M.h5")
    return tmp_path / "M.h5", stores, shards


# ------------------------------------------------------------------ case 1: what a merged store pins


def test_embed_reuse_of_a_merged_store_does_not_replace_a_store_it_pins(merged, tmp_path, tiny_model_path):
    store, sources, shards = merged
    before = sources[1].read_bytes()
    line = _error(_cli("embed", shards[1].name, "--model", tiny_model_path, "--out", "stores/shard-00001.h5",
                       "--reuse", "M.h5", "--device", "cpu", "--per-residue", "-q", cwd=tmp_path))
    assert line == (f"embedpipe: error: --out stores/shard-00001.h5 is {sources[1].resolve()}, a source store that "
                    "the merged store M.h5 pins (it reads from it); choose another output path")
    assert sources[1].read_bytes() == before and validate_store(store) == []


def test_reuse_index_of_a_merged_store_does_not_replace_a_store_it_pins(merged, tmp_path):
    store, sources, _ = merged
    before = sources[0].read_bytes()
    line = _error(_cli("reuse-index", "M.h5", "--out", "stores/shard-00000.h5", cwd=tmp_path))
    assert line == (f"embedpipe: error: --out stores/shard-00000.h5 is {sources[0].resolve()}, a source store that "
                    "the merged store M.h5 pins (it reads from it); choose another output path")
    assert sources[0].read_bytes() == before and validate_store(store) == []


def test_embed_reuse_of_an_index_does_not_replace_the_store_it_indexes(tmp_path, tiny_model_path):
    fasta = write_fasta(tmp_path / "x.fasta", random_sequences(2, (8, 20), seed=4))
    embed_fasta(fasta, model=str(tiny_model_path), out=tmp_path / "S.h5", options=OPTIONS, quiet=True)
    assert _cli("reuse-index", "S.h5", "--out", "idx.h5", cwd=tmp_path).returncode == 0
    before = (tmp_path / "S.h5").read_bytes()
    line = _error(_cli("embed", "x.fasta", "--model", tiny_model_path, "--out", "S.h5", "--reuse", "idx.h5",
                       "--device", "cpu", "--per-residue", "-q", cwd=tmp_path))
    assert line == (f"embedpipe: error: --out S.h5 is the input {tmp_path / 'S.h5'}; embed never writes over its "
                    "inputs: choose another output path")
    assert (tmp_path / "S.h5").read_bytes() == before


# ------------------------------------------------------------------ case 3: the model's companion


def test_embed_out_equal_to_the_models_companion_is_refused(tmp_path):
    make_test_model(tmp_path / "m.pt")
    companion = tmp_path / "m-contact-regression.pt"
    before = companion.read_bytes()
    fasta = write_fasta(tmp_path / "x.fasta", random_sequences(2, (8, 20), seed=1))
    line = _error(_cli("embed", fasta.name, "--model", "m.pt", "--out", companion.name, "--device", "cpu", "-q",
                       cwd=tmp_path))
    assert line == ("embedpipe: error: --out m-contact-regression.pt is the input m-contact-regression.pt; "
                    "embed never writes over its inputs: choose another output path")
    assert companion.read_bytes() == before


# ------------------------------------------------------------------ case 4: every writer takes the lock


def _held_out(tmp_path: Path, tiny_model_path: Path, command: str) -> tuple[list[object], Path]:
    """The arguments of ``command`` writing ``st/shard-00001.h5``, and that path."""
    st = tmp_path / "st"
    source = tmp_path / "source.h5"
    if command in ("merge", "export", "reuse-index"):
        fasta = write_fasta(tmp_path / "in.fasta", random_sequences(2, (8, 20), seed=2))
        embed_fasta(fasta, model=str(tiny_model_path), out=source, options=OPTIONS, quiet=True)
    out = "st/shard-00001.h5"
    args: dict[str, list[object]] = {
        "embed": ["embed", _shards(tmp_path)[1].name, "--model", tiny_model_path, "--out", out, "--device", "cpu"],
        "merge": ["merge", source.name, "--out", out],
        "export": ["export", source.name, "--format", "h5-per-id", "--out", out],
        "reuse-index": ["reuse-index", source.name, "--out", out],
        "make-test-model": ["make-test-model", out],
    }
    st.mkdir()
    return [*args[command], *(["-q"] if command not in ("reuse-index", "make-test-model") else [])], st / "shard-00001.h5"


@pytest.mark.parametrize("command", ["embed", "merge", "export", "reuse-index", "make-test-model"])
def test_a_store_a_group_job_holds_is_not_replaced_by_a_single_command(tmp_path, tiny_model_path, command):
    """The test holds the store locks exactly as a group job on ``st/`` does."""
    args, out = _held_out(tmp_path, tiny_model_path, command)
    stores = [out.parent / f"shard-{k:05d}.h5" for k in range(2)]
    with holding([(embed_module._lock_path(s), str(s)) for s in stores]):
        line = _error(_cli(*args, cwd=tmp_path))
    lock = tmp_path / "st" / ".shard-00001.h5.lock"
    label = "checkpoint" if command == "make-test-model" else "--out"
    assert line == (f"embedpipe: error: {label} st/shard-00001.h5 is locked by another process ({HOLDER}; lock "
                    f"{lock.relative_to(tmp_path)}); wait for it to finish, or use another output path")
    assert not out.exists()


_GATED = """
import sys, time
from pathlib import Path
import embedpipe.extraction.run as run
ready, release = Path(sys.argv[1]), Path(sys.argv[2])
real = run._read_records
def gated(fasta, *args, **kwargs):
    ready.write_text("holding its locks")
    while not release.exists():
        time.sleep(0.05)
    return real(fasta, *args, **kwargs)
run._read_records = gated
from embedpipe.cli import run as cli
sys.argv = ["embedpipe", *sys.argv[3:]]
cli()
"""


def _gated(tmp_path: Path, *args: object) -> tuple[subprocess.Popen, Path, Path]:
    """``embedpipe ARGS`` that stops, its output locks taken, until ``release`` exists."""
    ready, release = tmp_path / "ready", tmp_path / "release"
    proc = subprocess.Popen([sys.executable, "-c", _GATED, ready, release, *map(str, args)], cwd=tmp_path,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(proc, ready.exists, "the first writer holds its locks")
    return proc, ready, release


def test_two_concurrent_embeds_of_one_path_one_wins_the_other_names_it(tmp_path, tiny_model_path):
    first = write_fasta(tmp_path / "a.fasta", random_sequences(2, (8, 20), seed=5))
    second = write_fasta(tmp_path / "b.fasta", random_sequences(2, (8, 20), seed=6))
    proc, _, release = _gated(tmp_path, "embed", first.name, "--model", tiny_model_path, "--out", "o.h5",
                              "--device", "cpu", "-q")
    try:
        line = _error(_cli("embed", second.name, "--model", tiny_model_path, "--out", "o.h5", "--device", "cpu",
                           "-q", cwd=tmp_path))
    finally:
        release.write_text("go")
        _, err = proc.communicate(timeout=600)
    assert line == (f"embedpipe: error: --out o.h5 is locked by another process (pid {proc.pid} on host "
                    f"{socket.gethostname()}; lock .o.h5.lock); wait for it to finish, or use another output path")
    assert proc.returncode == 0, err
    with h5py.File(tmp_path / "o.h5", "r") as f:
        assert f.attrs["input_sha256"] == file_sha256(first)  # the winner's store, whole
    assert validate_store(tmp_path / "o.h5") == []
    assert not (tmp_path / ".o.h5.lock").exists()  # removed when let go


def test_a_running_group_job_keeps_its_stores(tmp_path, tiny_model_path):
    shards = _shards(tmp_path)
    proc, _, release = _gated(tmp_path, "embed", *[s.name for s in shards], "--model", tiny_model_path,
                              "--out-dir", "st", "--done", "st/group-00000.json", "--device", "cpu", "-q")
    try:
        line = _error(_cli("embed", shards[1].name, "--model", tiny_model_path, "--out", "st/shard-00001.h5",
                           "--device", "cpu", "-q", cwd=tmp_path))
    finally:
        release.write_text("go")
        _, err = proc.communicate(timeout=600)
    assert line == (f"embedpipe: error: --out st/shard-00001.h5 is locked by another process (pid {proc.pid} on "
                    f"host {socket.gethostname()}; lock st/.shard-00001.h5.lock); wait for it to finish, or use "
                    "another output path")
    assert proc.returncode == 0, err
    assert validate_store(tmp_path / "st" / "shard-00001.h5") == []


# ------------------------------------------------------------------ case 5: make-test-model


@pytest.mark.parametrize("kind", ["store", "text", "companion"])
def test_make_test_model_does_not_replace_a_file_it_did_not_write(tmp_path, tiny_model_path, kind):
    if kind == "store":
        fasta = write_fasta(tmp_path / "in.fasta", random_sequences(2, (8, 20), seed=3))
        embed_fasta(fasta, model=str(tiny_model_path), out=tmp_path / "a.h5", options=OPTIONS, quiet=True)
        name, victim, label, what = "a.h5", tmp_path / "a.h5", "checkpoint", "an embedpipe store"
    elif kind == "text":
        name, victim, label, what = "a.pt", tmp_path / "a.pt", "checkpoint", "a text file"
        victim.write_text("my notes\n")
    else:  # a companion beside no test model of ours
        name, victim, label, what = "a.pt", tmp_path / "a-contact-regression.pt", "companion", "a text file"
        victim.write_text("someone else's contact head\n")
    before = victim.read_bytes()
    line = _error(_cli("make-test-model", name, cwd=tmp_path))
    ours = "a test model make-test-model wrote"
    assert line == (f"embedpipe: error: {label} {victim.name} exists and is {what}, not {ours}; make-test-model "
                    f"replaces only {ours}: remove the file or choose another output path")
    assert victim.read_bytes() == before


def test_make_test_model_still_replaces_its_own_test_model(tmp_path):
    make_test_model(tmp_path / "m.pt", seed=0)
    before = (tmp_path / "m.pt").read_bytes()
    result = _cli("make-test-model", "m.pt", "--seed", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m.pt").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-contact-regression.pt", "m.pt"]  # no lock file left


@pytest.mark.parametrize("earlier", ["model removed", "written without .pt"])
def test_make_test_model_recreates_a_model_over_its_own_companion(tmp_path, fair_esm_reference, earlier):
    """The companion a test model left (its checkpoint removed since), or the one of ``OUT``
    without ``.pt`` (the same ``OUT-contact-regression.pt``), is make-test-model's own output."""
    if earlier == "model removed":
        make_test_model(tmp_path / "esm2_m.pt", seed=0)
        (tmp_path / "esm2_m.pt").unlink()
    else:
        make_test_model(tmp_path / "esm2_m", seed=0)
    companion = tmp_path / "esm2_m-contact-regression.pt"
    before = companion.read_bytes()
    result = _cli("make-test-model", "esm2_m.pt", "--seed", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert companion.read_bytes() != before  # seed 1's contact head
    model, _ = fair_esm_reference(tmp_path / "esm2_m.pt")  # fair-esm's own loader reads the pair
    fresh = make_test_model(tmp_path / "fresh" / "esm2_m.pt", seed=1)
    expected = torch.load(companion_path(fresh), weights_only=True)["model"]
    for key, value in expected.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_lock_file_removed_as_it_was_opened_is_opened_again(tmp_path, monkeypatch):
    """A holder removes its lock file as it lets go (no ``.NAME.lock`` left beside outputs); a
    writer that opened the old file just then must not hold a lock on a removed file."""
    lock = tmp_path / ".o.h5.lock"
    with holding([(lock, "--out o.h5")], remove=True):
        assert lock.exists()
    assert not lock.exists()
    real, opened = locks._open, []

    def open_then_removed(path, what):
        handle = real(path, what)
        if not opened:
            os.unlink(path)  # the holder lets go between this open and the flock
        opened.append(os.fstat(handle.fileno()).st_ino)
        return handle

    monkeypatch.setattr(locks, "_open", open_then_removed)
    handle = locks.acquire(lock, "--out o.h5")
    try:
        assert len(opened) == 2 and os.stat(lock).st_ino == opened[1] == os.fstat(handle.fileno()).st_ino
    finally:
        handle.close()
