"""``embedpipe info`` in memory independent of the record count, as ``validate`` and ``merge``:
its per-record columns read block by block (before, every string of ``precision_used``,
``fallback_reason`` and ``long_handling`` was a Python string at once, ~135 bytes a record,
and ``max_abs_activation`` a list of Python floats).

Independent computation: the same columns read whole with h5py and counted with
``collections.Counter``, summed and summarised with numpy (``np.median`` of the finite values)."""

from __future__ import annotations

import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

from embedpipe.store.info import OTHER_VALUES, render_info, store_info

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from store_scale import _strings, write_shard  # noqa: E402 - synthetic format-1 shard stores, written fast

#: every block size made small, so that both sizes below are many blocks long
SMALL_BLOCKS = {"embedpipe.store.format.READ_BLOCK_BYTES": 64 << 10, "embedpipe.store.info.STRING_ROWS": 8192,
                "embedpipe.core.stats.SELECT_VALUES": 4096, "store_scale.CHUNK_BYTES": 256 << 10}
REASONS = [b"", b"", b"", b"nonfinite", b"overflow:float16"]


def _store(path: Path, n: int) -> Path:
    """A shard store of ``n`` records whose string columns hold a few values and whose
    ``max_abs_activation`` holds random values, some of them not finite."""
    rng = np.random.default_rng(n)
    write_shard(path, 0, n, rng, long_record=False)
    with h5py.File(path, "r+") as f:
        del f["long_handling"]
        _strings(f, "long_handling", [b"chunked" if k == 0 else b"none" for k in rng.integers(0, 50, n)])
        f["max_abs_activation"][:] = np.where(rng.random(n) < 0.01, np.nan,
                                              rng.lognormal(3, 2, n)).astype(np.float32)
        reasons = [REASONS[k] for k in rng.integers(0, len(REASONS), n)]
        del f["fallback_reason"]
        _strings(f, "fallback_reason", reasons)
        f["precision_used"][:] = np.array([b"fp32" if r else b"fp16" for r in reasons], dtype=f["precision_used"].dtype)
        f["windows"][:] = rng.integers(1, 4, n)
    return path


def _expected(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        reasons = Counter(f["fallback_reason"].asstr()[()].tolist())
        act = f["max_abs_activation"][()].astype(np.float64)
        finite = act[np.isfinite(act)]
        return {
            "residues": int(f["length"][()].sum()), "embedded": int(f["embedded_length"][()].sum()),
            "used": dict(Counter(f["precision_used"].asstr()[()].tolist())),
            "long": dict(Counter(f["long_handling"].asstr()[()].tolist())),
            "by_reason": {r: k for r, k in reasons.items() if r},
            "act": {"count": finite.size, "nonfinite": act.size - finite.size, "min": float(finite.min()),
                    "median": float(np.median(finite)), "max": float(finite.max())},
            "windows": int(f["windows"][()].max()),
        }


def _check(info: dict, want: dict, n: int) -> None:
    assert info["counts"]["records"] == n
    assert (info["counts"]["residues"], info["counts"]["embedded_residues"]) == (want["residues"], want["embedded"])
    assert info["precision_used"] == want["used"] and info["long_handling"] == want["long"]
    assert info["fallback"]["by_reason"] == want["by_reason"]
    assert info["fallback"]["count"] == sum(want["by_reason"].values())
    assert info["max_abs_activation"] == want["act"]
    assert info["windows"] == {"max": want["windows"]}


def _peak(path: Path) -> tuple[int, dict]:
    tracemalloc.start()
    try:
        info = store_info(path)
        return tracemalloc.get_traced_memory()[1], info
    finally:
        tracemalloc.stop()


def test_info_peak_does_not_grow_with_the_records_and_its_figures_are_right(tmp_path, monkeypatch) -> None:
    """40,000 and 200,000 records: info's traced peak grows by less than 1.25x (5x the records;
    before, ~5x: the string columns as Python strings, the activations as Python floats)."""
    for target, value in SMALL_BLOCKS.items():
        monkeypatch.setattr(target, value)
    peaks = {}
    for n in (40_000, 200_000):
        path = _store(tmp_path / f"s{n}.h5", n)
        peaks[n], info = _peak(path)
        _check(info, _expected(path), n)
    assert peaks[200_000] < 1.25 * peaks[40_000], peaks


@pytest.mark.parametrize("n", [1, 2, 7, 4096 * 3 + 1])
def test_the_median_is_numpys_at_every_parity_and_block_layout(tmp_path, monkeypatch, n) -> None:
    for target, value in SMALL_BLOCKS.items():
        monkeypatch.setattr(target, value)
    monkeypatch.setattr("embedpipe.core.stats.SELECT_VALUES", 2)  # narrowed to the last bits
    path = _store(tmp_path / "s.h5", n)
    with h5py.File(path, "r+") as f:  # ties and a negative zero among the values
        values = f["max_abs_activation"][()]
        values[: n // 2] = values[n // 2] if n > 1 else 0.0
        f["max_abs_activation"][:] = values
    want, info = _expected(path), store_info(path)
    _check(info, want, n)
    assert info["max_abs_activation"]["median"] == want["act"]["median"]  # numpy's median, streamed in blocks


def test_a_column_with_more_distinct_values_than_counted_one_by_one(tmp_path, monkeypatch) -> None:
    """A crafted store with a value per record: the first MAX_DISTINCT values counted one by
    one, every further row under OTHER_VALUES, so nothing is dropped and the counts still add up."""
    monkeypatch.setattr("embedpipe.store.info.MAX_DISTINCT", 3)
    path = tmp_path / "s.h5"
    write_shard(path, 0, 10, np.random.default_rng(0), long_record=False)
    with h5py.File(path, "r+") as f:
        f["fallback_reason"][:] = np.array([b"", b"a", b"a", b"b", b"c", b"d", b"e", b"e", b"", b"f"],
                                           dtype=f["fallback_reason"].dtype)
    info = store_info(path)
    assert info["fallback"]["by_reason"] == {"a": 2, "b": 1, OTHER_VALUES: 5}
    assert info["fallback"]["count"] == 8
    assert f"fallback    8 (80.00%): {OTHER_VALUES} 5, a 2, b 1" in render_info(info)
