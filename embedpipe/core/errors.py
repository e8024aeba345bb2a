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
