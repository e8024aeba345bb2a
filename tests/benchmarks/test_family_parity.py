"""benchmarks/family_parity.py: embedpipe's fp32 forward of every family equals the family's
reference implementation (fair-esm, transformers' EsmModel, T5EncoderModel, EsmcModel) to 1e-5
relative L2 at the first, middle and last layer, on test models of the real proportions
(the table's fp32 rows, docs/models.md "Parity with the reference implementations")."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import family_parity  # noqa: E402


@pytest.mark.peer
@pytest.mark.parametrize("family", family_parity.FAMILIES)
def test_fp32_rows_are_within_1e_5_relative_of_the_reference(family: str, tmp_path: Path) -> None:
    rows = family_parity.measure(family, ["fp32"], tmp_path)
    assert [r["layer"] for r in rows] == [1, 2, 4]  # first block, middle, last (4 layers)
    for row in rows:
        assert row["rel_l2"] <= 1e-5 and row["min_cos"] > 0.99999, row


def test_the_measures_are_what_they_say() -> None:
    """rel L2, p99.9 |err| and min cosine against a hand-built pair of residue rows."""
    want = np.array([[3.0, 4.0], [1.0, 0.0]])
    got = np.array([[3.0, 4.0], [0.0, 1.0]])  # the second row turned by 90 degrees
    out = family_parity.compare(got, want)
    assert out["rel_l2"] == pytest.approx(np.sqrt(2) / np.sqrt(26))
    assert out["min_cos"] == pytest.approx(0.0)
    assert out["p999_abs"] == pytest.approx(1.0)
