"""Store writes on a thread of their own, so the next batch's forward does not wait on HDF5
(docs/architecture.md).

:class:`BackgroundWriter` calls ``write(*item)`` for each item ``put`` in a bounded queue, in
order, on one thread. A failure of ``write`` is re-raised in the caller's thread, the same
exception, at the next ``put`` or at the end; after it nothing more is written. The thread is
joined before the ``with`` block is left, whatever ends it (an exception in the caller,
Ctrl-C), so the caller can abort the store safely once the block is left.

Ctrl-C lands in the caller's thread wherever it is, also just after a lock was taken inside
``queue.Queue.put`` and before the ``with`` that releases it: the queue's lock stayed taken,
the writer waited in ``get`` forever and so did the caller, joining it (2 hangs in ~40
interrupted group jobs). So nothing here is a lock the two threads share: items and free slots
pass through two ``queue.SimpleQueue`` (each ``put``/``get`` one C call, complete or not done
at all), the end is queued without ever waiting, which wakes a writer waiting on an empty
queue, and after an interrupt the join is bounded (:data:`STOP_SECONDS`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

#: items waiting for the writer: enough to cover a slow write, few enough to bound memory
QUEUE_SIZE = 64
#: after an interrupt or a failure of the caller, how long the writer's current write may take
#: before the caller goes on without it (the store is aborted either way)
STOP_SECONDS = 20.0

_END = object()  # the last item of the queue


class BackgroundWriter:
    """``with BackgroundWriter(writer.write) as background: background.put(index, record)``.

    Items must not change after ``put``: they are written later, on another thread.
    """

    def __init__(self, write: Callable[..., Any], *, maxsize: int = QUEUE_SIZE,
                 name: str = "embedpipe-store-writer", stop_seconds: float = STOP_SECONDS) -> None:
        self._write = write
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._slots: queue.SimpleQueue[None] = queue.SimpleQueue()  # one token per free place
        for _ in range(maxsize):
            self._slots.put(None)
        self._failure: BaseException | None = None
        self._cancelled = False  # a plain flag: set without a lock, read by the writer per item
        self._stop_seconds = stop_seconds
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._reported = False

    # -- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if item is _END:
                return
            try:
                if self._failure is None and not self._cancelled:
                    # after a failure or a cancel, items are still taken (and dropped), so a put
                    # never waits on a writer that stopped writing
                    self._write(*item)
            except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
                self._failure = exc
            finally:
                del item
                self._slots.put(None)  # its place is free again

    # -- the caller's thread ------------------------------------------------------------------

    def put(self, *item: Any) -> None:
        """Queue ``write(*item)``; waits while the queue is full. Raises the writer's failure."""
        self._raise_failure()
        self._slots.get()  # an interrupt after this loses one place, never the writer
        self._items.put(item)

    def close(self) -> None:
        """Write everything queued, join the thread, then raise the writer's failure if any."""
        self._stop(cancel=False)
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None and not self._reported:
            self._reported = True
            raise self._failure

    def _stop(self, *, cancel: bool) -> None:
        """Queue the end and join the thread: after everything queued, or, with ``cancel``,
        after the current write only and at most :data:`STOP_SECONDS` (the thread is a daemon;
        the caller's store is aborted without its last write). A Ctrl-C while waiting cancels
        the remaining writes and waits again, within the same bound, then is re-raised."""
        interrupted: KeyboardInterrupt | None = None
        ended = False
        deadline: float | None = None
        while True:
            try:
                if cancel and deadline is None:
                    self._cancelled = True
                    deadline = time.monotonic() + self._stop_seconds
                if not ended:
                    self._items.put(_END)  # never waits: the queue of items is unbounded
                    ended = True
                while self._thread.is_alive() and (deadline is None or time.monotonic() < deadline):
                    self._thread.join(None if deadline is None else min(0.5, max(0.0, deadline - time.monotonic())))
                break
            except KeyboardInterrupt as exc:
                cancel, interrupted = True, exc
        if interrupted is not None:
            raise interrupted

    def __enter__(self) -> BackgroundWriter:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        self._stop(cancel=True)  # the caller failed: what is still queued is not written
        notes = []
        failure = self._failure
        if failure is not None and failure is not exc and not self._reported:
            notes.append(f"the store writer had failed too: {type(failure).__name__}: {failure}")
        if self._thread.is_alive():
            notes.append(f"the store writer was still in a write after {self._stop_seconds:g}s; left behind")
        for note in notes:
            if hasattr(exc, "add_note"):  # Python >= 3.11; on 3.10 the caller's error stands alone
                exc.add_note(note)
