"""Any byte of any dataset, any root attribute: an edited format-3 store is refused by every
consumer that reads what was edited (docs/store-format.md, "Row digests"): ``validate``,
the Python API's reader (``open_store``, ``records``, ``store[id]``, ``per_residue``),
``export``, ``embedpipe index`` and ``embed --reuse``'s checks of the rows it copies.

A consumer that does not read the edited bytes is not asked to refuse: an export of the
means reads no BOS vector, so an edited BOS byte (or the BOS part of ``row_digest``) is
exported against the BOS dataset instead, and ``--reuse`` looks rows up by sequence sha256
in its reuse index, never through ``id_index`` (validate, export and index check that)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedpipe
from embedpipe.core.errors import EmbedpipeError
from embedpipe.export.run import export_store
from embedpipe.neighbours.build import build_index
from embedpipe.store import EmbeddedRecord, StoreWriter
from embedpipe.store.row_checks import RowChecks
from embedpipe.store.validate import validate_report

N = 6
VECTORS = ["mean/layer_0", "mean/layer_3", "bos/layer_0", "bos/layer_3", "per_residue/layer_0", "per_residue/layer_3"]


def records() -> list[EmbeddedRecord]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(N):
        length = 2 + i
        rows = {k: rng.standard_normal((length, 4)).astype(np.float32) for k in (0, 3)}
        out.append(EmbeddedRecord(id=f"r{i}", sequence="MKTAYIAK"[:length], precision_used="fp32" if i % 2 else "bf16-mixed",
                                  fallback_reason="nonfinite" if i == 1 else "", max_abs_activation=float(i) + 0.5,
                                  mean={k: r.mean(axis=0) for k, r in rows.items()},
                                  bos={k: rng.standard_normal(4).astype(np.float32) for k in (0, 3)},
                                  per_residue=rows, windows=1))
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("coverage-property") / "clean.h5"
    recs = records()
    attrs = {"model_name": "synthetic", "model_sha256": "ab" * 32, "model_trained": False, "precision_policy": "bf16-mixed",
             "platform": "cpu avx2 (torch AVX2), torch 2.x", "config": {"layers": [0, 3]},
             "embed_identity": '{"identity_version": 3}'}
    with StoreWriter(path, ids=[r.id for r in recs], sequences=[r.sequence for r in recs],
                     residue_rows=[len(r.per_residue[0]) for r in recs], layers=[0, 3], dim=4, storage_dtype="float32",
                     attrs=attrs, pooling=["mean", "bos"]) as writer:
        for i, r in enumerate(recs):
            writer.write(i, r)
    assert validate_report(path) == ([], [])
    return path


def _datasets(path: Path) -> list[str]:
    out: list[str] = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.append(name) if isinstance(obj, h5py.Dataset) and obj.size else None)
    return sorted(out)


def _attributes(path: Path) -> list[str]:
    with h5py.File(path, "r") as f:
        return sorted(k for k in f.attrs if k != "complete")


def _flip_dataset(f: h5py.File, name: str, where: float, flip: int) -> str:
    """One byte of dataset ``name`` xor ``flip``; returns the vector dataset a consumer should read."""
    ds = f[name]
    values = ds[()]
    raw = values.view(np.uint8).reshape(-1)
    byte = int(where * raw.size)
    raw[byte] ^= flip
    ds[...] = values
    if name in VECTORS:
        return name
    if name == "per_residue/offsets":
        return "per_residue/layer_3"
    if name == "row_digest":  # the part the flipped character belongs to
        part = (byte % values.dtype.itemsize) // 32
        return (VECTORS + ["record"])[part] if part < len(VECTORS) else "mean/layer_3"
    return "mean/layer_3"


def _flip_attribute(f: h5py.File, name: str, where: float, flip: int) -> None:
    """One byte of root attribute ``name``'s value xor ``flip`` (text: one character's code)."""
    value = f.attrs[name]
    if isinstance(value, str):
        chars = list(value) or [" "]
        i = int(where * len(chars))
        chars[i] = chr((ord(chars[i]) ^ flip) % 0x80 or 1) if ord(chars[i]) < 0x80 else "x"
        if "".join(chars) == value:
            chars[i] = "#" if chars[i] != "#" else "%"
        f.attrs[name] = "".join(chars)
        return
    arr = np.array(value)
    if arr.dtype.kind in "OSU":
        items = [v.decode() if isinstance(v, bytes) else str(v) for v in arr.ravel().tolist()]
        i = int(where * len(items))
        items[i] = items[i] + chr(0x21 + flip % 90)
        f.attrs[name] = items
        return
    if arr.dtype == np.bool_:  # any other byte is true again
        f.attrs[name] = ~arr
        return
    raw = arr.reshape(-1).view(np.uint8)
    raw[int(where * raw.size)] ^= flip
    f.attrs[name] = arr


def _refused(call) -> bool:
    try:
        call()
    except (EmbedpipeError, KeyError):  # StoreError, UnknownIdError: one line, never wrong data
        return True
    return False


def _read_all(path: Path, dataset: str) -> None:
    """Everything the Python API returns: the table, every record, and ``dataset`` per record."""
    with embedpipe.open_store(path) as store:
        store.records(sequence=True)
        ids = list(store.ids)
        for rid in ids:
            store[rid]
            if dataset.startswith("per_residue/"):
                store.per_residue(rid, int(dataset.rsplit("_", 1)[1]))


def _reuse(path: Path) -> None:
    with embedpipe.open_store(path) as store:
        RowChecks(store, path).check(range(len(store)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), where=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255))
def test_every_consumer_refuses_an_edited_byte(clean, data, where, flip):
    datasets, attributes = _datasets(clean), _attributes(clean)
    target = data.draw(st.sampled_from([("dataset", d) for d in datasets] + [("attribute", a) for a in attributes]))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "edited.h5"
        shutil.copy(clean, path)
        with h5py.File(path, "r+") as f:
            if target[0] == "dataset":
                reads = _flip_dataset(f, target[1], where, flip)
            else:
                _flip_attribute(f, target[1], where, flip)
                reads = "mean/layer_3"
        vectors = "mean/layer_3" if reads == "record" else reads
        per_residue = vectors.startswith("per_residue/")
        layer = int(vectors.rsplit("_", 1)[1])
        pooling = "mean" if per_residue else vectors.split("/")[0]

        problems, _ = validate_report(path)
        assert problems and all("\n" not in p for p in problems), (target, "validate")
        assert _refused(lambda: _read_all(path, vectors)), (target, "open_store")
        assert _refused(lambda: export_store(path, fmt="npy", out=Path(tmp) / "x.npy", layer=layer,
                                             per_residue=per_residue, pooling=pooling, quiet=True)), (target, "export")
        assert not (Path(tmp) / "x.npy").exists()
        if not per_residue:
            assert _refused(lambda: build_index(path, Path(tmp) / "x.index", layer=layer, pooling=pooling)), (target, "index")
        if not target[1].startswith("id_index/"):
            assert _refused(lambda: _reuse(path)), (target, "reuse")


def test_the_property_reaches_every_dataset_and_attribute(clean):
    """What the draws above choose from: every dataset and root attribute the writer made."""
    datasets = set(_datasets(clean))
    assert set(VECTORS) | {"ids", "sequence/data", "sequence/offsets", "row_digest", "precision_used",
                           "per_residue/offsets", "id_index/keys", "id_index/rows", "id_index/fences"} <= datasets
    assert {"precision_policy", "platform", "model_trained", "model_sha256", "layers", "pooling", "storage_dtype",
            "embed_identity", "config", "attr_digests", "format_version"} <= set(_attributes(clean))
