"""Store writes on a thread of their own, so the next batch's forward does not wait on HDF5
(docs/architecture.md).

:class:`BackgroundWriter` calls ``write(*item)`` for each item ``put`` in a bounded queue, in
order, on one thread. A failure of ``write`` is re-raised in the caller's thread, the same
exception, at the next ``put`` or at the end; after it nothing more is written. The thread is
joined before the ``with`` block is left, whatever ends it (an exception in the caller,
Ctrl-C), so the caller can abort the store safely once the block is left.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

#: items waiting for the writer: enough to cover a slow write, few enough to bound memory
QUEUE_SIZE = 64

_END = object()  # the last item of the queue


class BackgroundWriter:
    """``with BackgroundWriter(writer.write) as background: background.put(index, record)``.

    Items must not change after ``put``: they are written later, on another thread.
    """

    def __init__(self, write: Callable[..., Any], *, maxsize: int = QUEUE_SIZE,
                 name: str = "embedpipe-store-writer") -> None:
        self._write = write
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=maxsize)
        self._failure: BaseException | None = None
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._reported = False

    # -- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _END:
                    return
                if self._failure is None and not self._cancelled.is_set():
                    # after a failure or a cancel, items are still taken (and dropped), so a put
                    # never waits on a writer that stopped writing
                    self._write(*item)
            except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
                self._failure = exc
            finally:
                del item
                self._queue.task_done()

    # -- the caller's thread ------------------------------------------------------------------

    def put(self, *item: Any) -> None:
        """Queue ``write(*item)``; waits while the queue is full. Raises the writer's failure."""
        self._raise_failure()
        self._queue.put(item)

    def close(self) -> None:
        """Write everything queued, join the thread, then raise the writer's failure if any."""
        self._stop()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None and not self._reported:
            self._reported = True
            raise self._failure

    def _stop(self) -> None:
        """Queue the end and join the thread. A Ctrl-C while waiting cancels the remaining writes
        and waits again (the thread ends after its current write), then is re-raised."""
        interrupted: KeyboardInterrupt | None = None
        ended = False
        while True:
            try:
                if not ended:
                    self._queue.put(_END)
                    ended = True
                self._thread.join()
                break
            except KeyboardInterrupt as exc:
                self._cancelled.set()
                interrupted = exc
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
        self._cancelled.set()  # the caller failed: what is still queued is not written
        self._stop()
        failure = self._failure
        if failure is not None and failure is not exc and not self._reported:
            note = f"the store writer had failed too: {type(failure).__name__}: {failure}"
            if hasattr(exc, "add_note"):  # Python >= 3.11; on 3.10 the caller's error stands alone
                exc.add_note(note)
