"""Helpers shared by the shard tests: write a FASTA text, read the manifest back."""

from __future__ import annotations

import csv
from pathlib import Path


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def manifest(out: Path) -> list[dict[str, str]]:
    with open(out / "manifest.tsv", newline="") as fh:
        return list(csv.DictReader(fh, delimiter="\t"))
