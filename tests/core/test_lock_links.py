"""Lock files and the GPU lock directory are never opened through a link (embedpipe.core.locks,
embedpipe.core.devices): whoever can write an output directory or the shared GPU lock
directory (mode 1777) could plant ``.x.h5.lock -> victim`` or ``gpu-UUID.lock -> victim``
and make another user's job truncate or chmod the victim. A planted link, a FIFO or a hard
link is refused in one line naming it, and the victim is left as it was."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from embedpipe.core import devices, locks
from embedpipe.core.devices import claim_slot
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_shards
from embedpipe.workflow.checks import RUN_LOCK, lock_run
from helpers.embed_helpers import random_sequences, write_fasta

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot really\n"


def _victim(tmp_path: Path, mode: int = 0o600) -> Path:
    """Another file of the user (a private key), outside the directory the lock is in."""
    victim = tmp_path / "home" / "id_ed25519"
    victim.parent.mkdir()
    victim.write_bytes(SECRET)
    victim.chmod(mode)
    return victim


def _intact(victim: Path, mode: int = 0o600) -> bool:
    return victim.read_bytes() == SECRET and stat.S_IMODE(victim.stat().st_mode) == mode


def _plant(kind: str, lock: Path, victim: Path) -> None:
    lock.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling symlink":
        lock.symlink_to(victim.parent / "created-through-the-link")
    elif kind == "hard link":
        os.link(victim, lock)
    else:
        os.mkfifo(lock)


@pytest.mark.parametrize(("kind", "problem"), [("symlink", "is a symbolic link"),
                                               ("dangling symlink", "is a symbolic link"),
                                               ("hard link", "has 2 links (a hard link to another file)"),
                                               ("fifo", "is not a regular file")])
def test_a_planted_lock_file_is_refused_naming_it_and_the_victim_is_untouched(tmp_path, kind, problem):
    victim = _victim(tmp_path)
    lock = tmp_path / "stores" / ".x.h5.lock"
    _plant(kind, lock, victim)
    with pytest.raises(EmbedpipeError) as info:
        locks.acquire(lock, "store stores/x.h5")
    assert str(info.value).startswith(f"store stores/x.h5: its lock {lock} {problem}; refusing to use it")
    assert "\n" not in str(info.value)
    assert _intact(victim)
    assert not (victim.parent / "created-through-the-link").exists()


def test_a_group_embed_refuses_a_planted_store_lock_and_truncates_nothing(tmp_path, tiny_model_path):
    shards = [write_fasta(tmp_path / f"shard-{k:05d}.fasta", random_sequences(2, (8, 20), seed=k)) for k in range(2)]
    victim = _victim(tmp_path, 0o644)
    out = tmp_path / "stores"
    _plant("symlink", out / ".shard-00001.h5.lock", victim)
    with pytest.raises(EmbedpipeError, match=r"its lock .*\.shard-00001\.h5\.lock is a symbolic link"):
        embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=EmbedOptions(device="cpu"), quiet=True)
    assert _intact(victim, 0o644)
    assert not (out / "shard-00000.h5").exists() and not (out / "shard-00001.h5").exists()


def test_the_run_lock_is_not_taken_through_a_link(tmp_path):
    victim = _victim(tmp_path)
    _plant("symlink", tmp_path / "out" / RUN_LOCK, victim)
    with pytest.raises(EmbedpipeError, match=r"\.embedpipe-run\.lock is a symbolic link"):
        lock_run(str(tmp_path / "out"))
    assert _intact(victim)


def test_the_cli_refuses_a_planted_output_lock_in_one_line(tmp_path):
    victim = _victim(tmp_path)
    _plant("symlink", tmp_path / ".m.pt.lock", victim)
    result = subprocess.run([sys.executable, "-m", "embedpipe.cli", "make-test-model", "m.pt"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600,
                            env=os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "embedpipe: error: checkpoint m.pt: its lock .m.pt.lock is a symbolic link; refusing to use it (a lock is "
        "never opened through a link: remove it if you did not make it)"]
    assert _intact(victim) and not (tmp_path / "m.pt").exists()


def test_another_users_lock_file_is_locked_but_not_rewritten(tmp_path):
    lock = tmp_path / ".x.h5.lock"
    lock.write_text("pid=12 host=theirs\n")
    lock.chmod(0o666)
    os.chown(lock, 65534, 65534)
    handle = locks.acquire(lock, "store x.h5")
    try:
        assert lock.read_text() == "pid=12 host=theirs\n"
        with pytest.raises(locks.LockedError, match=r"pid 12 on host theirs"):
            locks.acquire(lock, "store x.h5")
    finally:
        handle.close()


# ------------------------------------------------------------------ the shared GPU lock directory


def test_a_planted_gpu_lock_link_is_refused_and_its_target_keeps_its_mode(tmp_path):
    victim = _victim(tmp_path)
    directory = tmp_path / "locks"
    directory.mkdir()
    directory.chmod(0o1777)
    (directory / "gpu-GPU-a.lock").symlink_to(victim)
    with pytest.raises(EmbedpipeError) as info:
        claim_slot(["GPU-a"], directory, timeout=0)
    assert str(info.value).startswith(f"the GPU lock directory {directory}: its lock {directory}/gpu-GPU-a.lock "
                                      "is a symbolic link; refusing to use it")
    assert _intact(victim)


def test_a_planted_gpu_lock_hard_link_is_not_chmodded(tmp_path):
    victim = _victim(tmp_path)
    directory = tmp_path / "locks"
    directory.mkdir()
    os.link(victim, directory / "gpu-GPU-a.lock")
    with pytest.raises(EmbedpipeError, match=r"gpu-GPU-a\.lock has 2 links"):
        claim_slot(["GPU-a"], directory, timeout=0)
    assert _intact(victim)


def test_a_symlinked_lock_directory_is_refused_and_its_target_not_opened_to_everyone(tmp_path, monkeypatch):
    target = tmp_path / "private"
    target.mkdir()
    target.chmod(0o700)
    link = tmp_path / "embedpipe-gpu-locks"
    link.symlink_to(target)
    monkeypatch.setattr(devices, "default_lock_dir", lambda: link)  # the shared default, planted as a link
    with pytest.raises(EmbedpipeError) as info:
        claim_slot(["GPU-a"], link, timeout=0)
    assert str(info.value) == (f"the GPU lock directory {link} is a symbolic link; refusing to use it (remove it if "
                               f"you did not make it, or set {devices.LOCK_DIR_ENV})")
    assert stat.S_IMODE(target.stat().st_mode) == 0o700 and list(target.iterdir()) == []


def _as_nobody(action) -> str:
    """``action()`` in a forked child acting as user 'nobody' (os/fcntl work only); its outcome."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.seteuid(65534)
            outcome = action()
        except BaseException as exc:  # noqa: BLE001 - reported through the pipe
            outcome = f"{type(exc).__name__}: {exc}"
        os.write(write, outcome.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        outcome = fh.read().decode()
    os.waitpid(pid, 0)
    return outcome


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base)


def test_a_lock_file_another_user_made_is_locked_read_only_and_an_unwritable_directory_refused(public_tmp):
    tmp_path = public_tmp
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    lock = shared / ".x.h5.lock"
    lock.write_text("pid=1 host=root's\n")
    lock.chmod(0o644)  # the other user may read it, not write it

    def lock_it() -> str:
        handle = locks.acquire(lock, "store x.h5")
        handle.close()
        return "locked"

    assert _as_nobody(lock_it) == "locked"
    assert lock.read_text() == "pid=1 host=root's\n"
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o755)
    outcome = _as_nobody(lambda: str(locks.acquire(private / ".y.h5.lock", "store y.h5")))
    assert outcome == f"EmbedpipeError: store y.h5: cannot create its lock {private}/.y.h5.lock (Permission denied)"
