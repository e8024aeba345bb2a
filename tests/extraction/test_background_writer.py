"""The store writer thread (embedpipe.extraction.writer_thread, used by `embedpipe embed`).

Every record reaches the writer, in order; a writer failure reaches the caller as the same
exception and leaves no store; the thread is joined whatever ends the block. No timing: the
tests only check what was written and that the thread is gone.
"""

from __future__ import annotations

import sys
import threading

import h5py
import numpy as np
import pytest
import torch

from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.run import embed_fasta
from embedpipe.extraction.writer_thread import BackgroundWriter
from embedpipe.model import load_model
from embedpipe.store import StoreWriter
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.engine import embedder_for


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "embedpipe-store-writer"]


class Failing:
    """A writer that raises on its ``fail_at``-th call (1-based) and records the calls before."""

    def __init__(self, fail_at: int, exc: BaseException) -> None:
        self.fail_at, self.exc, self.written = fail_at, exc, []

    def __call__(self, index: int, value: object) -> None:
        if len(self.written) + 1 == self.fail_at:
            raise self.exc
        self.written.append((index, value))


def test_every_item_is_written_in_order_through_a_small_queue():
    written: list[tuple[int, str]] = []
    with BackgroundWriter(lambda i, v: written.append((i, v)), maxsize=2) as background:
        for i in range(500):
            background.put(i, f"record {i}")
    assert written == [(i, f"record {i}") for i in range(500)]
    assert not _writer_threads()


def test_a_writer_failure_is_raised_in_the_caller_as_the_same_exception_and_stops_writing():
    failing = Failing(3, ValueError("disk on fire at record 3"))
    with pytest.raises(ValueError, match="disk on fire at record 3") as info:
        with BackgroundWriter(failing, maxsize=4) as background:
            for i in range(200):
                background.put(i, i)
    assert info.value is failing.exc
    assert failing.written == [(0, 0), (1, 1)]  # nothing after the failure
    assert not _writer_threads()


