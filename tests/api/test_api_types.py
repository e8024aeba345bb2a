"""mypy checks a user's script against the Python API: a script that uses it as documented
passes ``mypy --strict``, and every deliberate mistake in another one is reported on its line
(a misspelt keyword, a wrong type, an assignment to a frozen field, a misspelt name): the
API's types reach the user, no ``Any`` in their place."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers.processes import ROOT

GOOD = '''\
from __future__ import annotations

from pathlib import Path

import numpy as np

import embedpipe


def main() -> None:
    result: embedpipe.Result = embedpipe.embed(["MKT"], "model", precision="fp32", layers=(0, -1), pooling="bos",
                                               per_residue=True, device="cpu")
    vectors: np.ndarray = result.mean()
    first: np.ndarray = result.bos(0)
    residues: np.ndarray = result.per_residue("0", layer=-1)
    ids: tuple[str, ...] = result.ids
    row: int = result.rows["0"]
    policy: object = result.provenance["precision_policy"]
    counts: dict[str, int] = result.fallback_counts()
    saved: Path = result.save("out.h5")
    options = embedpipe.EmbedOptions(threads=2, tokens_per_batch=4096)
    with embedpipe.Embedder("model", layers=-1, device="cpu", options=options,
                            limits=embedpipe.FastaLimits(max_length=5000)) as model:
        more: embedpipe.Result = model.embed(embedpipe.read_fasta("p.fasta", model))
        found: embedpipe.Hits = model.search(Path("p.fasta"), "x.index", k=5)
    hits = embedpipe.search(index="x.index", ids=["P1"], k=2, collapse_aliases=True)
    nearest: str = hits.hits[0][0]
    scores: np.ndarray = hits.scores
    if hits.groups is not None:
        group: tuple[str, ...] = hits.groups[0][0]
    hits.write_tsv("hits.tsv")
    print(vectors, first, residues, ids, row, policy, counts, saved, more, found, nearest, scores)
'''

#: the lines marked ``# mistake``: each an error mypy must report on that line
BAD = '''\
import numpy as np

import embedpipe

result = embedpipe.embed(["MKT"], "m")
hits = embedpipe.search(index="x.index", ids=["P1"])
embedpipe.embed(["MKT"], "m", layers="x")  # mistake: a str is no layer
embedpipe.Embedder("m", precisoin="fp32")  # mistake: misspelt
embedpipe.Embedder("m", accept_platform_mix=True)  # mistake: not the API's
embedpipe.search(["MKT"], "x.index", options={"threads": 2})  # mistake: options is an EmbedOptions
count: int = result.mean()  # mistake: an array
listed: list[str] = result.ids  # mistake: a tuple
hits.hits[0][0] + 1  # mistake: an ID is a str
result.ids = ()  # mistake: frozen
hits.scores = np.zeros(1)  # mistake: frozen
embedpipe.embedd(["MKT"], "m")  # mistake: no such name
'''


def test_mypy_checks_a_users_script_against_the_api(tmp_path: Path) -> None:
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--python-version", version, "--follow-imports=silent",
         "--config-file=", "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", "good.py", "bad.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    errors = re.findall(r"^(\w+)\.py:(\d+): error: (.*)$", proc.stdout, flags=re.M)
    assert proc.returncode == 1 and errors, proc.stdout + proc.stderr
    assert [e for e in errors if e[0] != "bad"] == []  # the documented use passes --strict
    mistakes = {number for number, line in enumerate(BAD.splitlines(), 1) if "# mistake" in line}
    assert len(mistakes) == 10 and {int(line) for _, line, _ in errors} == mistakes, proc.stdout
