"""The user's own labels for the downstream cross-check (``embedpipe crosscheck --labels``).

Read and check the ``id<TAB>label`` file (a header line first), decide whether the labels
are classes or numbers, resolve each ID through the store's own lookup (aliases of a merged
store resolve to the record they duplicate), and draw the sample from the labelled records:
stratified by class (or by quantiles of a numeric target), capped by ``--sample``.

Every refusal is one line naming the file and the line (docs/crosscheck.md, "Downstream:
your own labels"): a malformed line, a duplicate ID, an ID not in the store (unless
``ignore_unknown_ids``; then they are counted and listed in crosscheck.json), one class
only, a class with fewer labelled records than folds, a non-numeric regression value.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from embedpipe.core.errors import EmbedpipeError, quote
from embedpipe.core.options import CROSSCHECK_BOOTSTRAP, CROSSCHECK_FOLDS, LABEL_KINDS, check_choice
from embedpipe.crosscheck.metrics import allocate_proportional, stratified_sample
from embedpipe.store.idindex import UnknownIdError
from embedpipe.store.reader import Store

__all__ = ["LabelEntry", "LabelOptions", "Labelled", "decide_kind", "read_label_file", "resolve_labels", "sample_labelled"]

#: unknown IDs named in the one-line refusal (all of them go to crosscheck.json)
_NAMED = 5
#: numeric target bins of the stratified sample of a regression
_TARGET_BINS = 4
#: the header a label file's first line may name (any other is accepted unless it is data)
HEADER = ("id", "label")


@dataclass(frozen=True)
class LabelOptions:
    """What ``--labels`` and its companions ask for."""

    path: Path
    kind: str = "auto"
    folds: int = CROSSCHECK_FOLDS
    ignore_unknown_ids: bool = False
    bootstrap: int = CROSSCHECK_BOOTSTRAP

    def validate(self) -> None:
        check_choice("--label-kind", self.kind, LABEL_KINDS)
        if self.folds < 2:
            raise EmbedpipeError(f"--folds must be at least 2, not {self.folds}")
        if self.bootstrap < 100:
            raise EmbedpipeError(f"--bootstrap must be at least 100, not {self.bootstrap}")


@dataclass(frozen=True)
class LabelEntry:
    """One data line of the label file."""

    line: int
    id: str
    label: str


@dataclass
class Labelled:
    """The labels that name stored records: store rows (ascending) and their labels."""

    path: Path
    kind: str
    how: str
    rows: np.ndarray
    labels: list[str]
    lines: list[int]
    n_entries: int
    unknown_ids: list[str] = field(default_factory=list)

    def target(self) -> np.ndarray:
        """The labels as the model's target: class names, or float64 numbers."""
        if self.kind == "numbers":
            return np.array([float(v) for v in self.labels], dtype=np.float64)
        return np.array(self.labels, dtype=object)

    def classes(self) -> dict[str, int]:
        return dict(sorted(Counter(self.labels).items())) if self.kind == "classes" else {}


# =============================================================================== the file


