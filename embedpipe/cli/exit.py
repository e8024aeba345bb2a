"""How the `embedpipe` command ends: every failure as one line on stderr and a shell-like exit code.

One job: a library ``EmbedpipeError``, an unforeseen ``OSError``, a reader that went away
(``embedpipe info --json | head``), Ctrl-C during the command or while the interpreter shuts
down, and typer's usage errors all end the same way: ``embedpipe: error: ...`` (or
``embedpipe: interrupted``) and 1, 2, 130 or 141. Running out of memory is no user error:
``embedpipe: out of memory: ...`` and :data:`EXIT_OUT_OF_MEMORY`, so the workflow retries the
job with more memory instead of taking it for a refusal of its inputs (embedpipe.workflow.jobs).
SIGTERM (``kill``, ``scancel``, a SLURM time limit) is handled as Ctrl-C is, the temporaries
removed by the same ``finally`` and ``except`` blocks, and ends with 143. Where h5py runs
(merge), the library holds both back to the points between files and blocks
(:mod:`embedpipe.core.interrupts`), which call the handlers set here. The commands themselves
are in :mod:`embedpipe.cli.commands`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import typer

from embedpipe.core.errors import EmbedpipeError, out_of_memory
from embedpipe.core.interrupts import progress_of

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OUT_OF_MEMORY = 3  # an allocation failed (host or GPU): not the user's input, retried with more
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what `cat` reports when its reader goes away
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for `kill`


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so that every
    cleanup written for an interrupt (temporary files, the writer thread) runs for it too."""

    exit_code = EXIT_TERMINATED


def _raise_terminated(signum: int, frame: Any) -> None:
    _Interrupts.raised = EXIT_TERMINATED
    raise Terminated()


def _raise_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C as Python's own handler, remembered: typer turns one that lands outside the
    command (while it parses the arguments) into a silent 130, which :func:`run_app` reports."""
    _Interrupts.raised = EXIT_INTERRUPTED
    raise KeyboardInterrupt()


def _interrupt_code(exc: BaseException) -> int:
    """130 for Ctrl-C, 143 for SIGTERM."""
    return getattr(exc, "exit_code", EXIT_INTERRUPTED)


def _interrupted_line(exc: BaseException) -> str:
    """``embedpipe: interrupted``, and how far the command got when it says (a group embed
    job: the shards done and the one under way; embedpipe.core.interrupts.telling_progress)."""
    progress = progress_of(exc)
    return "embedpipe: interrupted" + (f" {progress}" if progress else "")


def _os_error_message(exc: OSError, out: Any) -> str:
    """One line for an OSError the library did not foresee, naming a path: the file the error
    names, else (for a write failure such as a full disk) the command's ``--out``."""
    from embedpipe.core.atomic import WRITE_ERRNOS, write_error

    reason = exc.strerror or str(exc)
    if getattr(exc, "filename", None):
        return f"{reason}: {exc.filename}"
    if out is not None and exc.errno in WRITE_ERRNOS:
        return str(write_error(Path(out), exc, known=True))
    return reason


def _memory_reason(exc: BaseException) -> str:
    """An allocation failure in one line (torch's run over several, with C++ frames)."""
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _stdout_gone() -> None:
    """Stdout's reader has gone (``embedpipe info --json | head -c 10``): end quietly as `cat`
    does. Pointing stdout at /dev/null keeps the interpreter's final flush from failing again."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def user_errors(func: F) -> F:
    """Turn EmbedpipeError into `embedpipe: error: ...` on stderr and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except EmbedpipeError as exc:
            print(f"embedpipe: error: {exc}", file=sys.stderr)
            raise typer.Exit(1) from None
        except BrokenPipeError:
            _stdout_gone()
            raise typer.Exit(EXIT_BROKEN_PIPE) from None
        except (MemoryError, RuntimeError, OSError) as exc:
            if out_of_memory(exc):
                print(f"embedpipe: out of memory: {_memory_reason(exc)}", file=sys.stderr)
                raise typer.Exit(EXIT_OUT_OF_MEMORY) from None
            if not isinstance(exc, OSError):
                raise
            # a file-system failure the library did not foresee: still one line
            print(f"embedpipe: error: {_os_error_message(exc, kwargs.get('out'))}", file=sys.stderr)
            raise typer.Exit(1) from None
        except KeyboardInterrupt as exc:
            print(_interrupted_line(exc), file=sys.stderr)
            _Interrupts.reported = True
            raise typer.Exit(_interrupt_code(exc)) from None

    return wrapper  # type: ignore[return-value]


