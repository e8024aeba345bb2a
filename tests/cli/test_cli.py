"""The console entry point: every failure is one line on stderr with a non-zero exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embedpipe.cli", *args], capture_output=True, text=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--layers", "abc"),
         "--layers takes integers, one per flag or a comma list (e.g. --layers 0,-1), not 'abc'"),
        (("info",), "Missing argument"),
        (("frobnicate",), "No such command 'frobnicate'"),
        (("shard", "/nonexistent/input.fasta", "--out", "shards"), "/nonexistent/input.fasta"),
        (
            ("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--overflow-margin", "nan"),
            "--overflow-margin must be a number in (0, 1], not nan",
        ),
        (
            ("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--overflow-margin", "0"),
            "--overflow-margin must be a number in (0, 1], not 0.0",
        ),
        (("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--tokens-per-batch", "lots"),
         "--tokens-per-batch must be auto or a whole number, not 'lots'"),
        (("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--tokens-per-batch", "2"),
         "--tokens-per-batch must be at least 3 (one residue and a model's special tokens: ESM-2's BOS and EOS)"),
        (("decide-precision", "x.fa", "--model", "m.pt", "--out", "d.json", "--precision", "fp32",
          "--auto-measure", "always"), "--auto-measure always applies to --precision auto only, not fp32"),
        (("decide-precision", "x.fa", "--model", "m.pt", "--out", "d.json", "--auto-measure", "often"),
         "--auto-measure must be one of auto, always, not 'often'"),
        (("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--int8-smoothing", "smoothquant:"),
         "--int8-smoothing smoothquant:: name the calibration FASTA after the colon"),
        (("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--int8-smoothing", "none:calib.fa"),
         "a calibration FASTA (workflow: int8_calibration) applies with --int8-smoothing smoothquant only, not none"),
        # flags embed once had: refused, naming where each went
        (("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--auto-cache", "dir"),
         "No such option: --auto-cache; where --precision auto keeps its measurements is set by EMBEDPIPE_AUTO_CACHE"),
        (("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--precision", "auto", "--auto-measure", "always"),
         "No such option: --auto-measure; to measure whatever the job's size, run embedpipe decide-precision"),
        *((cmd, "No such option: --int8-calibration; give the FASTA as --int8-smoothing smoothquant:FASTA")
          for cmd in (("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--int8-calibration", "c.fa"),
                      ("decide-precision", "x.fa", "--model", "m.pt", "--out", "d.json", "--int8-calibration", "c.fa"))),
        # the engine choices and --compile are no options: refused by name (docs/precision.md, "Engine choices")
        *((("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", flag, value), f"No such option: {flag}")
          for flag, value in (("--attention", "math"), ("--batch-layout", "padded"), ("--attention-inputs", "fp32"),
                              ("--fallback-device", "cpu"), ("--compile", "off"), ("--compile-cache", "dir"))),
    ],
)
def test_usage_and_input_errors_are_one_line(args, message, tmp_path):
    result = subprocess.run([sys.executable, "-m", "embedpipe.cli", *args], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("embedpipe: error: ") and message in lines[0]


def test_a_missing_value_is_no_moved_flag(tmp_path):
    """decide-precision still has --auto-measure: a missing value is click's error, without
    the hint that embed's removed --auto-measure gives."""
    result = subprocess.run([sys.executable, "-m", "embedpipe.cli", "decide-precision", "x.fa", "--model", "m.pt",
                             "--out", "d.json", "--auto-measure"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0
    assert "requires an argument" in result.stderr and "decide-precision (its" not in result.stderr, result.stderr


def test_embed_has_at_most_20_options():
    """Options are what a user decides; the engine's and the site's are resolved by the program
    (or set in the environment), so the list stays short. Counted on the click command itself:
    an on/off pair is one option, --help none."""
    import typer

    from embedpipe.cli import app

    embed = typer.main.get_command(app).commands["embed"]  # type: ignore[attr-defined]
    names = [param.name for param in embed.params if param.param_type_name == "option"]  # typer's own click
    assert "per_residue" in names and "fasta" not in names and "help" not in names
    assert len(names) <= 20, names


def test_version_and_help_exit_zero():
    assert _run("--version").returncode == 0
    result = _run("embed", "--help")
    assert result.returncode == 0 and "--precision" in result.stdout


@pytest.mark.parametrize("margin", [float("nan"), float("inf"), 0.0, -0.5, 1.5])
def test_overflow_margin_outside_0_1_is_refused(margin):
    from embedpipe.core.errors import EmbedpipeError
    from embedpipe.core.options import EmbedOptions

    with pytest.raises(EmbedpipeError, match=r"must be a number in \(0, 1\]"):
        EmbedOptions(overflow_margin=margin).validate()
    EmbedOptions(overflow_margin=1.0).validate()


def test_no_arguments_prints_the_help_and_exits_zero():
    result = _run()
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("Usage:") and "embed" in result.stdout and "export" in result.stdout


def test_tokens_per_batch_is_auto_or_a_whole_number():
    from embedpipe.core.errors import EmbedpipeError
    from embedpipe.core.options import AUTO, parse_tokens_per_batch

    assert parse_tokens_per_batch("auto") == AUTO
    assert parse_tokens_per_batch("8192") == 8192 and parse_tokens_per_batch(" 3 ") == 3
    for bad in ("", "1.5", "AUTO", "4k"):
        with pytest.raises(EmbedpipeError, match="--tokens-per-batch must be auto or a whole number"):
            parse_tokens_per_batch(bad)


def test_layers_take_a_comma_list_or_repeats():
    from embedpipe.cli.commands import _int_list

    assert _int_list(["0,-1"], "--layers") == (0, -1)
    assert _int_list(["0", "-1"], "--layers") == (0, -1)
    assert _int_list(["2, 3,", "-1"], "--layers") == (2, 3, -1)


def test_help_at_80_columns_keeps_every_option_whole_and_explained():
    """Every option of every command has help text, and the help shows each name uncut."""
    import os

    from typer.main import get_command

    from embedpipe.cli import app

    group = get_command(app)
    env = dict(os.environ, COLUMNS="80")
    for name, command in group.commands.items():
        for param in command.params:
            if param.param_type_name == "option":
                assert param.help, f"{name} {param.opts[0]} has no help text"
        out = subprocess.run([sys.executable, "-m", "embedpipe.cli", name, "--help"], capture_output=True,
                             text=True, env=env).stdout
        assert "<bool>" not in out and "…" not in out, out
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("--"):
                    assert opt in out, f"{name}: {opt} cut or missing in --help"


def test_readme_synopsis_names_every_option():
    """README.md's command-line section lists every command and every option (first name)."""
    import re
    from pathlib import Path

    from typer.main import get_command

    from embedpipe.cli import app

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = text.split("## The command line", 1)[1].split("```")[1]
    synopsis: dict[str, str] = {}
    current = ""
    for line in block.splitlines():
        match = re.match(r"embedpipe (\S+)", line)
        current = match[1] if match else current
        synopsis[current] = synopsis.get(current, "") + " " + line
    group = get_command(app)
    visible = {name for name, command in group.commands.items() if not command.hidden}
    assert set(synopsis) - {""} == visible
    for name in visible:
        for param in group.commands[name].params:
            if param.param_type_name == "option" and param.opts[0] != "--help":
                names = [o for o in param.opts if o.startswith("--")] or param.opts
                assert any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", synopsis[name]) for o in [*names, *param.opts]), (
                    f"README synopsis of {name} lacks {param.opts}")
