"""Each decision of an embed job is made once, by ``resolve_run`` (docs/architecture.md, "The
embed run"): over a group job of three shards the options are checked once, the threads counted
once, the engine override read once, the token budget sized once, the run resolved once, and
``--precision auto`` decided once; the override's choices are what the store records. The counts
are of calls to the deciding functions, patched to count and then do their work."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import pytest

import embedpipe.extraction.job as job_module
import embedpipe.extraction.resolved as resolved_module
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction import auto_precision
from embedpipe.extraction.run import embed_shards
from embedpipe.runtime import engine_override
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.engine import engine_override as override


def _shards(tmp: Path, n: int = 3) -> list[Path]:
    return [write_fasta(tmp / f"shard-{k}.fasta", random_sequences(3, (8, 40), seed=20 + k)) for k in range(n)]


def _counting(monkeypatch: pytest.MonkeyPatch, calls: Counter, owner: Any, name: str) -> None:
    real: Callable[..., Any] = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_a_group_job_decides_each_thing_once(tmp_path, tiny_model_path, monkeypatch, precision) -> None:
    calls: Counter = Counter()
    for owner, name in ((EmbedOptions, "validate"), (resolved_module, "thread_count"),
                        (engine_override, "from_environment"), (resolved_module, "resolve_tokens_per_batch"),
                        (job_module, "resolve_run"), (auto_precision, "decide")):
        _counting(monkeypatch, calls, owner, name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    summary = embed_shards(_shards(tmp_path), model=str(tiny_model_path), out_dir=tmp_path / "stores", quiet=True,
                           options=EmbedOptions(device="cpu", precision=precision, auto_cache=str(tmp_path / "auto")))
    assert len(summary.embedded) == 3
    # auto: the job's own run, plus one per candidate only if it measures (a job this small takes the prior)
    assert calls == Counter({"validate": 1, "thread_count": 1, "from_environment": 1, "resolve_tokens_per_batch": 1,
                             "resolve_run": 1, **({"decide": 1} if precision == "auto" else {})})


def test_the_override_is_what_the_store_records_and_its_identity_holds(tmp_path, tiny_model_path) -> None:
    shards = _shards(tmp_path, 1)
    out = tmp_path / "stores"
    embed_shards(shards, model=str(tiny_model_path), out_dir=out, quiet=True, options=EmbedOptions(device="cpu"))
    with h5py.File(out / "shard-0.h5", "r") as f:
        derived = {k: str(f.attrs[k]) for k in ("attention", "attention_path", "batch_layout", "attention_inputs")}
        assert json.loads(f.attrs["embed_identity"])["attention"] == "sdpa"
    assert derived == {"attention": "sdpa", "attention_path": "padded-sdpa", "batch_layout": "padded",
                       "attention_inputs": "float32"}
    with override(attention="math"):
        again = embed_shards(shards, model=str(tiny_model_path), out_dir=out, quiet=True,
                             options=EmbedOptions(device="cpu"))
    assert len(again.embedded) == 1 and not again.kept  # another kernel: other numbers, embedded again
    with h5py.File(out / "shard-0.h5", "r") as f:
        assert (str(f.attrs["attention"]), str(f.attrs["attention_path"])) == ("math", "padded-math")
        assert json.loads(f.attrs["embed_identity"])["attention"] == "math"
        assert "attention" not in json.loads(f.attrs["config"])  # not an option


def test_a_bad_override_stops_the_job_in_one_line_before_any_store(tmp_path, tiny_model_path) -> None:
    from embedpipe.core.errors import EmbedpipeError

    with override(batch_layout="sideways"), pytest.raises(EmbedpipeError) as refused:
        embed_shards(_shards(tmp_path, 1), model=str(tiny_model_path), out_dir=tmp_path / "stores", quiet=True,
                     options=EmbedOptions(device="cpu"))
    assert str(refused.value) == "EMBEDPIPE_ENGINE: batch_layout must be one of auto, packed, padded, not 'sideways'"
    assert not (tmp_path / "stores" / "shard-0.h5").exists()
