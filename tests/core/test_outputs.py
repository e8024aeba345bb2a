"""Output paths: special files are never replaced, a full disk is one line (no crash, no leftovers),
interruption and a closed stdout end quietly."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from embedpipe.core.atomic import atomic_path
from embedpipe.core.errors import EmbedpipeError
from helpers.embed_helpers import random_sequences, write_fasta

CLI = [sys.executable, "-m", "embedpipe.cli"]
CRASH_CODES = (139, -signal.SIGSEGV, 134, -signal.SIGABRT)


def _cli(*args: object, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, **kwargs)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("embedpipe: error: "), result.stderr
    return lines[0]


def _embed(fasta: Path, model: Path, out: Path, **options: object) -> Path:
    from embedpipe.extraction.run import EmbedOptions, embed_fasta

    embed_fasta(fasta, model=str(model), out=out, options=EmbedOptions(device="cpu", **options), quiet=True)
    return out


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> list[Path]:
    """Three small per-residue shard stores of the tiny model (records rec000..rec059)."""
    base = tmp_path_factory.mktemp("stores")
    records = random_sequences(60, (20, 60), seed=11)
    paths = []
    for i in range(3):
        fasta = write_fasta(base / f"s{i}.fa", records[20 * i : 20 * (i + 1)])
        paths.append(_embed(fasta, tiny_model_path, base / f"s{i}.h5", per_residue=True))
    return paths


# --------------------------------------------------------------------------- special files


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return "FIFO"


def _char_device(path: Path) -> str:
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # what /dev/null is
    except PermissionError:
        pytest.skip("creating a character device (mknod) is not permitted here (needs root)")
    return "character device"


SPECIAL = [pytest.param(_fifo, id="fifo"), pytest.param(_char_device, id="chardev")]


def _assert_refused(make: Callable[[Path], str], target: Path, run: Callable[[], object]) -> None:
    kind = make(target)
    with pytest.raises(EmbedpipeError, match="not a regular file") as info:
        run()
    assert str(target) in str(info.value) and kind in str(info.value)
    mode = os.lstat(target).st_mode
    assert (stat.S_ISFIFO(mode) if kind == "FIFO" else stat.S_ISCHR(mode)), "the special file was replaced"
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("make", SPECIAL)
def test_embed_refuses_a_special_output(make, tmp_path, tiny_model_path):
    fasta = write_fasta(tmp_path / "in.fa", random_sequences(2, (10, 20)))
    _assert_refused(make, tmp_path / "out.h5", lambda: _embed(fasta, tiny_model_path, tmp_path / "out.h5"))


@pytest.mark.parametrize("make", SPECIAL)
def test_merge_refuses_a_special_output(make, tmp_path, stores):
    from embedpipe.store import merge_stores

    _assert_refused(make, tmp_path / "merged.h5", lambda: merge_stores(stores, out=tmp_path / "merged.h5"))


@pytest.mark.parametrize("make", SPECIAL)
@pytest.mark.parametrize("name", ["esm2_x.pt", "esm2_x-contact-regression.pt"])
def test_make_test_model_refuses_a_special_output_or_companion(make, name, tmp_path):
    from embedpipe.model.random_checkpoint import make_test_model

    _assert_refused(make, tmp_path / name, lambda: make_test_model(tmp_path / "esm2_x.pt"))
    assert not any(p.is_file() for p in tmp_path.iterdir()), "a checkpoint was written"


@pytest.mark.parametrize("make", SPECIAL)
@pytest.mark.parametrize("name", ["crosscheck.json", "crosscheck.html"])
def test_crosscheck_refuses_special_report_files(make, name, tmp_path, stores):
    from embedpipe.crosscheck.run import run_crosscheck

    (tmp_path / "report").mkdir()
    _assert_refused(
        make, tmp_path / "report" / name,
        lambda: run_crosscheck(stores[0], out=tmp_path / "report", sample=2, device="cpu", quiet=True),
    )


@pytest.mark.parametrize("make", SPECIAL)
@pytest.mark.parametrize("name", ["manifest.tsv", "shards.json", "shard-00007.fasta"])
def test_shard_refuses_special_entries_in_its_output_directory(make, name, tmp_path):
    from embedpipe.shard.passes import shard_fasta

    fasta = write_fasta(tmp_path / "in.fa", random_sequences(3, (10, 20)))
    (tmp_path / "out").mkdir()
    _assert_refused(make, tmp_path / "out" / name, lambda: shard_fasta([fasta], out=tmp_path / "out", tokens_per_shard=100))


def test_cli_refuses_a_device_node_as_output(tmp_path, tiny_model_path):
    """The report's reproduction: `embed ... --out fake` where fake is a character device."""
    fasta = write_fasta(tmp_path / "in.fa", random_sequences(2, (10, 20)))
    _char_device(tmp_path / "fake")
    line = _one_error_line(_cli("embed", fasta, "--model", tiny_model_path, "--out", tmp_path / "fake", "-q"))
    assert "fake" in line and "not a regular file" in line
    assert stat.S_ISCHR(os.lstat(tmp_path / "fake").st_mode)


