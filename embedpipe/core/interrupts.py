"""Ctrl-C and SIGTERM during HDF5 work: recorded when they arrive, raised at a safe point.

A Python signal handler raises its exception wherever the main thread is, also inside h5py's
Cython code: there ``KeyboardInterrupt`` escaped through h5py's global lock and the command
died of ``SystemError: FastRLock.__exit__ returned a result with an exception set`` and exit
1 (4 of 22 interrupted merges), instead of ending as docs/cluster.md and
:mod:`embedpipe.cli.exit` promise (one line, 130 or 143, temporaries removed). Inside
:func:`deferred` the handlers only record the signal; :func:`checkpoint`, called between
blocks where no h5py call is under way, calls the handler that was in place (the CLI's, so
SIGTERM still ends with 143), and leaving the block does the same. Outside :func:`deferred`
(or off the main thread) :func:`checkpoint` is a no-op.

An interrupt ends a command with one line, ``embedpipe: interrupted``; a command whose work
has parts (a group embed job's shards) says how far it got on that line: inside
:func:`telling_progress` the interrupt carries the block's account of its progress, which the
CLI prints (:func:`progress_of`), so the job's log keeps which shards were done and which one
was under way.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["checkpoint", "deferred", "progress_of", "telling_progress"]

#: the signals held back: Ctrl-C, SIGTERM, and the CLI's SIGALRM that re-raises a swallowed one
_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGALRM", None)) if s is not None)
_held: dict[int, Any] = {}  # while deferred: the handlers in place before, by signal
_pending: list[int] = []  # signals recorded, in arrival order


def _record(signum: int, frame: Any) -> None:
    if signum not in _pending:
        _pending.append(signum)


def checkpoint(handlers: dict[int, Any] | None = None) -> None:
    """Raise a signal recorded inside :func:`deferred` now, through the handler it replaced."""
    if not _pending:
        return
    signum = _pending.pop(0)
    _pending.clear()  # one interrupt ends the command; a second one adds nothing
    handler = (_held if handlers is None else handlers).get(signum, signal.SIG_DFL)
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum != getattr(signal, "SIGALRM", None):
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back to :func:`checkpoint` while the block runs (main thread
    only: signal handlers can be set nowhere else; nested blocks share the outer one)."""
    if _held or threading.current_thread() is not threading.main_thread():
        yield
        return
    for signum in _SIGNALS:
        _held[signum] = signal.signal(signum, _record)
    try:
        yield
    except BaseException:
        _pending.clear()  # already ending: the exception under way reports it
        raise
    finally:
        handlers = dict(_held)
        _held.clear()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    checkpoint(handlers)


_PROGRESS = "embedpipe_progress"  # the attribute an interrupt carries its progress in


@contextlib.contextmanager
def telling_progress(describe: Callable[[], str]) -> Iterator[None]:
    """An interrupt (Ctrl-C, SIGTERM) that ends the block carries ``describe()``, what the
    command had done when it came (e.g. ``during shard 2 of 3 (...); done: ...``), for the
    CLI's one line (:func:`progress_of`); an inner block's account is kept, not replaced."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if progress_of(exc) is None:
            setattr(exc, _PROGRESS, describe())
        raise


def progress_of(exc: BaseException) -> str | None:
    """The progress an interrupt carries (:func:`telling_progress`), or None."""
    value = getattr(exc, _PROGRESS, None)
    return value if isinstance(value, str) else None
