"""An index's three files are bound together and read within bounds (embedpipe/neighbours/index_file.py,
faiss_file.py): ``INDEX.json`` records the FAISS and IDs files' sizes and sha256 and a digest over its
own fields; a damaged, replaced or edited file is refused in one line naming it, before a model loads
or a query is embedded; a FAISS file claiming more rows than it holds never reaches FAISS; FAISS's
label -1 is no hit; an ID with a tab or line break is refused when the index is built."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
from pathlib import Path

import faiss
import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import embedpipe
from embedpipe.api import querying
from embedpipe.core.errors import EmbedpipeError
from embedpipe.neighbours.build import build_index
from embedpipe.neighbours.hits import search_index
from embedpipe.neighbours.index_file import MAX_META_BYTES, ids_path, meta_path, open_index
from embedpipe.store import EmbeddedRecord
from helpers.embed_helpers import write_fasta
from helpers.processes import run_cli
from helpers.stores import ATTRS, write_store

LAYER, ROWS, DIM = 3, 30, 8


def synthetic_store(path: Path, ids: list[str] | None = None, seed: int = 0) -> Path:
    vectors = np.random.default_rng(seed).standard_normal((ROWS, DIM)).astype(np.float32)
    ids = ids or [f"r{i:04d}" for i in range(ROWS)]
    records = [EmbeddedRecord(id=rid, sequence="A", precision_used="fp32", mean={LAYER: v},
                              max_abs_activation=1.0, embedded_length=1) for rid, v in zip(ids, vectors)]
    return write_store(path, records, None, attrs=ATTRS | {"embed_identity": "{}", "model_source": "synthetic"})


@pytest.fixture(scope="module", params=["exact", "hnsw"])
def built(request, tmp_path_factory) -> Path:
    """A directory holding a store and its index ``idx`` of each kind (copied before any damage)."""
    tmp = tmp_path_factory.mktemp(f"built-{request.param}")
    build_index(synthetic_store(tmp / "s.h5"), tmp / "idx", kind=request.param)
    return tmp


def copied(built: Path, into: Path) -> Path:
    for name in ("s.h5", "idx", "idx.json", "idx.ids.txt"):
        shutil.copy2(built / name, into / name)
    return into / "idx"


def rebind(index: Path, **fields: object) -> None:
    """Edit INDEX.json and record the files' sizes and sha256 and the digest anew, computed here
    (hashlib over the files and over the canonical JSON of the other fields), as a forger would."""
    path = meta_path(index)
    data = json.loads(path.read_text()) | fields
    data |= {"faiss_bytes": index.stat().st_size, "faiss_sha256": hashlib.sha256(index.read_bytes()).hexdigest(),
             "ids_bytes": ids_path(index).stat().st_size,
             "ids_sha256": hashlib.sha256(ids_path(index).read_bytes()).hexdigest()}
    data.pop("describes_sha256")
    data["describes_sha256"] = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    path.write_text(json.dumps(data))


def refused(index: Path, names: Path) -> str:
    with pytest.raises(EmbedpipeError) as caught:
        open_index(index)
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"{names}:"), line
    return line


def test_index_json_binds_the_files_and_its_own_fields(built, tmp_path) -> None:
    index = copied(built, tmp_path)
    data = json.loads(meta_path(index).read_text())
    assert data["faiss_bytes"] == len(index.read_bytes())
    assert data["faiss_sha256"] == hashlib.sha256(index.read_bytes()).hexdigest()
    assert data["ids_bytes"] == len(ids_path(index).read_bytes())
    assert data["ids_sha256"] == hashlib.sha256(ids_path(index).read_bytes()).hexdigest()
    others = {k: v for k, v in data.items() if k != "describes_sha256"}
    assert data["describes_sha256"] == hashlib.sha256(json.dumps(others, sort_keys=True).encode()).hexdigest()
    loaded = open_index(index)
    assert loaded.index.ntotal == ROWS and loaded.ids == [f"r{i:04d}" for i in range(ROWS)]


DAMAGES = ("truncate", "zero", "random", "append")


def damage(raw: bytes, how: str, start: float, length: int, seed: int) -> bytes:
    at = min(int(start * len(raw)), len(raw) - 1)
    if how == "truncate":
        return raw[:at]
    if how == "append":
        return raw + bytes(np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8))
    end = min(len(raw), at + length)
    patch = bytes(end - at) if how == "zero" else bytes(np.random.default_rng(seed).integers(0, 256, end - at,
                                                                                              dtype=np.uint8))
    return raw[:at] + patch + raw[end:]


@pytest.mark.parametrize("which", ["faiss", "json", "ids"])
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(how=st.sampled_from(DAMAGES), start=st.floats(0, 1), length=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_any_damage_to_any_file_is_refused_in_one_line_naming_it(built, which, how, start, length, seed) -> None:
    with tempfile.TemporaryDirectory() as work:
        index = copied(built, Path(work))
        path = {"faiss": index, "json": meta_path(index), "ids": ids_path(index)}[which]
        raw = path.read_bytes()
        changed = damage(raw, how, start, length, seed)
        assume(changed != raw and (which != "json" or changed.strip() != raw.strip()))
        path.write_bytes(changed)
        line = refused(index, path)
        assert line.startswith(f"{path}: ") and len(line) > len(f"{path}: "), line  # the file named, and why


OTHER_KIND = {"exact": "hnsw", "hnsw": "exact"}


@pytest.mark.parametrize("edit,words", [
    (lambda d: {"options": None}, "the field 'options' is null, not dict"),
    (lambda d: {"rows": str(d["rows"])}, "the field 'rows' is str, not int"),
    (lambda d: {"layer": True}, "the field 'layer' is bool, not int"),
    (lambda d: {"kind": OTHER_KIND[d["kind"]]}, "were edited"),
    (lambda d: {"pooling": "bos"}, "were edited"),
    (lambda d: {"layer": d["layer"] - 1}, "were edited"),
    (lambda d: {"kind": "ivf"}, "'kind' holds a value embedpipe does not write"),
], ids=["options-null", "rows-str", "layer-bool", "kind", "pooling", "layer", "kind-unknown"])
def test_an_edited_or_mistyped_description_is_refused(built, tmp_path, edit, words) -> None:
    index = copied(built, tmp_path)
    data = json.loads(meta_path(index).read_text())
    meta_path(index).write_text(json.dumps(data | edit(data)))
    assert words in refused(index, meta_path(index))


def test_an_edited_kind_is_refused_by_the_faiss_file_even_when_the_digest_is_forged(built, tmp_path) -> None:
    index = copied(built, tmp_path)
    kind = json.loads(meta_path(index).read_text())["kind"]
    rebind(index, kind=OTHER_KIND[kind])
    assert f"({kind})" in refused(index, index)


def test_invalid_json_and_an_index_of_the_old_format_are_refused(built, tmp_path) -> None:
    index = copied(built, tmp_path)
    meta_path(index).write_text('{"format": "embedpipe-index", "version": 1, ')
    assert "not valid JSON" in refused(index, meta_path(index))
    old = {k: v for k, v in json.loads((built / "idx.json").read_text()).items()
           if k not in ("faiss_bytes", "faiss_sha256", "ids_bytes", "ids_sha256", "describes_sha256")}
    meta_path(index).write_text(json.dumps(old | {"version": 1}))  # what embedpipe wrote before these fields
    assert "index version 1" in (line := refused(index, meta_path(index))) and "rebuild it" in line


def test_an_oversized_description_is_refused_before_it_is_read(built, tmp_path) -> None:
    index = copied(built, tmp_path)
    with open(meta_path(index), "r+b") as fh:
        fh.truncate(1 << 30)  # 1 GiB (sparse): read whole, it would take GBs of memory
    line = refused(index, meta_path(index))
    assert f"{1 << 30} bytes, more than the {MAX_META_BYTES}" in line


def _claiming(index: Path, rows: int) -> None:
    """Rewrite the FAISS file's header(s) to claim ``rows`` rows (the arrays left as they are)."""
    raw = bytearray(index.read_bytes())
    for at in (i for i in range(len(raw) - 4) if raw[i:i + 4] in (b"IxFI", b"IHNf")):
        struct.pack_into("<q", raw, at + 8, rows)
    index.write_bytes(bytes(raw))


