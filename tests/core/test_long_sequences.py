"""The long-sequence modes are one registry (embedpipe/core/long_sequences.py): the CLI's
names, the store's ``long_handling`` values and the planner's cut all come from its entries
(issue 31, "one vocabulary")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from embedpipe.core import long_sequences, options
from embedpipe.core.errors import InputError
from embedpipe.extraction.planning import plan_record
from embedpipe.store import format as store_format

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "embedpipe"


def test_the_names_and_stored_values_are_the_documented_ones():
    assert options.LONG_SEQUENCE_MODES is long_sequences.NAMES
    assert store_format.LONG_HANDLING is long_sequences.HANDLING
    config = (ROOT / "configs" / "config.yaml").read_text(encoding="utf-8")
    documented = re.search(r"^long_sequences: \w+ +# > 1022 residues: (.*)$", config, re.M)
    assert documented and tuple(documented[1].split(", ")) == long_sequences.NAMES
    row = next(line for line in (ROOT / "docs" / "store-format.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("| `long_handling` |"))
    assert tuple(re.findall(r"`(\w+)`", row.split("|")[4])) == long_sequences.HANDLING


@pytest.mark.parametrize("length", [1, 999, 1000, 1001, 2500, 7777])
def test_each_mode_cuts_a_record_as_its_entry_says(length):
    window = 1000
    for mode in long_sequences.MODES:
        if length > window and mode.spans is None:
            with pytest.raises(InputError, match=r"^record 'P1' has \d+ residues, .*use --long-sequences "
                                                  r"chunk, truncate or full$"):
                plan_record(0, length, mode.name, window=window, record_id="P1")
            continue
        pieces, how = plan_record(0, length, mode.name, window=window, record_id="P1")
        assert how == (long_sequences.WITHIN_WINDOW if length <= window else mode.handling)
        kept = [r for p in sorted(pieces, key=lambda p: p.keep_start) for r in range(p.keep_start, p.keep_end)]
        if how == "truncated":
            assert kept == list(range(window))
        else:  # every residue stitched in exactly once, from a window that holds it
            assert kept == list(range(length))
        assert all(p.start <= p.keep_start < p.keep_end <= p.end for p in pieces)
        assert how == "full" or all(p.residues <= window for p in pieces)


def test_an_unknown_mode_is_one_line():
    with pytest.raises(InputError, match=r"^--long-sequences must be one of chunk, truncate, error, full, not 'x'$"):
        plan_record(0, 2000, "x", window=1000)


def test_a_new_mode_is_one_entry(monkeypatch):
    halves = long_sequences.LongSequenceMode("halves", "halved", lambda n, w, o: [(0, n // 2, 0, n // 2),
                                                                                   (n // 2, n, n // 2, n)])
    monkeypatch.setitem(long_sequences.BY_NAME, "halves", halves)
    pieces, how = plan_record(3, 1500, "halves", window=1000)
    assert how == "halved" and [(p.record, p.start, p.end) for p in pieces] == [(3, 0, 750), (3, 750, 1500)]


def test_no_other_module_spells_the_modes_or_the_stored_values():
    words = ({m.name for m in long_sequences.MODES} | set(long_sequences.HANDLING)) - {"none", "error", "full"}
    for module in sorted(PACKAGE.rglob("*.py")):
        if module.name == "long_sequences.py":
            continue
        code = "\n".join(line.split("#", 1)[0] for line in module.read_text(encoding="utf-8").splitlines())
        for word in words:
            assert f'"{word}"' not in code, (module.relative_to(ROOT), word)
