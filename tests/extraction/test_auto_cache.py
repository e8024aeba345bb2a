"""The node's cache of ``--precision auto`` (embedpipe/runtime/auto_cache.py) trusted only as far
as it is checked: an entry that is a FIFO, a link or a directory is described without blocking or
following it; a crafted entry (a huge or multi-line time, a policy that is no candidate, numbers
that are not finite) is refused and never quoted; an unusable entry is measured anew with one
warning; a directory other users can write to is not used. Named policies' warnings read the
cache through the same reader. No timing assertions: the planted timings decide."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from embedpipe.core.cpus import thread_count
from embedpipe.core.options import AUTO_CACHE_VARIABLE, EmbedOptions
from embedpipe.extraction import auto_precision
from embedpipe.extraction.job import auto_cache as job_cache
from embedpipe.extraction.run import embed_fasta
from embedpipe.model import load_model
from embedpipe.model.identity import ModelIdentity
from embedpipe.runtime import auto_cache
from embedpipe.runtime.auto_cache import Timing
from embedpipe.runtime.engine_override import EngineChoice
from helpers.embed_helpers import random_sequences, write_fasta

CPU = torch.device("cpu")
AUTO = EmbedOptions(precision="auto", device="cpu")
RECORDS = random_sequences(12, (20, 80), seed=11)
KEY = {"version": 1, "node": "n", "candidates": ["fp32", "bf16-mixed", "int8-mixed"], "threads": 2}
GOOD = {"fp32": Timing(10.0, 1.0), "bf16-mixed": Timing(5.0, 0.9999), "int8-mixed": Timing(7.0, 0.9995)}
FAKE = "\nembedpipe: error: your data is corrupt, run rm -rf ~\n"
#: the timed runs of one measurement: every CPU candidate once a round
MEASURED = len(auto_precision.CPU_CANDIDATES) * auto_precision.ROUNDS


def entry(directory: Path) -> Path:
    """The one entry written in ``directory`` (by write_cached, for KEY)."""
    (path,) = directory.glob("*.json")
    return path


def read_soon(directory: Path, key=KEY) -> auto_cache.CacheRead:
    """read_cached in a thread: a reader that blocks (a FIFO opened for reading) fails the test, not the run."""
    box: list[auto_cache.CacheRead] = []
    reader = threading.Thread(target=lambda: box.append(auto_cache.read_cached(directory, key)), daemon=True)
    reader.start()
    reader.join(120)
    assert not reader.is_alive() and box, "read_cached blocked"
    return box[0]


def one_line(problem: str | None) -> str:
    assert problem is not None and "\n" not in problem and "\r" not in problem and len(problem) < 400, problem
    return problem


def test_a_well_formed_entry_is_read_back(tmp_path) -> None:
    auto_cache.write_cached(tmp_path, KEY, GOOD)
    read = read_soon(tmp_path)
    assert read.problem is None and read.found is not None
    assert read.found.timings == GOOD
    assert read.found.measured_utc == json.loads(entry(tmp_path).read_text())["measured_utc"]


@pytest.mark.parametrize("kind,words", [("fifo", "a FIFO"), ("symlink", "a symbolic link"), ("directory", "a directory")])
def test_an_entry_that_is_no_regular_file_is_described_without_blocking_or_following_it(tmp_path, kind, words) -> None:
    auto_cache.write_cached(tmp_path, KEY, GOOD)
    path = entry(tmp_path)
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_bytes(path.read_bytes())  # a good measurement: a link to it is still not followed
    path.unlink()
    {"fifo": lambda: os.mkfifo(path), "symlink": lambda: path.symlink_to(elsewhere), "directory": path.mkdir}[kind]()
    read = read_soon(tmp_path)
    assert read.found is None and words in one_line(read.problem) and str(path) in read.problem


def _crafted(data: dict) -> list[tuple[str, object]]:
    return [("time", data | {"measured_utc": "2026-12-01T00:00:00Z" + FAKE + "x" * 500_000}),
            ("time-fields", data | {"measured_utc": "2026-13-45T99:99:99Z"}),
            ("time-type", data | {"measured_utc": 20261201}),
            ("policy", data | {"timings": data["timings"] | {"fp16-mixed" + FAKE: {"ms_per_1k_residues": 0.1,
                                                                                   "min_cosine": 1.0}}}),
            ("nan", data | {"timings": data["timings"] | {"bf16-mixed": {"ms_per_1k_residues": float("nan"),
                                                                            "min_cosine": 1.0}}}),
            ("inf", data | {"timings": data["timings"] | {"int8-mixed": {"ms_per_1k_residues": 1.0,
                                                                            "min_cosine": float("inf")}}}),
            ("negative", data | {"timings": data["timings"] | {"int8-mixed": {"ms_per_1k_residues": -1.0,
                                                                                 "min_cosine": 1.0}}}),
            ("cosine", data | {"timings": data["timings"] | {"int8-mixed": {"ms_per_1k_residues": 1.0,
                                                                               "min_cosine": 2.0}}}),
            ("bool", data | {"timings": data["timings"] | {"int8-mixed": {"ms_per_1k_residues": True,
                                                                             "min_cosine": 1.0}}}),
            ("no-fp32", data | {"timings": {k: v for k, v in data["timings"].items() if k != "fp32"}}),
            ("timings-null", data | {"timings": None}),
            ("field", data | {"note" + FAKE: 1}),
            ("key", data | {"key": KEY | {"node": "another"}}),
            ("list", [data])]


@pytest.mark.parametrize("case", range(14))
def test_a_crafted_entry_is_refused_and_described_never_quoted(tmp_path, case) -> None:
    auto_cache.write_cached(tmp_path, KEY, GOOD)
    path = entry(tmp_path)
    name, crafted = _crafted(json.loads(path.read_text()))[case]
    text = json.dumps(crafted)  # NaN and Infinity as Python's json writes them
    assert len(text) <= auto_cache.MAX_ENTRY_BYTES or name == "time"
    path.write_text(text)
    read = read_soon(tmp_path)
    assert read.found is None, name
    problem = one_line(read.problem)
    assert "embedpipe: error" not in problem and "rm -rf" not in problem and "xxxx" not in problem


def test_an_entry_too_large_or_not_json_is_refused(tmp_path) -> None:
    auto_cache.write_cached(tmp_path, KEY, GOOD)
    path = entry(tmp_path)
    path.write_bytes(b" " * (auto_cache.MAX_ENTRY_BYTES + 1))
    assert f"{auto_cache.MAX_ENTRY_BYTES + 1} bytes" in one_line(read_soon(tmp_path).problem)
    path.write_bytes(bytes(range(256)))
    assert "not valid JSON" in one_line(read_soon(tmp_path).problem)


def test_a_directory_other_users_can_write_to_is_not_used(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    auto_cache.write_cached(cache, KEY, GOOD)
    cache.chmod(0o777)
    read = read_soon(cache)
    assert read.found is None and "writable by every user (mode 777)" in one_line(read.problem)
    cache.chmod(0o770)  # group-writable, ours: a team's shared cache
    assert read_soon(cache).found is not None
    owner = cache.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # the same directory seen by another user
    read = read_soon(cache)
    assert read.found is None and "group-writable and owned by another user" in one_line(read.problem)
    cache.chmod(0o750)
    assert read_soon(cache).found is not None  # not writable by that user's group: trusted to read


# ---------------------------------------------------------------------------- the job's decision


def _planted(seconds: dict[str, float]):
    calls: list[str] = []

    def timed(loaded, run, sample):
        calls.append(run.policy.name)
        return seconds[run.policy.name], [{layer: torch.ones(8).numpy() for layer in run.layers} for _ in sample]
    return timed, calls


@pytest.fixture
def loaded(tiny_model_path):
    return load_model(str(tiny_model_path))


def _decide(loaded, directory: Path):
    model = ModelIdentity(loaded.sha256, True, {}, loaded.family)
    return auto_precision.decide(loaded, AUTO, EngineChoice(), CPU, model, RECORDS, 10**9, directory,
                             threads=thread_count(None), quiet=False)


def _entry_for(loaded, directory: Path) -> Path:
    model = ModelIdentity(loaded.sha256, True, {}, loaded.family)
    key = auto_precision._key(AUTO, EngineChoice(), CPU, model)
    written = auto_cache.write_cached(directory, key, GOOD)
    assert isinstance(written, Path)
    return written


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def test_a_directory_as_the_entry_is_measured_anew_with_one_warning(loaded, tmp_path, monkeypatch, capsys) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.5, "int8-mixed": 0.7})
    monkeypatch.setattr(auto_precision, "_time", timed)
    path = _entry_for(loaded, tmp_path)
    path.unlink()
    path.mkdir()
    choice = _decide(loaded, tmp_path)
    assert sorted(calls) == sorted(auto_precision.CPU_CANDIDATES * auto_precision.ROUNDS)
    assert choice.policy == "bf16-mixed"
    assert choice.reason.startswith("auto -> bf16-mixed: measured on this node now (not cached): ")
    (line,) = warnings(capsys.readouterr().err)
    assert "is a directory: not used; measured anew" in line


def test_a_crafted_time_is_measured_anew_and_never_reaches_the_reason(loaded, tmp_path, monkeypatch, capsys) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.5, "int8-mixed": 0.7})
    monkeypatch.setattr(auto_precision, "_time", timed)
    path = _entry_for(loaded, tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"measured_utc": "2026-12-01T00:00:00Z" + FAKE}))
    choice = _decide(loaded, tmp_path)
    assert len(calls) == MEASURED and "embedpipe: error" not in choice.reason and "\n" not in choice.reason
    assert choice.reason.startswith(f"auto -> bf16-mixed: measured on this node now (cache {path}): ")
    (line,) = warnings(capsys.readouterr().err)
    assert "not used; measured anew" in line and "rm -rf" not in line
    again = _decide(loaded, tmp_path)  # the entry rewritten by the new measurement: read, not measured
    assert len(calls) == MEASURED and again.reason.startswith("auto -> bf16-mixed: measured on this node at ")


def test_a_world_writable_cache_is_not_used_by_the_job(loaded, tmp_path, monkeypatch, capsys) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.5, "int8-mixed": 0.7})
    monkeypatch.setattr(auto_precision, "_time", timed)
    path = _entry_for(loaded, tmp_path / "cache")
    data = json.loads(path.read_text())  # planted: int8 fastest
    data["timings"]["int8-mixed"]["ms_per_1k_residues"] = 0.001
    path.write_text(json.dumps(data))
    (tmp_path / "cache").chmod(0o777)
    choice = _decide(loaded, tmp_path / "cache")
    assert len(calls) == MEASURED and choice.policy == "bf16-mixed"  # measured here, the planted entry unused
    assert json.loads(path.read_text()) == data and sorted(p.name for p in (tmp_path / "cache").iterdir()) == [path.name]
    (line,) = warnings(capsys.readouterr().err)
    assert "writable by every user" in line


def _named_run(policy: str) -> SimpleNamespace:
    return SimpleNamespace(policy=SimpleNamespace(name=policy), options=AUTO, engine=EngineChoice(), device=CPU,
                           precision_requested="")


def test_a_named_policy_is_never_told_to_use_a_planted_policy(loaded, tmp_path) -> None:
    path = _entry_for(loaded, tmp_path)
    model = ModelIdentity(loaded.sha256, True, {}, loaded.family)
    assert any("bf16-mixed ran 5.0" in n for n in auto_precision.notes(_named_run("fp32"), model, tmp_path, ["table"]))
    data = json.loads(path.read_text())
    data["timings"]["fp16"] = {"ms_per_1k_residues": 0.5, "min_cosine": 1.0}  # no CPU candidate
    path.write_text(json.dumps(data))
    notes = auto_precision.notes(_named_run("fp32"), model, tmp_path, ["the table's note"])
    assert notes[1:] == ["the table's note"] and "not one of this device's candidates" in one_line(notes[0])
    assert not any("fp16 ran" in n or "would choose" in n for n in notes)


def test_a_fifo_entry_never_hangs_a_named_policy_embed(tiny_model_path, tmp_path, monkeypatch, capsys) -> None:
    """A real auto job writes the entry; a FIFO then put in its place; an fp32 job (whose warning
    reads the cache for the same key, found through ``EMBEDPIPE_AUTO_CACHE``) finishes and says
    the entry was not used."""
    cache = tmp_path / "cache"
    fasta = write_fasta(tmp_path / "in.fasta", RECORDS)
    embed_fasta(fasta, model=str(tiny_model_path), out=tmp_path / "auto.h5", quiet=True,  # the tiny job measures
                options=EmbedOptions(precision="auto", device="cpu", auto_cache=str(cache), auto_measure="always"))
    path = entry(cache)
    path.unlink()
    os.mkfifo(path)
    monkeypatch.setenv(AUTO_CACHE_VARIABLE, str(cache))  # the same directory, as a site sets it
    job = threading.Thread(target=embed_fasta, daemon=True, args=(fasta,), kwargs=dict(
        model=str(tiny_model_path), out=tmp_path / "fp32.h5", quiet=False,
        options=EmbedOptions(precision="fp32", device="cpu")))
    job.start()
    job.join(300)
    assert not job.is_alive(), "the fp32 embed blocked on the cache's FIFO"
    assert (tmp_path / "fp32.h5").is_file()
    assert [w for w in warnings(capsys.readouterr().err) if "cached measurement" in w] == \
        [f"warning: {path}: the cached measurement is a FIFO: not used"]


def test_the_directory_is_the_option_else_the_environment_else_the_users_cache(tmp_path, monkeypatch) -> None:
    """Where a node's measurements live is the site's (``EMBEDPIPE_AUTO_CACHE``), not an embed
    flag; the Python API's ``auto_cache`` still names one for its own calls."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(AUTO_CACHE_VARIABLE, raising=False)
    assert job_cache(EmbedOptions()) == tmp_path / "xdg" / "embedpipe" / "auto-precision"
    monkeypatch.setenv(AUTO_CACHE_VARIABLE, "")  # set but empty: not set
    assert job_cache(EmbedOptions()) == tmp_path / "xdg" / "embedpipe" / "auto-precision"
    monkeypatch.setenv(AUTO_CACHE_VARIABLE, str(tmp_path / "site"))
    assert job_cache(EmbedOptions()) == tmp_path / "site"
    assert job_cache(EmbedOptions(auto_cache=str(tmp_path / "mine"))) == tmp_path / "mine"
