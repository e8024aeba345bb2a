"""Before any work: no output of a command may be one of its inputs, another of its outputs,
or a source that a merged store it reads pins (docs/store-format.md, "Atomic writes").

Every command that writes calls :func:`writing_outputs` once with what it reads and what it will
write: the guard, then the lock of each output held for the whole run (docs/cluster.md, "One run
per outdir": a second writer of the same path is refused, naming the holder).
Paths are compared as the file system sees them: symlinks resolved, and existing files by
device and inode, so a hard link to an input is refused too. An atomic rename would replace
only the directory entry, but the old file is then no longer where the user keeps it (a
FASTA turned into HDF5 under its own name), and a merged store would read a changed shard.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from embedpipe.core.atomic import check_output_path
from embedpipe.core.errors import EmbedpipeError, InputError
from embedpipe.core.locks import holding, lock_path_for
from embedpipe.core.paths import display_path as _d


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


def _how(out: Path, other: Path) -> str:
    """Why two spellings are one file: the same name, a symlink, or a hard link."""
    if Path(out).resolve() == Path(other).resolve():
        return "" if os.path.abspath(out) == os.path.abspath(other) else " (through a symlink)"
    return " (a hard link to it)"


def guard_outputs(command: str, outputs: Sequence[tuple[str, Path]], inputs: Iterable[Path] = (), *,
                  pinned: Mapping[Path, Sequence[Path]] | None = None,
                  directories: Iterable[tuple[str, Path]] = ()) -> None:
    """Refuse, in one line naming both paths, an output that is an input, another output, or a
    source ``pinned`` by a merged store the command reads (store -> its sources, from
    :func:`embedpipe.store.sources.pinned_by`); and an input inside one of the
    ``directories`` the command replaces. ``outputs`` and ``directories`` are (label, path)
    pairs, the label being how the user named it (``--out``, ``--done``, ``store``)."""
    ins = [(Path(p), _where(Path(p))) for p in inputs if p is not None]
    for label, directory in directories:
        real = Path(directory).resolve()
        for inp, there in ins:
            if there.real.is_relative_to(real):
                raise InputError(f"{_d(inp)}: lies inside {label} {_d(directory)}, which {command} replaces; "
                                 f"move the input elsewhere or choose another {label}")
    seen: list[tuple[str, Path, _Where]] = []
    for label, out in outputs:
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


@contextlib.contextmanager
def writing_outputs(command: str, outputs: Sequence[tuple[str, Path]], inputs: Iterable[Path] = (), *,
                    pinned: Mapping[Path, Sequence[Path]] | None = None,
                    directories: Iterable[tuple[str, Path]] = ()) -> Iterator[None]:
    """:func:`guard_outputs`, then hold the lock of every output (:func:`lock_path_for`, the one
    a group embed job takes for its stores) until the block ends, so that no other embedpipe
    writer replaces them meanwhile: a second one is refused in one line naming the holder.

    ``stores`` are every store the command reads (``--reuse`` sources, merged inputs): an
    output they pin is refused. An output file that cannot be written is refused before its
    lock is made beside it (a directory output, e.g. a Hugging Face model, is the writer's to check)."""
    outputs = [(label, Path(out)) for label, out in outputs]
    guard_outputs(command, outputs, inputs, pinned=pinned, directories=directories)
    for _, out in outputs:
        if not out.is_dir():
            check_output_path(out)  # a device node or an unwritable directory: no lock file made there
    with holding([(lock_path_for(out), f"{label} {_d(out)}") for label, out in outputs],
                 instead="another output path", remove=True):
        yield


__all__ = ["guard_outputs", "writing_outputs"]