@pytest.mark.parametrize("rows", [2**31, ROWS + 1])
def test_a_faiss_file_claiming_more_rows_than_it_holds_never_reaches_faiss(built, tmp_path, monkeypatch, rows) -> None:
    index = copied(built, tmp_path)
    _claiming(index, rows)
    rebind(index, rows=rows)  # the description forged to agree

    def never(*args, **kwargs):
        raise AssertionError("faiss.read_index reached")
    monkeypatch.setattr(faiss, "read_index", never)
    line = refused(index, index)
    assert "not a FAISS index embedpipe wrote" in line


def test_a_damaged_index_is_refused_before_the_model_loads(built, tmp_path, monkeypatch) -> None:
    index = copied(built, tmp_path)
    index.write_bytes(index.read_bytes()[:-7])

    class NoModel:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the model was loaded")
    monkeypatch.setattr(querying, "Embedder", NoModel)
    with pytest.raises(EmbedpipeError, match=f"^{index}: "):
        embedpipe.search([("q", "MKV")], index, device="cpu")
    proc = run_cli("search", str(write_fasta(tmp_path / "q.fasta", [("q", "MKV")])), "--index", str(index),
                   "--out", str(tmp_path / "hits.tsv"), "--model", str(tmp_path / "no-such-model"))
    assert proc.returncode != 0 and not (tmp_path / "hits.tsv").exists()
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and f"{index}: " in proc.stderr, proc.stderr


