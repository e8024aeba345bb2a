"""User-facing errors: one exception type whose message is the one-line reason the CLI prints."""

from __future__ import annotations


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
