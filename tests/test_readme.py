"""Every README command that needs no network runs as written, in a fresh copy of the repo.

Each ```bash or ```python block of README.md is preceded by a marker comment:
``<!-- readme-test: run -->`` (run here, in README order) or
``<!-- readme-test: skip: <why> -->`` (the reason is printed). A block without a marker
fails the test, so a new README command cannot escape being checked. Blocks without a
language (synopses) are documentation, not commands.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import h5py
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_BLOCK = re.compile(r"(?:<!-- readme-test: (?P<marker>[^>]*?) -->\n)?```(?P<lang>bash|python)\n(?P<code>.*?)```", re.S)


@dataclass
class Block:
    line: int
    lang: str
    code: str
    marker: str | None


def readme_blocks(text: str) -> list[Block]:
    return [
        Block(text.count("\n", 0, m.start("code")), m["lang"], m["code"], m["marker"])
        for m in _BLOCK.finditer(text)
    ]


def test_every_readme_command_block_is_marked():
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 5
    unmarked = [b.line for b in blocks if b.marker is None]
    assert not unmarked, f"README.md code blocks at lines {unmarked} have no readme-test marker"
    bad = [b.line for b in blocks if not (b.marker == "run" or b.marker.startswith("skip: "))]
    assert not bad, f"README.md markers at lines {bad} must be 'run' or 'skip: <reason>'"


def _copy_repo(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files, as a fresh clone would have them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        src = ROOT / os.fsdecode(name)
        if src.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    blocks = [b for b in readme_blocks(README.read_text(encoding="utf-8")) if b.marker == "run"]
    assert any(b.lang == "bash" for b in blocks) and any(b.lang == "python" for b in blocks)
    repo = tmp_path / "repo"
    _copy_repo(repo)
    env = dict(os.environ, EMBEDPIPE_OFFLINE="1", PYTHONPATH=str(ROOT))
    for block in blocks:
        command = ["bash", "-euo", "pipefail", "-c", block.code] if block.lang == "bash" else [sys.executable, "-c", block.code]
        proc = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (f"README.md line {block.line} failed:\n{block.code}\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    assert (repo / "results-demo" / "report.html").stat().st_size > 0
    assert (repo / "results-demo" / "embeddings.h5").is_file()
    for name in ("embeddings.h5", "embeddings.parquet"):
        assert (repo / "results-demo" / "exports" / name).stat().st_size > 0


PYTHON_PAGE = ROOT / "docs" / "python.md"
QUICKSTART = ROOT / "docs" / "quickstart.md"
#: the families embedpipe runs (docs/models.md), as its one-line description names them
FAMILIES = ("ESM-2", "ESM-1b/1v", "SaProt", "ProtT5", "ProstT5", "Ankh", "ESM C", "ESM++")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def test_the_tagline_names_every_family_wherever_it_is_shown() -> None:
    """README's first paragraph, the package docstring, pyproject's description and the CLI's
    help each name every family, not ESM-2 alone."""
    import embedpipe
    from embedpipe.cli.commands import app

    readme = README.read_text(encoding="utf-8").split("\n\n")[1]  # the paragraph under the title
    found = re.search(r'^description = "(.*)"$', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert found, "pyproject.toml has no one-line description"
    places = {"README.md": readme, "embedpipe.__doc__": embedpipe.__doc__ or "", "pyproject.toml": found[1],
              "embedpipe --help": app.info.help or ""}
    missing = {where: [f for f in FAMILIES if f not in _one_line(text)] for where, text in places.items()}
    assert not any(missing.values()), missing


def _demo_store(root: Path, model: Path) -> Path:
    """``results-demo/`` as the README's offline demo writes it, without Snakemake: the bundled
    example sharded as configs/offline-demo.yaml shards it, each shard embedded with its
    options (fp32, last layer, per-residue, CPU) into ``stores/``, merged with the manifest."""
    from embedpipe.core.options import EmbedOptions
    from helpers.embed_helpers import merged_store

    out = root / "results-demo"
    options = EmbedOptions(precision="fp32", layers=(-1,), per_residue=True, device="cpu", long_sequences="chunk")
    return merged_store(out, model, ROOT / "examples" / "swissprot100.fasta", out / "embeddings.h5",
                        tokens_per_shard=15000, options=options)


def test_the_quick_start_python_examples_run_on_the_demo_output(tmp_path, model_factory):
    """Every ```python block of the README (the ones marked run) and of docs/quickstart.md runs
    as written, offline, in a directory holding what the offline demo writes (``results-demo/``,
    read by relative path): no example may need a download's ``results/``."""
    blocks = [b for b in readme_blocks(README.read_text(encoding="utf-8")) if b.lang == "python" and b.marker == "run"]
    blocks += readme_blocks(QUICKSTART.read_text(encoding="utf-8"))
    blocks = [b for b in blocks if b.lang == "python"]
    assert len(blocks) >= 3 and all("results/" not in b.code for b in blocks)
    store = _demo_store(tmp_path, model_factory(layers=2, dim=64, heads=4, seed=0))
    resolved = [name for b in blocks for name in re.findall(r'resolve\("([^"]+)"\)', b.code)]
    with h5py.File(store, "r") as f:  # what an example resolves is an alias (a duplicate sequence), as it says
        aliases = set(f["aliases/id"].asstr()[:])
    assert resolved and set(resolved) <= aliases, resolved
    env = dict(os.environ, EMBEDPIPE_OFFLINE="1", PYTHONPATH=str(ROOT))
    for block in blocks:
        proc = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"line {block.line} failed:\n{block.code}\n{proc.stderr[-3000:]}"


def test_the_python_page_runs_as_written(tmp_path):
    """docs/python.md's example, by the README's mechanism: every block marked, the ``run`` ones
    run in order in a fresh directory (a random-weight model made by the first), each must exit 0."""
    blocks = readme_blocks(PYTHON_PAGE.read_text(encoding="utf-8"))
    assert [b.marker for b in blocks] == ["run"] * 3 and [b.lang for b in blocks] == ["bash", "python", "bash"]
    assert len(blocks[1].code.strip().splitlines()) <= 10  # the ten-line example the page promises
    env = dict(os.environ, EMBEDPIPE_OFFLINE="1", PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    outputs = []
    for block in blocks:
        command = ["bash", "-euo", "pipefail", "-c", block.code] if block.lang == "bash" else [sys.executable, "-c", block.code]
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"docs/python.md line {block.line} failed:\n{block.code}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    assert outputs[1].startswith("('P1', 'P2', 'P3') (3, 32) ('bf16-mixed', 'bf16-mixed', 'bf16-mixed') ('', '', '')")
    lines = (tmp_path / "hits.tsv").read_text().splitlines()
    assert lines[0] == "query\thit\tscore\trank" and [line.split("\t")[3] for line in lines[1:]] == ["1", "2"]
    # search --ids P1: P1's stored vector searched, P1 itself left out
    rows = [line.split("\t") for line in (tmp_path / "p1.tsv").read_text().splitlines()]
    assert rows[0] == ["query", "hit", "score", "rank"] and sorted((r[0], r[1]) for r in rows[1:]) == [("P1", "P2"), ("P1", "P3")]
