"""``python -m embedpipe.cli``: the console script."""

from embedpipe.cli.commands import run

run()
