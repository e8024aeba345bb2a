"""``embedpipe validate``: every check of docs/store-format.md ("Checking a store"), each
failure one problem line, never an exception for a bad file."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.core.options import STORAGE_DTYPES
from embedpipe.store.checks import count_problems, layout_problems, nonfinite_rows
from embedpipe.store.columns import COLUMNS, STR, required_columns
from embedpipe.store.digests import COVERED_SINCE, ROW_DIGEST, DigestCheck, RecordedDigests, digest_parts
from embedpipe.store.encoding import encoding_problems
from embedpipe.store.format import (
    POOLINGS,
    attr_to_python,
    chars_per_residue,
    check_format,
    decode_strings,
    is_complete,
    layer_names,
    open_h5,
    poolings_of,
    read_blocks,
    read_root_attrs,
    residues_of,
    stored_layers,
    string_counts,
)
from embedpipe.store.id_checks import id_text_problems
from embedpipe.store.idindex import LazyIds
from embedpipe.store.idsort import index_problems_sorted
from embedpipe.store.meancheck import MeanCheck, mean_checks
from embedpipe.store.merged_provenance import platform_lines, platforms
from embedpipe.store.record_digest import coverage_problems
from embedpipe.store.residues import ShardRows
from embedpipe.store.row_checks import record_problem, unknown_long_handling
from embedpipe.store.sequences import iter_sequence_blocks, sequence_count
from embedpipe.store.sources import validate_sources

#: rows of an integer column read at a time (2 MiB of int64): validate's memory independent of N
COLUMN_ROWS = 1 << 18


def _read_all(blocks: Iterator[tuple[slice, np.ndarray]], name: str, problems: list[str], *, check_finite: bool,
              checks: Sequence[MeanCheck | DigestCheck] = ()) -> None:
    """Read every block (verifying checksums at the source), optionally check finiteness and
    hand each block to ``checks`` (so the mean check and the row digests cost no second read)."""
    nonfinite = 0
    first_bad: int | None = None
    try:
        for sl, block in blocks:
            if check_finite and (bad := nonfinite_rows(block)).any():
                nonfinite += int(np.count_nonzero(bad))
                if first_bad is None:
                    first_bad = sl.start + int(np.argmax(bad))
            for check in checks:
                check.feed(sl, block)
    except StoreError as exc:
        problems.append(str(exc))
        return
    problems.extend(problem for check in checks if (problem := check.problem()))
    if nonfinite:
        problems.append(f"dataset {name}: {nonfinite} row(s) with non-finite values (first at row {first_bad})")


def _datasets_by_name(f: h5py.File) -> list[tuple[str, h5py.Dataset]]:
    out: list[tuple[str, h5py.Dataset]] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            out.append((name, obj))

    f.visititems(visit)
    return out


class _Validation:
    """The checks of one open store, in order; each appends to ``problems``."""

    def __init__(self, f: h5py.File, path: Path, version: int, problems: list[str], notes: list[str]) -> None:
        self.f, self.path, self.version, self.problems, self.notes = f, path, version, problems, notes
        try:
            self.attrs = read_root_attrs(f)
        except StoreError as exc:  # one attribute refused (nested JSON, not UTF-8): the rest still checked
            problems.append(str(exc).removeprefix(f"{path}: "))
            self.attrs = {key: attr_to_python(value) for key, value in f.attrs.items()}
        self.storage = self.attrs.get("storage_dtype")
        self.dim = self.attrs.get("dim")
        self.layers = stored_layers(f)
        self.n = 0
        self.ids: LazyIds | None = None  # read block by block, never held (docs/benchmarks.md)
        self.embedded_ok = False  # embedded_length is usable for the offsets check

    def label(self, i: int) -> str:
        return repr(self.ids[i] if self.ids else i)

    def run(self) -> None:
        f, problems = self.f, self.problems
        if not is_complete(f):
            problems.append("store is incomplete (attribute 'complete' is not true): the writer did not finish")
        if self.storage not in STORAGE_DTYPES:
            problems.append(f"storage_dtype attribute is {self.storage!r}, not one of {', '.join(STORAGE_DTYPES)}")
        problems.extend(str(p).removeprefix(f"{self.path}: ") for p in encoding_problems(f, self.path))
        if "ids" not in f:
            problems.append("dataset ids is missing")
            return
        self.n = int(f["ids"].shape[0])
        self.layout()
        self.columns()
        self.read_ids()
        self.means()
        self.pooling()
        self.lengths()
        self.per_residue()
        self.aliases_and_skipped()
        if self.ids is not None:
            compare = not any(p.kind == "index" for p in self.structural)
            if "id_index" not in f and self.version >= 2:
                problems.append("group id_index is missing")
            elif "id_index" in f and any(k not in f["id_index"] for k in ("keys", "rows", "fences")):
                problems.append("group id_index needs datasets keys, rows and fences")
                compare = False
            problems.extend(index_problems_sorted(f, self.n, compare=compare))
        self.data()
        if self.version >= COVERED_SINCE:  # each record's ID, sequence and columns; the root attributes
            trusted = self._usable(ROW_DIGEST) and ROW_DIGEST not in self.untrusted and self.ids is not None
            problems.extend(coverage_problems(f, self.n, self.layers, self.ids if trusted else None, self.path))

    def layout(self) -> None:
        """The checks readers make at open (embedpipe.store.checks): those validate has no words
        of its own for are reported; every dataset they name is not read (a dataset declared
        larger than the file would allocate it: time and memory stay bounded by the real data)."""
        self.structural = layout_problems(self.f, self.path, list(COLUMNS))
        self.untrusted = {p.dataset for p in self.structural}
        self.problems.extend(p.message for p in self.structural
                             if p.kind in ("size", "index") or p.dataset.startswith("sequence"))
        self.problems.extend(count_problems(self.f, self.n))

    def columns(self) -> None:
        """Every column the store's version requires exists; every column has N rows."""
        required = {c.name for c in required_columns(self.version)}
        for name in COLUMNS:
            if name not in self.f:
                if name in required:
                    self.problems.append(f"dataset {name} is missing")
            elif name == "sequence":
                if (rows := sequence_count(self.f)) != self.n:
                    self.problems.append(f"sequence column has {rows} rows (or is malformed), expected {self.n}")
            elif self.f[name].shape != (self.n,):
                self.problems.append(f"dataset {name} has shape {self.f[name].shape}, expected ({self.n},)")

    def read_ids(self) -> None:
        """IDs, aliases and skipped IDs (:func:`id_text_problems`); ``ids`` read lazily after."""
        problems, readable = id_text_problems(self.f)
        self.problems.extend(problems)
        if readable:
            self.ids = LazyIds(self.f["ids"], lambda _: False)

    def means(self) -> None:
        """``layers`` matches the mean datasets, each (N, D) in the storage dtype."""
        mean_layers = layer_names(self.f.get("mean", {}))
        if self.f.attrs.get("layers") is None:
            self.problems.append("root attribute 'layers' is missing")
        elif mean_layers != self.layers:
            self.problems.append(f"layers attribute {self.layers} != mean datasets {mean_layers}")
        self.pooled_layers("mean", mean_layers)

    def pooling(self) -> None:
        """The ``pooling`` attribute names known poolings, among them ``mean``, and exactly the
        pooled groups present; each holds the stored layers (docs/store-format.md, "Datasets")."""
        listed = poolings_of(self.f)
        if "mean" not in listed or set(listed) - set(POOLINGS):
            self.problems.append(f"pooling attribute is {listed!r}: must list mean and only {', '.join(POOLINGS)}")
        for pooling in POOLINGS[1:]:
            if (pooling in listed) != (pooling in self.f):
                self.problems.append(f"pooling attribute {listed} disagrees with the {pooling} group "
                                     + ("(present)" if pooling in self.f else "(missing)"))
            if pooling in self.f:
                layers = layer_names(self.f[pooling])
                if layers != self.layers:
                    self.problems.append(f"{pooling} datasets {layers} != layers attribute {self.layers}")
                self.pooled_layers(pooling, layers)

    def pooled_layers(self, pooling: str, layers: list[int]) -> None:
        """Each ``{pooling}/layer_{k}`` is (N, D) in the storage dtype."""
        for k in layers:
            name = f"{pooling}/layer_{k}"
            ds = self.f[name]
            if ds.ndim != 2 or ds.shape[0] != self.n or (self.dim is not None and ds.shape[1] != self.dim):
                self.problems.append(f"dataset {name} has shape {ds.shape}, expected ({self.n}, {self.dim})")
            if self.storage in STORAGE_DTYPES and ds.dtype != np.dtype(self.storage):
                self.problems.append(f"dataset {name} has dtype {ds.dtype}, storage_dtype says {self.storage}")

    def _usable(self, name: str) -> bool:
        """A per-record column present with N rows (its shape problem is reported elsewhere)."""
        return name in self.f and self.f[name].shape == (self.n,)

    def _ints(self, name: str, lo: int, hi: int) -> np.ndarray | None:
        """Rows ``lo:hi`` of an integer column as int64; None (and one problem) when unreadable."""
        try:
            return self.f[name][lo:hi].astype(np.int64)
        except OSError as exc:
            self.problems.append(f"dataset {name}: checksum mismatch or read error ({exc})")
            return None

    def lengths(self) -> None:
        """``embedded_length`` within 0..``length``, ``length == len(sequence)``, known
        ``long_handling``; block by block (memory independent of N)."""
        use_len, use_emb = self._usable("length"), self._usable("embedded_length")
        for lo in range(0, self.n if use_len and use_emb else 0, COLUMN_ROWS):
            hi = min(self.n, lo + COLUMN_ROWS)
            lengths = self._ints("length", lo, hi) if use_len else None
            emb = self._ints("embedded_length", lo, hi) if use_emb else None
            use_len, use_emb = lengths is not None, emb is not None
            if lengths is None or emb is None:
                continue
            if (found := record_problem(lengths, embedded=emb)) is not None:
                self.problems.append(f"record {self.label(lo + found[0])}: {found[1]}")
                break
        self.embedded_ok = use_emb and self._usable("embedded_length")
        if use_len:
            self.sequence_lengths()
        for name, column in COLUMNS.items():  # every string column is UTF-8 (names the row)
            if column.dtype == STR and name not in ("ids", "sequence", "long_handling") and self._usable(name):
                self._distinct(name, keep=False)
        for name in ("aliases/of", "skipped/reason"):
            if name in self.f and self.f[name].ndim == 1:
                self._distinct(name, keep=False)
        handling = self._usable("long_handling") and self._distinct("long_handling")
        if bad_handling := unknown_long_handling(handling or ()):
            self.problems.append(f"long_handling has unknown value(s) {bad_handling}")

    def _distinct(self, name: str, keep: bool = True) -> set[str] | None:
        """A string column's distinct values (``keep``; else none are kept: memory independent
        of N), from the stored bytes block by block (decoding every value of a 64 MiB block to
        Python strings cost ~100 B per record); a value that is not UTF-8 is one problem
        naming its row."""
        out: set[str] = set()
        try:
            for values, _ in string_counts(self.f[name], f"dataset {name}", COLUMN_ROWS):
                out.update(values if keep else ())
        except OSError as exc:
            self.problems.append(f"dataset {name}: checksum mismatch or read error ({exc})")
            return None
        except StoreError as exc:
            self.problems.append(str(exc))
            return None
        return out

    def sequence_lengths(self) -> None:
        """``length == len(sequence)`` (residues: characters over ``chars_per_residue``, either
        layout), block by block."""
        per_residue = chars_per_residue(self.attrs)
        if sequence_count(self.f) != self.n or any(d.startswith("sequence") for d in self.untrusted):
            return
        try:
            for lo, block in iter_sequence_blocks(self.f):
                chars = np.array([residues_of(len(t), per_residue) for t in decode_strings(block, "dataset sequence", lo)],
                                 dtype=np.int64)
                lengths = self._ints("length", lo, lo + len(block))
                if lengths is None:
                    return
                if (found := record_problem(lengths, chars=chars)) is not None:
                    self.problems.append(f"record {self.label(lo + found[0])}: {found[1]}")
                    return
        except StoreError as exc:
            self.problems.append(str(exc))

    def per_residue(self) -> None:
        on = attr_to_python(self.attrs.get("per_residue", "per_residue" in self.f))
        if on and "per_residue" not in self.f:
            self.problems.append("per_residue attribute is true but the per_residue group is missing")
        if "per_residue" not in self.f:
            return
        pr = self.f["per_residue"]
        pr_layers = layer_names(pr)
        if pr_layers != self.layers:
            self.problems.append(f"per_residue datasets {pr_layers} != layers attribute {self.layers}")
        if "offsets" not in pr:
            self.problems.append("dataset per_residue/offsets is missing")
        elif pr["offsets"].shape != (self.n + 1,):
            self.problems.append(f"dataset per_residue/offsets has shape {pr['offsets'].shape}, expected ({self.n + 1},)")
        else:
            try:
                last = self.offsets(pr["offsets"])
            except OSError as exc:
                self.problems.append(f"dataset per_residue/offsets: checksum mismatch or read error ({exc})")
                return
            self.residue_shapes(pr, pr_layers, last)

    def offsets(self, ds: h5py.Dataset) -> int:
        """Start at 0, monotonic, steps equal ``embedded_length``; read in blocks of
        COLUMN_ROWS (+1 shared with the next). Returns the last offset (the row count)."""
        first = int(ds[0])
        if first != 0:
            self.problems.append(f"per_residue/offsets[0] is {first}, not 0")
        mismatch: str | None = None  # reported only when the offsets never drop (as one check)
        prev = first
        for lo in range(0, self.n, COLUMN_ROWS):
            hi = min(self.n, lo + COLUMN_ROWS)
            off = ds[lo : hi + 1].astype(np.int64)
            steps = np.diff(off)
            if (steps < 0).any():
                self.problems.append(f"per_residue/offsets not monotonic (first drop after row {lo + int(np.argmax(steps < 0))})")
                return int(ds[self.n])
            prev = int(off[-1])
            if mismatch is None and self.embedded_ok:
                emb = self._ints("embedded_length", lo, hi)
                self.embedded_ok = emb is not None
                if emb is not None and not np.array_equal(steps, emb):
                    i = int(np.argmax(steps != emb))
                    mismatch = (f"record {self.label(lo + i)}: {steps[i]} per-residue rows but embedded_length "
                                f"{emb[i]}")
        if mismatch:
            self.problems.append(mismatch)
        return prev

    def residue_shapes(self, pr: h5py.Group, pr_layers: list[int], total: int) -> None:
        """Each ``per_residue/layer_k`` is (offsets[N], D)."""
        for k in pr_layers:
            ds = pr[f"layer_{k}"]
            if ds.ndim != 2 or ds.shape[0] != total or (self.dim is not None and ds.shape[1] != self.dim):
                self.problems.append(
                    f"dataset per_residue/layer_{k} has shape {ds.shape}, expected ({total}, {self.dim})"
                )

    def aliases_and_skipped(self) -> None:
        """Both groups' datasets pair up (their IDs and targets: embedpipe.store.idsort)."""
        for group, second in (("aliases", "of"), ("skipped", "reason")):
            if group not in self.f:
                continue
            g = self.f[group]
            if "id" not in g or second not in g or g["id"].shape != g[second].shape:
                self.problems.append(f"{group} group needs datasets id and {second} of equal length")

    def data(self) -> None:
        """Merged sources, then every chunk once: checksums (at the source, for virtual
        datasets), finiteness and whether each stored mean is the mean of its per-residue rows."""
        datasets = _datasets_by_name(self.f)
        sources_ok = True
        if "merged_from" in self.f.attrs or any(ds.is_virtual for _, ds in datasets):
            sources_ok = validate_sources(self.f, self.path, self.ids, self.problems)
        checks = mean_checks(self.f, self.ids) if sources_ok else {}
        digests = self.digest_checks()
        # a merged store's per-residue rows are read from each shard store in turn, not through
        # the virtual datasets (bounded open files and memory; embedpipe.store.residues)
        shards = ShardRows.of(self.f, self.path) if sources_ok else None
        for name, ds in datasets:
            if not ds.is_virtual and not ds.fletcher32:
                self.problems.append(f"dataset {name} has no fletcher32 checksum")
            if (ds.is_virtual and not sources_ok) or name in self.untrusted:
                continue
            vectors = ds.dtype.kind == "f" and name.split("/", 1)[0] in {*POOLINGS, "per_residue"}
            blocks = shards.blocks(name) if ds.is_virtual and shards is not None else read_blocks(ds, name)
            _read_all(blocks, name, self.problems, check_finite=vectors,
                      checks=[c for c in (checks.get(name), digests.get(name)) if c is not None])
        self.digest_notes(digests)

    def digest_checks(self) -> dict[str, DigestCheck]:
        """Vector dataset -> its row digest check (embedpipe.store.digests), when the store
        records digests and the column and the offsets can be trusted (their problems are
        reported elsewhere)."""
        if ROW_DIGEST not in self.f or not self._usable(ROW_DIGEST) or ROW_DIGEST in self.untrusted or not self.ids:
            return {}
        per_residue = isinstance(self.f.get("per_residue"), h5py.Group)
        parts = digest_parts(poolings_of(self.f), self.layers, per_residue, self.version)
        offsets = self.f.get("per_residue/offsets")
        offsets_ok = (isinstance(offsets, h5py.Dataset) and offsets.shape == (self.n + 1,)
                      and not any(p.dataset == "per_residue/offsets" for p in self.structural))
        return {name: DigestCheck(name, parts, RecordedDigests(self.f[ROW_DIGEST]), self.ids,
                                  offsets if name.startswith("per_residue/") else None)
                for name in parts if name in self.f and (offsets_ok or not name.startswith("per_residue/"))}

    def digest_notes(self, digests: dict[str, DigestCheck]) -> None:
        """What validate could not check, said but not a problem (docs/store-format.md, "Row digests")."""
        if ROW_DIGEST not in self.f and self.version < COVERED_SINCE:  # format 3: a problem (columns)
            self.notes.append("row digests are not recorded (a store written before embedpipe recorded them): "
                              "vectors edited in place cannot be detected; embed or merge it again to add them")
        elif digests and self.version < COVERED_SINCE and (unrecorded := next(iter(digests.values())).unrecorded):
            self.notes.append(f"{unrecorded} of {self.n} record(s) carry no row digest (copied from stores written "
                              "before embedpipe recorded them): their vectors edited in place cannot be detected")


