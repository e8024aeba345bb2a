"""A storage dtype's own limits, not a float's (issue 21: the engine's overflow check and the
mean check assumed ``np.finfo``, which raises for an integer storage dtype)."""

from __future__ import annotations

import numpy as np
import pytest

from embedpipe.core.errors import StoreError
from embedpipe.extraction.fallback import RecordCheck
from embedpipe.extraction.stitching import PieceResult
from embedpipe.runtime.precision import FP32
from embedpipe.store.meancheck import mean_tolerance
from embedpipe.store.storage_dtype import storage_limits


def test_float_limits_are_the_float_s_own() -> None:
    for name, largest, eps, tiny in (("float16", 65504.0, 2.0**-10, 2.0**-24), ("float32", 3.4028234663852886e38,
                                                                                   2.0**-23, 2.0**-149)):
        limits = storage_limits(name)
        assert (limits.max_abs, limits.relative_rounding, limits.absolute_rounding) == (largest, eps / 2, tiny / 2)


def test_signed_integer_limits_come_from_the_integer_type() -> None:
    assert (storage_limits("int8").max_abs, storage_limits(np.int16).max_abs) == (127.0, 32767.0)
    assert (storage_limits("int8").relative_rounding, storage_limits("int8").absolute_rounding) == (0.0, 0.5)


@pytest.mark.parametrize("dtype", ["uint8", "bool", "U4"])
def test_a_dtype_that_cannot_hold_embeddings_is_one_line(dtype: str) -> None:
    with pytest.raises(StoreError, match=f"storage dtype {np.dtype(dtype)} "):
        storage_limits(dtype)


def test_the_mean_tolerance_of_an_integer_store_covers_its_rounding() -> None:
    """Rows 1, 2, 2 (int16) of a record whose fp32 rows were 0.6, 2.4, 1.5: the stored mean
    round(1.5) = 2 differs from the mean of the stored rows (5/3) by 1/3, within half a unit per
    cast (twice, doubled: 2); an edited mean (4) is caught."""
    rows = np.array([3.0])
    abs_mean = np.array([[5.0 / 3.0]])
    honest = mean_tolerance(np.array([[2.0]]), abs_mean, rows, np.dtype(np.int16))
    assert np.isfinite(honest).all() and abs(2.0 - 5.0 / 3.0) <= honest[0, 0] < abs(4.0 - 5.0 / 3.0)


def test_the_float_mean_tolerance_is_unchanged() -> None:
    """The formula documented in store/meancheck.py, written out with np.finfo for float16."""
    stored, abs_mean, rows = np.array([[0.5, -3.0]]), np.array([[0.7, 3.0]]), np.array([40.0])
    u16, u32 = float(np.finfo(np.float16).eps) / 2, float(np.finfo(np.float32).eps) / 2
    want = 2.0 * (u16 * (np.abs(stored) + abs_mean) + rows[:, None] * u32 * abs_mean) \
        + 2.0 * float(np.finfo(np.float16).smallest_subnormal)
    np.testing.assert_array_equal(mean_tolerance(stored, abs_mean, rows, np.dtype(np.float16)), want)


def _piece(stored_max: float) -> PieceResult:
    return PieceResult(sums={0: np.zeros(2, np.float32)}, residues=None, max_abs=stored_max, stored_max=stored_max)


def test_the_record_check_overflows_at_the_storage_dtype_s_own_limit() -> None:
    check = RecordCheck.for_storage("int8", overflow_margin=None)
    assert check.storage_max == 127.0
    assert (check.reason(FP32, _piece(127.0)), check.reason(FP32, _piece(128.0))) == ("", "overflow")
    half = RecordCheck.for_storage("float16", overflow_margin=None)
    assert (half.reason(FP32, _piece(65504.0)), half.reason(FP32, _piece(65600.0))) == ("", "overflow")
