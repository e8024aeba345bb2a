"""The `embedpipe` command line: ``commands`` (the typer commands; ``search_commands``: index
and search; ``model_commands``: fetch-model, make-test-model, model-info; ``precision_commands``:
decide-precision) and ``exit`` (how a command
ends: one line on stderr, a shell-like exit code). ``app`` and ``run`` are re-exported so that the
console script ``embedpipe.cli:run`` and ``python -m embedpipe.cli`` keep working."""

from embedpipe.cli import model_commands, precision_commands, search_commands  # noqa: F401 - register their commands on app
from embedpipe.cli.commands import app, run

__all__ = ["app", "run"]