def test_commit_refuses_a_fifo_made_while_writing(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(EmbedpipeError, match="FIFO"):
        with atomic_path(target) as tmp:
            tmp.write_text("data")
            os.mkfifo(target)
    assert stat.S_ISFIFO(os.lstat(target).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


# --------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (needs root, or CAP_SYS_ADMIN)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"mounting a 2 MiB tmpfs is not permitted here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _leave_free(disk: Path, free: int) -> None:
    """Fill ``disk`` so that ``free`` bytes remain."""
    st = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - free))


def _assert_clean_failure(result: subprocess.CompletedProcess, out: Path, disk: Path) -> str:
    assert result.returncode != 0 and result.returncode not in CRASH_CODES, (result.returncode, result.stderr)
    line = _one_error_line(result)
    assert str(out) in line, line
    assert sorted(p.name for p in disk.iterdir()) == ["filler"], "partial output or temp file left behind"
    return line


def test_embed_per_residue_on_a_full_disk_fails_mid_write_with_one_line(small_disk, tmp_path, tiny_model_path):
    records = random_sequences(20, (250, 300), seed=3)
    fasta = write_fasta(tmp_path / "in.fa", records)
    rows = sum(len(s) for _, s in records)
    needed = (len(records) + rows) * 32 * 4  # one layer, dim 32, float32: passes the pre-flight check
    _leave_free(small_disk, needed + 4096 + 4096)  # one page more: the lock file beside --out (core/locks.py)
    out = small_disk / "e.h5"
    line = _assert_clean_failure(_cli("embed", fasta, "--model", tiny_model_path, "--out", out, "--per-residue", "-q"),
                                 out, small_disk)
    assert line == f"embedpipe: error: cannot write {out}: No space left on device"


def test_embed_refuses_up_front_when_the_store_cannot_fit(small_disk, tmp_path, tiny_model_path):
    fasta = write_fasta(tmp_path / "in.fa", random_sequences(20, (250, 300), seed=3))
    _leave_free(small_disk, 64 << 10)
    out = small_disk / "e.h5"
    line = _assert_clean_failure(_cli("embed", fasta, "--model", tiny_model_path, "--out", out, "--per-residue", "-q"),
                                 out, small_disk)
    assert "needs at least" in line and "free on its file system" in line


@pytest.mark.parametrize("free", [0, 12 << 10, 24 << 10])
def test_merge_on_a_full_disk_fails_with_one_line(free, small_disk, stores):
    _leave_free(small_disk, free)
    out = small_disk / "merged.h5"
    line = _assert_clean_failure(_cli("merge", *stores, "--out", out, "-q"), out, small_disk)
    assert line.endswith("No space left on device")


@pytest.mark.parametrize("free", [0, 64 << 10])
def test_make_test_model_on_a_full_disk_leaves_neither_file(free, small_disk):
    _leave_free(small_disk, free)
    out = small_disk / "m.pt"
    line = _assert_clean_failure(_cli("make-test-model", out), small_disk / "m", small_disk)
    assert line.endswith("No space left on device")


def test_shard_on_a_full_disk_names_its_output(small_disk, tmp_path):
    fasta = write_fasta(tmp_path / "in.fa", random_sequences(400, (900, 1000), seed=5))
    _leave_free(small_disk, 16 << 10)
    out = small_disk / "shards"
    line = _assert_clean_failure(_cli("shard", fasta, "--out", out, "-q"), out, small_disk)
    assert line.endswith("No space left on device")


def test_write_error_reads_hdf5_messages():
    from embedpipe.core.atomic import write_error

    tmp = Path("/d/.o.h5.abc.tmp")
    hdf5 = RuntimeError(
        "Unable to flush file's cached information (file write failed: time = Mon, "
        f"filename = '{tmp}', file descriptor = 3, errno = 28, error message = 'No space left on device')"
    )
    assert str(write_error(Path("/d/o.h5"), hdf5, tmp)) == "cannot write /d/o.h5: No space left on device"
    other = OSError(errno.EIO, "Input/output error", "/d/source.h5")  # another file: not ours to name
    assert write_error(Path("/d/o.h5"), other, tmp) is None
    assert write_error(Path("/d/o.h5"), KeyError("x"), tmp) is None


