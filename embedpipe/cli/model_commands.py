"""The model commands: ``fetch-model``, ``make-test-model`` and ``model-info`` (embedpipe.model),
registered on the one ``app`` of :mod:`embedpipe.cli.commands`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from embedpipe.cli.commands import app
from embedpipe.cli.exit import user_errors
from embedpipe.model import families

#: what ``make-test-model --family`` takes: the table's formats with a writer (torch-free to list)
TEST_MODELS = "; ".join(f"{fmt.name} ({fmt.writer.what})" for fmt in families.written() if fmt.writer is not None)


@app.command("fetch-model")
@user_errors
def fetch_model(
    name: str = typer.Argument(..., help="fair-esm name, e.g. esm2_t33_650M_UR50D or esm1b_t33_650M_UR50S "
                               "(downloaded); a Hugging Face hub name, or esmc_300m / esmc_600m, is only looked up "
                               "in the local hub cache."),
    dest: Optional[Path] = typer.Option(None, "--dest", help="Directory (default: the torch hub cache; fair-esm only)."),
) -> None:
    """Download a model ahead of time, for compute nodes without internet."""
    from embedpipe.model.fetch import fetch_model as _fetch

    path = _fetch(name, dest=dest)
    print(path)


@app.command("make-test-model")
@user_errors
def make_test_model(
    ctx: typer.Context,
    out: Path = typer.Argument(..., help="Checkpoint path to write (.pt; .pth for esmc-pth), or the directory to "
                               "write for a Hugging Face family."),
    layers: int = typer.Option(2, "--layers", min=1, help="Transformer layers."),
    dim: int = typer.Option(32, "--dim", min=2, help="Embedding width (a multiple of --heads; esmc-pth: of 64, "
                            "default 128)."),
    heads: int = typer.Option(4, "--heads", min=1, help="Attention heads (esmc-pth: --dim / 64, the default)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights (same seed, same checkpoint)."),
    family: str = typer.Option("esm2", "--family", help=f"What to write: {TEST_MODELS}. A Hugging Face "
                               "directory needs the hf extra (docs/models.md)."),
) -> None:
    """Write a random-weight (untrained) test model of a family, in one of its formats: a fair-esm
    checkpoint, SaProt's esm-format checkpoint, an ESM C state dict in the esm package's, or a
    Hugging Face model directory (--family)."""
    writer = families.test_model_format(family).writer
    assert writer is not None  # a written format
    # typer carries its own click: its ParameterSource is told by name
    given = [name for name in ("layers", "dim", "heads", "seed")
             if getattr(ctx.get_parameter_source(name), "name", "") != "DEFAULT"]
    print(writer.write(out, family, given=given, layers=layers, dim=dim, heads=heads, seed=seed))


@app.command("model-info")
@user_errors
def model_info(
    spec: str = typer.Argument(..., help="Model name or checkpoint path."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Facts about a model without loading its weights (the workflow's mem_mb comes from here)."""
    from embedpipe.model import inspect

    data = inspect(spec).to_dict()
    if as_json:
        print(json.dumps(data, sort_keys=True))
    else:
        for key, value in data.items():
            print(f"{key}: {_as_text(value)}")


def _as_text(value: object) -> str:
    """A fact as a person reads it, not a Python repr: unknown, yes/no, ``key=value, ...``."""
    if value is None:
        return "unknown"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k}={'none' if v is None else _as_text(v)}" for k, v in value.items())
    return str(value)
