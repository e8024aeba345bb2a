"""Progress bars on stderr for long work: shown on a TTY, hidden with --quiet or when piped."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm


def progress_bar(*, quiet: bool = False, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, disabled when ``quiet`` or when stderr is not a terminal."""
    disable = quiet or not sys.stderr.isatty()
    return tqdm(file=sys.stderr, disable=disable, dynamic_ncols=True, **kwargs)


def say(message: str, *, quiet: bool = False) -> None:
    """A line for the user on stderr (summaries, warnings); stdout stays for data such as --json."""
    if not quiet:
        print(message, file=sys.stderr, flush=True)