def test_every_writer_s_failure_is_one_message_style():
    """One write_error for every writer (issue 31): the atomic HDF5 and text writers, shard's
    spool and spill files, the external sort's runs, the CLI's fallback."""
    from embedpipe.cli.exit import _os_error_message
    from embedpipe.core.atomic import write_error

    full = OSError(errno.ENOSPC, "No space left on device")
    assert str(write_error(Path("/d/o.h5"), full, known=True)) == "cannot write /d/o.h5: No space left on device"
    spooled = Path("/d/.shards.tmp-123-abc/shard-000001.fasta")  # shard's hidden work directory
    assert str(write_error(spooled, full, known=True)) == (
        "cannot write /d/shards (shard-000001.fasta in the work directory /d/.shards.tmp-123-abc): "
        "No space left on device")
    assert _os_error_message(full, Path("/d/o.h5")) == str(write_error(Path("/d/o.h5"), full, known=True))
    # known: the caller's own write failed, whatever the errno; otherwise only a write errno counts
    missing = OSError(errno.ENOENT, "No such file or directory")
    assert str(write_error(Path("/d/x"), missing, known=True)) == "cannot write /d/x: No such file or directory"
    assert write_error(Path("/d/x"), missing) is None
    assert str(write_error(Path("/d/new\nline"), full, known=True)) == "cannot write /d/new\\nline: No space left on device"


def test_cli_names_the_output_for_an_os_error_without_a_file_name():
    from embedpipe.cli.exit import _os_error_message

    exc = OSError(errno.ENOSPC, "No space left on device")
    assert _os_error_message(exc, Path("out/shards")) == "cannot write out/shards: No space left on device"
    named = OSError(errno.ENOSPC, "No space left on device", "out/x")
    assert _os_error_message(named, Path("out")) == "No space left on device: out/x"


# --------------------------------------------------------------------------- interruption, closed stdout


def _script(body: str, store_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, cwd=store_dir, timeout=300
    )


def test_ctrl_c_while_exiting_is_one_quiet_line(stores):
    """SIGINT landing after the command returned (as the interpreter shuts down)."""
    result = _script(
        f"""
        import atexit, os, signal, sys
        from embedpipe import cli
        def late_ctrl_c():
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(100000))  # the handler runs at the next bytecode
        atexit.register(late_ctrl_c)
        sys.argv = ["embedpipe", "info", "--json", {str(stores[0])!r}]
        cli.run()
        """,
        stores[0].parent,
    )
    assert result.returncode == 130, result.stderr
    assert result.stderr.splitlines() == ["embedpipe: interrupted"]


def test_ctrl_c_landing_in_a_finalizer_during_merge_is_one_quiet_line(stores, tmp_path):
    """Ctrl-C landing where Python cannot raise it (a ``__del__`` or weakref callback, as when
    h5py objects are released) was printed as ``Exception ignored ... KeyboardInterrupt``."""
    result = _script(
        f"""
        import os, signal, sys
        from embedpipe import cli
        from embedpipe.store import merge
        class Released:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                sum(range(100000))  # KeyboardInterrupt is raised here, inside __del__
        copy = merge._copy_rows
        def copy_and_release(*args, **kwargs):
            copy(*args, **kwargs)
            Released()
        merge._copy_rows = copy_and_release
        sys.argv = ["embedpipe", "merge", *{[str(s) for s in stores]!r}, "--out", {str(tmp_path / "m.h5")!r}, "-q"]
        cli.run()
        """,
        tmp_path,
    )
    assert result.returncode == 130, result.stderr
    assert result.stderr.splitlines() == ["embedpipe: interrupted"]


def test_ctrl_c_during_merge_is_one_line_and_leaves_nothing(stores, tmp_path):
    result = _script(
        f"""
        import os, signal, sys
        from embedpipe import cli
        from embedpipe.store import merge
        copy = merge._copy_rows
        def interrupted_copy(*args, **kwargs):
            copy(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGINT)
        merge._copy_rows = interrupted_copy
        sys.argv = ["embedpipe", "merge", *{[str(s) for s in stores]!r}, "--out", {str(tmp_path / "m.h5")!r}]
        cli.run()
        """,
        tmp_path,
    )
    assert result.returncode == 130, result.stderr
    assert result.stderr.splitlines() == ["embedpipe: interrupted"]
    assert list(tmp_path.iterdir()) == []


def test_info_into_a_closed_pipe_ends_quietly(stores):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before embedpipe writes a byte (like `| head -c 0`)
    try:
        result = subprocess.run([*CLI, "info", "--json", str(stores[0])], stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert result.returncode in (0, 141)
    assert result.stderr == ""


def test_info_json_still_reaches_an_open_pipe(stores):
    result = _cli("info", "--json", stores[0])
    assert result.returncode == 0 and json.loads(result.stdout)["counts"]["records"] == 20