#: after an interrupt was swallowed, the signal is sent again this many seconds later
REDELIVER_SECONDS = 0.05


class _Interrupts:
    """Ctrl-C or SIGTERM that Python could only report as ``Exception ignored in: ...`` (it
    landed in a weakref callback or ``__del__``, where it cannot propagate) is remembered, and
    raised again soon (SIGALRM), where the command can stop. Without the
    second signal the command ran on to its end (an embed job kept embedding after SIGTERM,
    until SLURM's grace time ran out and SIGKILL left its temporary), or forever."""

    swallowed = False
    code = EXIT_INTERRUPTED
    raised: int | None = None  # the code of the last interrupt a handler raised
    reported = False  # the command's wrapper said "interrupted"

    @classmethod
    def hook(cls, args: Any) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, KeyboardInterrupt):
            cls.swallowed = True
            cls.code = getattr(args.exc_type, "exit_code", EXIT_INTERRUPTED)
            cls.redeliver()
            return
        sys.__unraisablehook__(args)

    @classmethod
    def redeliver(cls) -> None:
        """Raise it again soon: a one-shot SIGALRM (``setitimer``: no thread to start, nothing
        that waits, callable from any thread), whose handler (:func:`_raise_remembered`) runs in
        the main thread at a later point, almost always one where the exception propagates
        (else this repeats)."""
        signal.setitimer(signal.ITIMER_REAL, REDELIVER_SECONDS)


def _raise_remembered(signum: int, frame: Any) -> None:
    """SIGALRM after a swallowed interrupt: the interrupt itself, where it can propagate."""
    raise Terminated() if _Interrupts.code == EXIT_TERMINATED else KeyboardInterrupt()


def _interrupted_while_exiting(signum: int, frame: Any) -> None:
    """SIGINT after the command has returned (while files close and the interpreter shuts
    down): the same one line as during the command, not ``Exception ignored ...``."""
    with contextlib.suppress(Exception):
        print("embedpipe: interrupted", file=sys.stderr, flush=True)
    os._exit(EXIT_TERMINATED if signum == signal.SIGTERM else EXIT_INTERRUPTED)


def finish(code: int) -> None:
    """Exit with ``code`` once stdout is flushed; a reader that went away ends it quietly."""
    signal.setitimer(signal.ITIMER_REAL, 0)  # a swallowed interrupt is reported below instead
    signal.signal(signal.SIGINT, _interrupted_while_exiting)
    signal.signal(signal.SIGTERM, _interrupted_while_exiting)
    if _Interrupts.swallowed and code not in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        print("embedpipe: interrupted", file=sys.stderr)
        code = _Interrupts.code
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_gone()
        code = EXIT_BROKEN_PIPE
    sys.exit(code)


def run_app(app: Any, moved: Mapping[str, str] | None = None) -> None:
    """Run the typer ``app`` as the console entry point: like ``app()``, but usage errors are
    one line on stderr too; an unknown option that ``moved`` names (a flag the command once had)
    says where it went.

    Typer vendors its own click, so its exceptions are recognised by what they carry
    (``format_message`` and ``exit_code``), not by class.
    """
    sys.unraisablehook = _Interrupts.hook
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGALRM, _raise_remembered)
    try:
        result = app(standalone_mode=False)
    except BrokenPipeError:
        _stdout_gone()
        finish(EXIT_BROKEN_PIPE)
    except Exception as exc:
        if not (hasattr(exc, "format_message") and hasattr(exc, "exit_code")):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":  # plain `embedpipe`: the help, not an error
            print(exc.format_message())
            finish(0)
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        # an unknown option only: a missing value of an option a command still has is no move
        went = (moved or {}).get(getattr(exc, "option_name", "")) if type(exc).__name__ == "NoSuchOption" else None
        print(f"embedpipe: error: {exc.format_message()}{f'; {went}' if went else ''}{hint}", file=sys.stderr)
        finish(exc.exit_code)
    except KeyboardInterrupt as exc:
        print(_interrupted_line(exc), file=sys.stderr)
        finish(_interrupt_code(exc))
    if result == EXIT_INTERRUPTED and _Interrupts.raised is not None and not _Interrupts.reported:
        print("embedpipe: interrupted", file=sys.stderr)  # typer's silent 130 (see _raise_interrupt)
        finish(_Interrupts.raised)
    finish(result if isinstance(result, int) else 0)