def validate_report(path: Path) -> tuple[list[str], list[str]]:
    """(problems, notes) of the store at ``path``: problems empty only for a complete,
    consistent, checksummed, finite store whose vectors are the bytes written; notes say what
    could not be checked (row digests not recorded). Never raises for a bad file: every
    failure is a problem string."""
    path = Path(path)
    problems: list[str] = []
    notes: list[str] = []
    try:
        f = open_h5(path)
    except StoreError as exc:
        return [str(exc).removeprefix(f"{path}: ")], notes
    try:
        with f:
            try:
                version = check_format(f, path)
            except StoreError as exc:
                return [str(exc).removeprefix(f"{path}: ")], notes
            _Validation(f, path, version, problems, notes).run()
    except StoreError as exc:  # a bounded read refused (a crafted JSON attribute, bytes not UTF-8)
        problems.append(str(exc).removeprefix(f"{path}: "))
    except Exception as exc:  # noqa: BLE001 - validate must report, never crash
        problems.append(f"unreadable store structure: {type(exc).__name__}: {exc}")
    return problems, notes


def validate_store(path: Path) -> list[str]:
    """The problems of :func:`validate_report`."""
    return validate_report(path)[0]


def platform_notes(path: Path) -> list[str]:
    """For a merged store whose shards ran on several platforms (``embed --accept-platform-mix``),
    which records came from which (docs/store-format.md, ``platform``); [] otherwise, and for a
    file :func:`validate_store` reports as unreadable."""
    try:
        with open_h5(Path(path)) as f:
            attrs = read_root_attrs(f, only=("shard_provenance", "merged_rows"))
    except Exception:  # noqa: BLE001 - validate_store says what is wrong with the file
        return []
    return [f"records computed on {line}" for line in platform_lines(platforms(attrs))]