def read_label_file(path: Path, is_id: Callable[[str], bool] | None = None) -> list[LabelEntry]:
    """The data lines of an ``id<TAB>label`` file with a header; blank lines are skipped. A
    first line whose ID ``is_id`` knows (a store ID) is data, not a header: refused, since
    reading it as the header silently lost its label (docs/crosscheck.md)."""
    path = Path(path)
    if not path.is_file():
        raise EmbedpipeError(f"--labels {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise EmbedpipeError(f"{path} line {line}: not UTF-8 text") from None
    entries: list[LabelEntry] = []
    seen: dict[str, int] = {}
    header = True
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        fields = raw.split("\t")
        if len(fields) != 2:
            raise EmbedpipeError(f"{path} line {number}: expected 2 tab-separated columns (id<TAB>label), "
                                 f"found {len(fields)}")
        if header:
            header = False
            _check_header(path, number, fields, is_id)
            continue
        rid, label = fields[0].strip(), fields[1].strip()
        if not rid or not label:
            raise EmbedpipeError(f"{path} line {number}: empty {'ID' if not rid else 'label'}")
        if rid in seen:
            raise EmbedpipeError(f"{path} line {number}: ID {quote(rid)} is labelled twice (also line {seen[rid]})")
        seen[rid] = number
        entries.append(LabelEntry(number, rid, label))
    if not entries:
        raise EmbedpipeError(f"{path}: no labels (the first line is the header, then id<TAB>label lines)")
    return entries


def _check_header(path: Path, number: int, fields: list[str], is_id: Callable[[str], bool] | None) -> None:
    """The first line is a header: its columns are the expected names, or at least its first
    field is not an ID of the store (then the header is missing and the line is data)."""
    if [f.strip().lower() for f in fields] == list(HEADER) or is_id is None:
        return
    if is_id(rid := fields[0].strip()):
        raise EmbedpipeError(f"{path} line {number}: the header line is missing: the first line starts with "
                             f"{quote(rid)}, an ID of the store, and would be read as the header (its label "
                             f"lost); the file needs a header line first ({HEADER[0]}<TAB>{HEADER[1]}), then "
                             "id<TAB>label lines")


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def decide_kind(entries: list[LabelEntry], requested: str, path: Path) -> tuple[str, str]:
    """``(kind, why)``: classes or numbers. ``auto`` reads numbers when most labels are
    numbers and not all of them are integers (0/1 or 1..5 stay classes)."""
    if requested == "classes":
        return "classes", "--label-kind classes"
    numbers = [_number(e.label) for e in entries]
    finite = [v for v in numbers if v is not None]
    if requested == "auto" and not (2 * len(finite) > len(entries) and any(not v.is_integer() for v in finite)):
        why = ("auto: integer labels are read as classes (--label-kind numbers for a regression)" if
               len(finite) == len(entries) else "auto: the labels are not numbers")
        return "classes", why
    for entry, value in zip(entries, numbers):
        if value is None:
            hint = ("--label-kind classes to read them as classes" if requested == "auto"
                    else "the labels are numbers: --label-kind numbers")
            raise EmbedpipeError(f"{path} line {entry.line}: label {quote(entry.label)} is not a finite number "
                                 f"(a regression target needs one on every line; {hint})")
    return "numbers", ("--label-kind numbers" if requested == "numbers"
                       else "auto: the labels are numbers, not all integers")


# =============================================================================== the store


def _rows_of(entries: list[LabelEntry], st: Store, path: Path) -> tuple[dict[int, LabelEntry], list[LabelEntry]]:
    """Store row of each entry (an alias resolves to its record's row); the entries not stored."""
    by_row: dict[int, LabelEntry] = {}
    unknown: list[LabelEntry] = []
    for entry in entries:
        try:
            row = int(st.index(entry.id))
        except UnknownIdError:
            unknown.append(entry)
            continue
        first = by_row.get(row)
        if first is not None and first.label != entry.label:
            raise EmbedpipeError(
                f"{path} line {entry.line}: {quote(entry.id)} is the same stored record as "
                f"{quote(first.id)} (line {first.line}) but labelled {quote(entry.label)}, not {quote(first.label)}")
        by_row.setdefault(row, entry)
    return by_row, unknown


def resolve_labels(opts: LabelOptions, st: Store) -> Labelled:
    """The label file's records in the store, checked for what the downstream fit needs."""
    path = Path(opts.path)
    entries = read_label_file(path, is_id=lambda rid: rid in st)
    kind, how = decide_kind(entries, opts.kind, path)
    by_row, unknown = _rows_of(entries, st, path)
    if unknown and (not opts.ignore_unknown_ids or not by_row):
        names = ", ".join(quote(e.id) for e in unknown[:_NAMED]) + (", ..." if len(unknown) > _NAMED else "")
        tail = ("none of the labelled IDs is stored" if not by_row else
                "--ignore-unknown-ids leaves them out (counted and listed in crosscheck.json)")
        raise EmbedpipeError(f"{path} line {unknown[0].line}: ID {quote(unknown[0].id)} is not in {st.path.name} "
                             f"({len(unknown)} of {len(entries)} labelled IDs are not: {names}); {tail}")
    rows = sorted(by_row)
    kept = [by_row[r] for r in rows]
    labelled = Labelled(path=path, kind=kind, how=how, rows=np.array(rows, dtype=np.int64),
                        labels=[e.label for e in kept], lines=[e.line for e in kept], n_entries=len(entries),
                        unknown_ids=[e.id for e in unknown])
    _check_enough(labelled, opts.folds)
    return labelled


def _check_enough(labelled: Labelled, folds: int) -> None:
    """Two classes at least, each with a record per fold; a numeric target that varies."""
    path, n = labelled.path, len(labelled.labels)
    if labelled.kind == "numbers":
        if n < 2 * folds:
            raise EmbedpipeError(f"{path}: {n} labelled record(s) in the store, fewer than the {2 * folds} that "
                                 f"{folds} folds need (two test records each)")
        if len(set(labelled.target().tolist())) < 2:
            raise EmbedpipeError(f"{path} line {min(labelled.lines)}: every label is {quote(labelled.labels[0])}: "
                                 "a regression target must vary")
        return
    counts = labelled.classes()
    if len(counts) < 2:
        raise EmbedpipeError(f"{path} line {min(labelled.lines)}: every stored record is labelled "
                             f"{quote(labelled.labels[0])}: one class only, a classifier needs two at least")
    for name, count in counts.items():
        if count < folds:
            line = min(n for n, label in zip(labelled.lines, labelled.labels) if label == name)  # first in the file
            raise EmbedpipeError(f"{path} line {line}: class {quote(name)} has {count} labelled record(s) in the store, "
                                 f"fewer than the {folds} folds need (--folds)")


# =============================================================================== the sample


def sample_labelled(labelled: Labelled, sample: int, seed: int, folds: int) -> np.ndarray:
    """Store rows of the sample (ascending): stratified by class, at least ``folds`` per
    class; a numeric target by its quantiles. All labelled records when ``sample`` allows."""
    n = labelled.rows.size
    if sample >= n:
        return labelled.rows.copy()
    if labelled.kind == "numbers":
        if sample < 2 * folds:
            raise EmbedpipeError(f"--sample {sample} is too small for {folds} folds: at least {2 * folds}")
        ranks = np.argsort(np.argsort(labelled.target(), kind="stable"), kind="stable")
        return np.sort(labelled.rows[stratified_sample(ranks, sample, seed, n_bins=_TARGET_BINS)])
    names = list(labelled.classes())
    if sample < folds * len(names):
        raise EmbedpipeError(f"--sample {sample} is too small for {len(names)} classes with {folds} folds: "
                             f"at least {folds * len(names)}")
    labels = np.array(labelled.labels, dtype=object)
    groups = [np.flatnonzero(labels == name) for name in names]
    extra = allocate_proportional([g.size - folds for g in groups], sample - folds * len(names))
    rng = np.random.default_rng(seed)
    chosen = [rng.choice(g, size=folds + e, replace=False) for g, e in zip(groups, extra)]
    return np.sort(labelled.rows[np.concatenate(chosen)])
