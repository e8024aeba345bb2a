"""Before any work: no output of a command may be one of its inputs, another of its outputs,
or a source that a merged store it reads pins; and an output replaces an existing file only
when that file is the command's own kind of output (docs/store-format.md, "Atomic writes").

Every command that writes calls :func:`writing_outputs` once with what it reads and what it will
write: the guard, then the lock of each output held for the whole run (docs/cluster.md, "One run
per outdir": a second writer of the same path is refused, naming the holder).
Paths are compared as the file system sees them: symlinks resolved, and existing files by
device and inode, so a hard link to an input is refused too. An atomic rename would replace
only the directory entry, but the old file is then no longer where the user keeps it (a
FASTA turned into HDF5 under its own name), and a merged store would read a changed shard.

An output may name its :class:`OutputKind` (``(label, path, kind)``): an existing file there
is replaced only when the kind recognises it (a store by its root attributes, an index by its
``INDEX.json``, a TSV by its header), else refused in one line saying what the file is. Why:
a path the guard cannot tie to an input (a model given to an earlier ``embed``, the store an
index was built from) is still someone's data, and a command's own output is the one file a
user means to overwrite by running the command again.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from embedpipe.core.atomic import check_output_path
from embedpipe.core.errors import EmbedpipeError, InputError
from embedpipe.core.locks import holding, lock_path_for
from embedpipe.core.paths import display_path as _d


@dataclass(frozen=True)
class OutputKind:
    """What a command writes: ``what`` names it in a refusal ("an embedpipe store"); ``test``
    says whether an existing file is one (it never raises: an unreadable file is not one)."""

    what: str
    test: Callable[[Path], bool]


#: an output: (label, path), or (label, path, kind) for one that replaces only its own kind
Output = Union[tuple[str, Path], tuple[str, Path, OutputKind]]

#: the root attribute ``format`` of an embedpipe store (embedpipe.store.format.FORMAT)
STORE_FORMAT = "embedpipe.store"
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def hdf5_attr(path: Path, name: str) -> Any:
    """Root attribute ``name`` of the HDF5 file ``path`` (None: absent, or not HDF5)."""
    try:
        with open(path, "rb") as fh:
            if fh.read(len(_HDF5_MAGIC)) != _HDF5_MAGIC:
                return None
        import h5py

        with h5py.File(path, "r") as f:
            value = f.attrs.get(name)
    except Exception:  # noqa: BLE001 - any file that cannot be read as HDF5 is simply not one
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def json_field(path: Path, key: str) -> Any:
    """``key`` of the JSON object in ``path`` (None: absent, not JSON, or over 64 MiB)."""
    try:
        if os.path.getsize(path) > 64 << 20:
            return None
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get(key) if isinstance(data, dict) else None


def first_line(path: Path) -> str | None:
    """The first line of ``path`` without its line end (None: unreadable or not UTF-8)."""
    try:
        with open(path, "rb") as fh:
            head = fh.readline(4096)
        return head.decode("utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError):
        return None


def hdf5_kind(what: str, attr: str, value: str) -> OutputKind:
    """An HDF5 file whose root attribute ``attr`` is ``value``."""
    return OutputKind(what, lambda path: hdf5_attr(path, attr) == value)


def described_by(what: str, description: Path, key: str, value: str) -> OutputKind:
    """A file of a set that a JSON ``description`` file describes (``key`` is ``value``): each
    file of the set (an index's ``INDEX``, ``INDEX.json``, ``INDEX.ids.txt``) is one while the
    description says so."""
    return OutputKind(what, lambda _path: json_field(description, key) == value)


def headed(what: str, *headers: str) -> OutputKind:
    """A text file whose first line is one of ``headers`` (a TSV's column names)."""
    return OutputKind(what, lambda path: first_line(path) in headers)


#: what embed, merge and ``Result.save`` write
STORE = hdf5_kind("an embedpipe store", "format", STORE_FORMAT)

_MAGIC = ((b"PK\x03\x04", "a zip file (a torch checkpoint, for example)"), (b"\x93NUMPY", "a NumPy array file"),
          (b"PAR1", "a Parquet file"), (b"\x1f\x8b", "a gzip file"))


def what_is(path: Path) -> str:
    """What the existing file ``path`` is, as a refusal says it: an embedpipe store or export,
    an HDF5, zip, NumPy, Parquet or gzip file, a FASTA, JSON or text file, or a binary file."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError as exc:
        return f"an unreadable file ({exc.strerror or exc})"
    if not head:
        return "an empty file"
    if head.startswith(_HDF5_MAGIC):
        if hdf5_attr(path, "format") == STORE_FORMAT:
            return "an embedpipe store"
        exported = hdf5_attr(path, "export_format")
        return f"an embedpipe {exported} export" if isinstance(exported, str) else "an HDF5 file"
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    try:
        text = head.decode("utf-8").lstrip()
    except UnicodeDecodeError:
        return "a binary file"
    return "a FASTA file" if text.startswith(">") else "a JSON file" if text.startswith("{") else "a text file"


def refuse_foreign(command: str, label: str, out: Path, kind: OutputKind) -> None:
    """Refuse, in one line naming ``out`` and what it is, to replace an existing regular file
    that ``kind`` does not recognise; the file is kept. An empty file holds nothing to lose
    (``--out "$(mktemp)"``) and is replaced. What is not a regular file (a directory, a FIFO)
    is :func:`embedpipe.core.atomic.check_output_path`'s to refuse."""
    path = Path(out)
    if not path.is_file() or path.stat().st_size == 0 or kind.test(path):
        return
    raise EmbedpipeError(f"{label} {_d(out)} exists and is {what_is(Path(out))}, not {kind.what}; {command} "
                         f"replaces only {kind.what}: remove the file or choose another output path")


@dataclass(frozen=True)
class _Where:
    """Where a path lands: its resolved name, and (dev, inode) when it exists."""

    real: Path
    inode: tuple[int, int] | None

    def same(self, other: _Where) -> bool:
        return self.real == other.real or (self.inode is not None and self.inode == other.inode)


def _where(path: Path) -> _Where:
    path = Path(path).expanduser()
    try:
        st = os.stat(path)
        inode: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except OSError:
        inode = None
    return _Where(path.resolve(), inode)


def same_file(one: Path, other: Path) -> bool:
    """Whether two paths are one file: the same resolved name (``..``, symlinks) or, for
    existing files, the same device and inode (a hard link)."""
    return _where(Path(one)).same(_where(Path(other)))


def _how(out: Path, other: Path) -> str:
    """Why two spellings are one file: the same name, a symlink, or a hard link."""
    if Path(out).resolve() == Path(other).resolve():
        return "" if os.path.abspath(out) == os.path.abspath(other) else " (through a symlink)"
    return " (a hard link to it)"


def guard_outputs(command: str, outputs: Sequence[Output], inputs: Iterable[Path] = (), *,
                  pinned: Mapping[Path, Sequence[Path]] | None = None,
                  directories: Iterable[tuple[str, Path]] = ()) -> None:
    """Refuse, in one line naming both paths, an output that is an input, another output, or a
    source ``pinned`` by a merged store the command reads (store -> its sources, from
    :func:`embedpipe.store.sources.pinned_by`); an input inside one of the ``directories``
    the command replaces; and an output of a kind over an existing file of another kind
    (:func:`refuse_foreign`). ``outputs`` are (label, path) pairs or (label, path, kind)
    triples, ``directories`` (label, path) pairs, the label being how the user named it
    (``--out``, ``--done``, ``store``). Paths are resolved first (``..``, symlinks)."""
    ins = [(Path(p), _where(Path(p))) for p in inputs if p is not None]
    for label, directory in directories:
        real = Path(directory).resolve()
        for inp, there in ins:
            if there.real.is_relative_to(real):
                raise InputError(f"{_d(inp)}: lies inside {label} {_d(directory)}, which {command} replaces; "
                                 f"move the input elsewhere or choose another {label}")
    seen: list[tuple[str, Path, _Where]] = []
    for label, out in _pairs(outputs):
        here = _where(Path(out))
        for inp, there in ins:
            if here.same(there):
                raise EmbedpipeError(f"{label} {_d(out)} is the input {_d(inp)}{_how(out, inp)}; "
                                     f"{command} never writes over its inputs: choose another output path")
        for other_label, other, there in seen:
            if here.same(there):
                raise EmbedpipeError(f"{label} {_d(out)} is also {other_label} {_d(other)}{_how(out, other)}; "
                                     "each output needs a path of its own")
        seen.append((label, Path(out), here))
    for store, sources in (pinned or {}).items():
        for source in sources:
            there = _where(source)
            for label, out, here in seen:
                if here.same(there):
                    raise EmbedpipeError(f"{label} {_d(out)} is {_d(source)}, a source store that the merged store "
                                         f"{_d(store)} pins (it reads from it); choose another output path")
    for output in outputs:
        if len(output) == 3:
            refuse_foreign(command, output[0], Path(output[1]), output[2])


def _pairs(outputs: Sequence[Output]) -> list[tuple[str, Path]]:
    """(label, path) of each output, its kind left out."""
    return [(output[0], Path(output[1])) for output in outputs]


@contextlib.contextmanager
def writing_outputs(command: str, outputs: Sequence[Output], inputs: Iterable[Path] = (), *,
                    pinned: Mapping[Path, Sequence[Path]] | None = None,
                    directories: Iterable[tuple[str, Path]] = ()) -> Iterator[None]:
    """:func:`guard_outputs`, then hold the lock of every output (:func:`lock_path_for`, the one
    a group embed job takes for its stores) until the block ends, so that no other embedpipe
    writer replaces them meanwhile: a second one is refused in one line naming the holder.

    ``stores`` are every store the command reads (``--reuse`` sources, merged inputs): an
    output they pin is refused. An output file that cannot be written is refused before its
    lock is made beside it (a directory output, e.g. a Hugging Face model, is the writer's to check)."""
    guard_outputs(command, outputs, inputs, pinned=pinned, directories=directories)
    pairs = _pairs(outputs)
    for _, out in pairs:
        if not out.is_dir():
            check_output_path(out)  # a device node or an unwritable directory: no lock file made there
    with holding([(lock_path_for(out), f"{label} {_d(out)}") for label, out in pairs],
                 instead="another output path", remove=True):
        yield


__all__ = ["STORE", "Output", "OutputKind", "described_by", "guard_outputs", "hdf5_kind", "headed", "refuse_foreign",
           "same_file", "what_is", "writing_outputs"]
