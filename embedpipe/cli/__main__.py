"""``python -m embedpipe.cli``: the console script."""

from embedpipe.cli import run

run()