def test_a_failure_on_the_last_item_is_raised_at_the_end():
    failing = Failing(3, OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        with BackgroundWriter(failing) as background:
            for i in range(3):
                background.put(i, i)
    assert len(failing.written) == 2 and not _writer_threads()


@pytest.mark.parametrize("exc", [RuntimeError("forward failed"), KeyboardInterrupt()])
def test_a_failure_in_the_caller_joins_the_thread_and_propagates(exc):
    written: list[int] = []
    with pytest.raises(type(exc)):
        with BackgroundWriter(lambda i, v: written.append(i)) as background:
            for i in range(10):
                background.put(i, i)
            raise exc
    assert not _writer_threads()
    assert written == list(range(len(written)))  # a prefix, in order: the rest was dropped


def test_a_caller_failure_notes_an_earlier_writer_failure():
    failing = Failing(1, ValueError("bad record"))
    tried = threading.Event()

    def write(index: int, value: object) -> None:
        try:
            failing(index, value)
        finally:
            tried.set()

    with pytest.raises(RuntimeError, match="forward failed") as info:
        with BackgroundWriter(write) as background:
            background.put(0, 0)
            tried.wait()  # the writer has taken (and failed on) the item
            raise RuntimeError("forward failed")
    assert info.value.__notes__ == ["the store writer had failed too: ValueError: bad record"]
    assert not _writer_threads()


# ------------------------------------------------------------------ Ctrl-C at any point of a put

#: against a hang only: a block that deadlocked never ends (no duration is measured)
HANG_SECONDS = 30


class InterruptAfterCall:
    """A profile function that raises KeyboardInterrupt once, as the ``at``-th C call made in
    its thread returns: where CPython runs a signal handler, also between a lock's ``acquire``
    and the ``with`` that would release it (inside ``queue.Queue.put``)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls, self.fired = at, 0, False

    def __call__(self, frame: object, event: str, arg: object) -> None:
        if event == "c_return" and not self.fired:
            self.calls += 1
            if self.calls == self.at:
                self.fired = True
                raise KeyboardInterrupt


def _interrupted_producer(at: int, during: str) -> tuple[bool, str, list[int], bool]:
    """A producer (in a thread of its own, so that a deadlock cannot hang the test) whose writer
    has written item 0 and waits on an empty queue; Ctrl-C lands after its ``at``-th C call of
    ``put(1, 1)`` (``during="put"``) or of leaving the block (``"close"``). Returns whether the
    block ended, how, what was written, and whether the interrupt was raised at all."""
    written: list[int] = []
    idle = threading.Event()
    hook = InterruptAfterCall(at)
    ending: list[str] = []

    def write(index: int, value: object) -> None:
        written.append(index)
        idle.set()

    def producer() -> None:
        try:
            try:
                with BackgroundWriter(write, maxsize=2) as background:
                    background.put(0, 0)
                    idle.wait()  # written: the writer is back waiting on an empty queue
                    sys.setprofile(hook)
                    if during == "put":
                        background.put(1, 1)
                        sys.setprofile(None)
            finally:
                sys.setprofile(None)
            ending.append("ended")
        except KeyboardInterrupt:
            ending.append("KeyboardInterrupt")
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            ending.append(repr(exc))

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    thread.join(HANG_SECONDS)
    return not thread.is_alive(), "".join(ending), written, hook.fired


@pytest.mark.parametrize("during", ["put", "close"])
def test_ctrl_c_at_any_point_of_a_put_or_the_close_never_hangs(during: str) -> None:
    """Ctrl-C right after any C call of the producer's put (or of the block's end) while the
    writer waits on an empty queue: the block always ends, with KeyboardInterrupt, the writer
    thread joined, and what was written is a prefix. Before, Ctrl-C just after ``Queue.put``
    took the queue's lock left it taken: the producer waited on it forever (2 in ~40 group
    jobs)."""
    at = 0
    while True:
        at += 1
        ended, how, written, fired = _interrupted_producer(at, during)
        assert ended, f"Ctrl-C after C call {at} of {during}: the block never ended"
        if not fired:  # the put (or close) has fewer C calls: every point was tried
            assert how == "ended" and written in ([0, 1], [0])
            break
        assert how == "KeyboardInterrupt", f"Ctrl-C after C call {at} of {during}: {how}"
        assert written in ([0], [0, 1]), (at, written)
    assert at > 1 and not _writer_threads()


def test_a_write_that_does_not_end_is_left_behind_after_the_bound() -> None:
    """The caller failed while the writer is stuck in a write (a hung file system): the block
    ends after ``stop_seconds`` with a note, instead of waiting for ever."""
    release, started = threading.Event(), threading.Event()

    def stuck(index: int, value: object) -> None:
        started.set()
        release.wait()

    try:
        with pytest.raises(KeyboardInterrupt) as info:
            with BackgroundWriter(stuck, stop_seconds=0.2) as background:
                background.put(0, 0)
                background.put(1, 1)
                started.wait()
                raise KeyboardInterrupt
        assert info.value.__notes__ == ["the store writer was still in a write after 0.2s; left behind"]
    finally:
        release.set()
    for thread in _writer_threads():
        thread.join(HANG_SECONDS)
    assert not _writer_threads()


# ------------------------------------------------------------------------------ with a real store


def _datasets(path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and not name.startswith("id_index"):
                out[name] = obj[()]
        f.visititems(visit)
    return out


def test_a_store_written_through_the_thread_equals_one_written_directly(tmp_path, tiny_model_path):
    loaded = load_model(str(tiny_model_path))
    records = random_sequences(40, (5, 80), seed=31)
    options = EmbedOptions(per_residue=True, layers=(0, -1), pooling=("mean", "bos"), tokens_per_batch=200)
    embedder = embedder_for(loaded, options, torch.device("cpu"))
    plan = embedder.plan(records)
    results = list(embedder.embed(records, plan))

    def store(path, through_thread: bool):
        with StoreWriter(path, ids=[r for r, _ in records], sequences=[s for _, s in records],
                         residue_rows=plan.rows, layers=embedder.layers, dim=loaded.embed_dim,
                         storage_dtype="float32", attrs={"model_name": "x"}, pooling=embedder.pooling) as writer:
            if through_thread:
                with BackgroundWriter(writer.write, maxsize=3) as background:
                    for index, record in results:
                        background.put(index, record)
            else:
                for index, record in results:
                    writer.write(index, record)

    store(tmp_path / "direct.h5", False)
    store(tmp_path / "thread.h5", True)
    direct, thread = _datasets(tmp_path / "direct.h5"), _datasets(tmp_path / "thread.h5")
    assert sorted(direct) == sorted(thread) and "per_residue/layer_2" in direct and "bos/layer_0" in direct
    for name in direct:
        np.testing.assert_array_equal(direct[name], thread[name], err_msg=name)


def test_a_failing_store_write_during_embed_leaves_no_store(tmp_path, tiny_model_path, monkeypatch):
    records = random_sequences(12, (10, 40), seed=32)
    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "store.h5"
    real = StoreWriter.write
    calls = []

    def third_fails(self, index, record):
        calls.append(index)
        if len(calls) == 3:
            raise OSError(28, f"No space left on device (injected at {record.id})")
        real(self, index, record)

    monkeypatch.setattr(StoreWriter, "write", third_fails)
    with pytest.raises(OSError, match=r"No space left on device \(injected at rec\d+\)"):
        embed_fasta(fasta, model=str(tiny_model_path), out=out, options=EmbedOptions(tokens_per_batch=60), quiet=True)
    assert len(calls) == 3  # nothing written after the failure
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.fasta"]  # no temp file left
    assert not _writer_threads()


def test_a_failing_forward_during_embed_joins_the_writer_and_leaves_no_store(tmp_path, tiny_model_path, monkeypatch):
    records = random_sequences(12, (10, 40), seed=33)
    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "store.h5"
    real = Engine.embed
    yielded = []

    def interrupted(self, records, plan=None, *, quiet=True):  # Ctrl-C after 5 records were handed over
        for item in real(self, records, plan, quiet=quiet):
            if len(yielded) == 5:
                raise KeyboardInterrupt
            yielded.append(item[0])
            yield item

    monkeypatch.setattr(Engine, "embed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        embed_fasta(fasta, model=str(tiny_model_path), out=out, options=EmbedOptions(tokens_per_batch=60), quiet=True)
    assert len(yielded) == 5
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.fasta"]
    assert not _writer_threads()