class _Fewer:
    """A FAISS index that finds only ``found`` of the ``k`` asked (as HNSW may): label -1 past them."""

    def __init__(self, real, found: int) -> None:
        self.real, self.found = real, found
        self.hnsw = getattr(real, "hnsw", None)  # HNSW's search breadth, set by search_index

    def search(self, x, k):
        scores, labels = self.real.search(x, k)
        scores[:, self.found:], labels[:, self.found:] = -3.4028235e38, -1
        return scores, labels


def test_a_minus_one_label_is_no_hit(built, tmp_path) -> None:
    loaded = open_index(copied(built, tmp_path))
    queries = np.random.default_rng(5).standard_normal((3, DIM)).astype(np.float32)
    full = search_index(loaded, ["a", "b", "c"], queries, 5)
    loaded.index = _Fewer(loaded.index, 2)
    fewer = search_index(loaded, ["a", "b", "c"], queries, 5)
    assert fewer.hits == tuple(row[:2] for row in full.hits)
    tsv = fewer.to_tsv().splitlines()
    assert len(tsv) == 1 + 3 * 2 and not any("e+38" in line or "ids[" in line for line in tsv)
    np.testing.assert_array_equal(fewer.scores[:, :2], full.scores[:, :2])


@pytest.mark.parametrize("bad", ["with\ttab", "with\nline", "with\rline"])
def test_an_id_with_a_tab_or_line_break_is_refused_when_indexed(tmp_path, bad) -> None:
    """Such an ID is planted in the store's ids dataset (embedpipe's own writer refuses it)."""
    ids = [f"r{i:04d}" for i in range(ROWS - 1)] + ["with_" + bad[5:]]
    store = synthetic_store(tmp_path / "s.h5", ids=ids)
    with h5py.File(store, "r+") as f:
        row = [bytes(x) for x in f["ids"][:]].index(ids[-1].encode())
        f["ids"][row] = bad.encode()
    with pytest.raises(EmbedpipeError) as caught:
        build_index(store, tmp_path / "idx")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"{store}: ") and repr(bad) in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.h5"]
