"""Structure-aware sequences (SaProt's input) from an amino-acid FASTA and a 3Di FASTA paired
by ID, the two files Foldseek's ``convert2fasta`` writes for a structure database and its
``_ss`` 3Di database.

Each residue becomes its amino acid (upper case) followed by its 3Di state (lower case); an
``X`` 3Di state (Foldseek's unknown) becomes ``#``, SaProt's masked structure, and a ``#``
already in the 3Di FASTA stays one. The IDs must match one to one and each pair of records
must have as many amino acids as 3Di states; the two inputs must be two files, and hold at
least one record: anything else is one line naming the ID or the files, and nothing is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from embedpipe.core.atomic import atomic_path
from embedpipe.core.errors import InputError
from embedpipe.core.output_guard import same_file, writing_outputs
from embedpipe.inputs.fasta import iter_fasta, read_sequences

#: Foldseek's 20 3Di states (upper case as convert2fasta writes them, as FASTA reading makes them)
THREE_DI = frozenset("ACDEFGHIKLMNPQRSTVWY")
#: what else a 3Di position may hold: Foldseek's unknown ``X``, SaProt's masked state ``#``
MASKED = frozenset("X#")


def _pair(rid: str, amino: str, states: str, where: str) -> str:
    """One record's structure-aware sequence; one line for a length or state that does not fit."""
    if len(amino) != len(states):
        raise InputError(f"record '{rid}': {len(amino)} amino acids but {len(states)} 3Di states ({where})")
    bad = next((i for i, s in enumerate(states) if s not in THREE_DI and s not in MASKED), -1)
    if bad >= 0:
        raise InputError(f"record '{rid}': '{states[bad]}' at residue {bad + 1} is not a 3Di state ({where})")
    return "".join(a + ("#" if s in MASKED else s.lower()) for a, s in zip(amino, states))


def _three_di_records(path: Path) -> Iterator[tuple[str, str]]:
    """(ID, 3Di states in upper case) of each record of ``path``: as FASTA reading normalises a
    protein, except that ``#`` (no protein character, so an invalid record to that reading) is
    kept for :func:`_pair` to accept; any other character is left for it to name."""
    for record in iter_fasta(path):
        if record.invalid is None:
            yield record.id, record.sequence
        else:
            yield record.id, record.sequence.upper().removesuffix("*")


def join_structure(amino: Path, three_di: Path) -> list[tuple[str, str]]:
    """(ID, structure-aware sequence) for every record of ``amino``, in its order."""
    where = f"{amino} and {three_di}"
    if same_file(amino, three_di):
        raise InputError(f"{amino} and {three_di} are one file; give the amino-acid FASTA and the 3Di FASTA")
    states = dict(_three_di_records(three_di))
    joined = []
    for rid, seq in read_sequences(amino):
        if rid not in states:
            raise InputError(f"record '{rid}' of {amino} has no 3Di record in {three_di}")
        joined.append((rid, _pair(rid, seq, states.pop(rid), where)))
    if states:
        raise InputError(f"record '{next(iter(states))}' of {three_di} has no amino-acid record in {amino}")
    if not joined:
        raise InputError(f"{amino} and {three_di} hold no records; nothing to join")
    return joined


def write_structure_aware(amino: Path, three_di: Path, out: Path) -> int:
    """Write ``out`` (atomically) as a FASTA of structure-aware sequences, never over one of
    the inputs (embedpipe.core.output_guard); the records written."""
    with writing_outputs("join-structure", [("--out", Path(out))], [Path(amino), Path(three_di)]):
        records = join_structure(amino, three_di)
        with atomic_path(out) as tmp, open(tmp, "w") as fh:
            fh.writelines(f">{rid}\n{seq}\n" for rid, seq in records)
    return len(records)
