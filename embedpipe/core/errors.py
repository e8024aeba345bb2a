"""User-facing errors: one exception type whose message is the one-line reason the CLI prints,
and what is never one: running out of memory (:func:`out_of_memory`)."""

from __future__ import annotations

import errno


class EmbedpipeError(Exception):
    """A failure the user can act on (bad input, missing model, corrupt store).

    The CLI prints ``embedpipe: error: <message>`` on stderr and exits non-zero; anything
    else that escapes is a bug and keeps its traceback.
    """


class InputError(EmbedpipeError):
    """Bad FASTA input; the message names the file, line and record."""


class ModelError(EmbedpipeError):
    """A model that cannot be found, fetched or safely loaded."""


class StoreError(EmbedpipeError):
    """A store that is incomplete, inconsistent, corrupt or of an unsupported format."""


#: characters of a user's value an error line quotes before it shortens it
QUOTE_CHARS = 80


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """``repr`` of ``value`` as an error line quotes it: a label or ID of 200 MB made the
    "one-line" error 200 MB long, so past ``limit`` characters only the start is quoted,
    then ``... (N chars)``."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"


#: what an allocation failure says, whoever raised it: torch's CPU allocator ("can't allocate
#: memory", "not enough memory"), CUDA ("CUDA out of memory"), the C library (ENOMEM,
#: "Cannot allocate memory"), C++ (``std::bad_alloc``); lower case
OUT_OF_MEMORY_WORDS = ("can't allocate memory", "not enough memory", "out of memory", "cannot allocate memory",
                       "bad_alloc")


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines too) as one space: an error line."""
    return " ".join(str(text).split())


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is running out of memory (host or GPU) while loading or running: a
    ``MemoryError``, an ``OSError`` ENOMEM, an allocator's ``RuntimeError`` (torch's
    ``torch.cuda.OutOfMemoryError`` is one). Never an :class:`EmbedpipeError`: the same
    command may succeed with more memory, so it is no refusal of its inputs, and a library
    wrapper that turns failures into one-line errors lets it through."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    return isinstance(exc, RuntimeError) and says_out_of_memory(str(exc))


def says_out_of_memory(text: str) -> bool:
    """Whether ``text`` (an exception's message, a log line) reports an allocation failure."""
    low = text.lower()
    return any(word in low for word in OUT_OF_MEMORY_WORDS)
