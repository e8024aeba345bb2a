"""The `embedpipe` command line: ``commands`` (the typer commands) and ``exit`` (how a command
ends: one line on stderr, a shell-like exit code). ``app`` and ``run`` are re-exported so that the
console script ``embedpipe.cli:run`` and ``python -m embedpipe.cli`` keep working."""

from embedpipe.cli.commands import app, run

__all__ = ["app", "run"]
