"""Structure-aware sequences (SaProt's input) from an amino-acid FASTA and a 3Di FASTA paired
by ID, the two files Foldseek's ``convert2fasta`` writes for a structure database and its
``_ss`` 3Di database.

Each residue becomes its amino acid (upper case) followed by its 3Di state (lower case); an
``X`` 3Di state (Foldseek's unknown) becomes ``#``, SaProt's masked structure. The IDs must
match one to one and each pair of records must have as many amino acids as 3Di states:
anything else is one line naming the ID and both files, and nothing is written.
"""

from __future__ import annotations

from pathlib import Path

from embedpipe.core.atomic import atomic_path
from embedpipe.core.errors import InputError
from embedpipe.inputs.fasta import read_sequences

#: Foldseek's 20 3Di states (upper case as convert2fasta writes them, as FASTA reading makes them)
THREE_DI = frozenset("ACDEFGHIKLMNPQRSTVWY")


def _pair(rid: str, amino: str, states: str, where: str) -> str:
    """One record's structure-aware sequence; one line for a length or state that does not fit."""
    if len(amino) != len(states):
        raise InputError(f"record '{rid}': {len(amino)} amino acids but {len(states)} 3Di states ({where})")
    bad = next((i for i, s in enumerate(states) if s not in THREE_DI and s != "X"), -1)
    if bad >= 0:
        raise InputError(f"record '{rid}': '{states[bad]}' at residue {bad + 1} is not a 3Di state ({where})")
    return "".join(a + ("#" if s == "X" else s.lower()) for a, s in zip(amino, states))


def join_structure(amino: Path, three_di: Path) -> list[tuple[str, str]]:
    """(ID, structure-aware sequence) for every record of ``amino``, in its order."""
    where = f"{amino} and {three_di}"
    states = dict(read_sequences(three_di))
    joined = []
    for rid, seq in read_sequences(amino):
        if rid not in states:
            raise InputError(f"record '{rid}' of {amino} has no 3Di record in {three_di}")
        joined.append((rid, _pair(rid, seq, states.pop(rid), where)))
    if states:
        raise InputError(f"record '{next(iter(states))}' of {three_di} has no amino-acid record in {amino}")
    return joined


def write_structure_aware(amino: Path, three_di: Path, out: Path) -> int:
    """Write ``out`` (atomically) as a FASTA of structure-aware sequences; the records written."""
    records = join_structure(amino, three_di)
    with atomic_path(out) as tmp, open(tmp, "w") as fh:
        fh.writelines(f">{rid}\n{seq}\n" for rid, seq in records)
    return len(records)
