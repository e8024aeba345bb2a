"""benchmarks/_harness.py: the tables' ratios, the record generator, cosine, the process clock and
the machine header, each against a hand computation (no timing is asserted)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _harness as harness  # noqa: E402


def test_table_ratios_against_a_hand_computation():
    rows = [("recipe", 40.0, 800), ("fp32", 20.0, 1600), ("bf16", 16.0, 2000)]
    got = harness.table(("system", "seconds", "residues/s"), rows,
                        [harness.Ratio("seconds", 0, "x recipe"), harness.Ratio("residues/s", 1, "x fp32", False)],
                        formats={"seconds": "{:.1f}"})
    assert got.splitlines() == [
        "| system | seconds | x recipe | residues/s | x fp32 |",
        "|---|---|---|---|---|",
        "| recipe | 40.0 | 1.00 | 800 | 0.50 |",  # 40/40; 800/1600
        "| fp32 | 20.0 | 2.00 | 1,600 | 1.00 |",  # 40/20
        "| bf16 | 16.0 | 2.50 | 2,000 | 1.25 |",  # 40/16; 2000/1600
    ]


def test_table_refuses_a_row_of_the_wrong_width():
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        harness.table(("a", "b", "c"), [(1, 2)])


def test_default_cell_formats():
    assert harness.table(("x",), [(1234567,), (3.14159,), (123.456,), (float("nan"),), ("text",)]).splitlines()[2:] == [
        "| 1,234,567 |", "| 3.142 |", "| 123.5 |", "| - |", "| text |"]


def test_records_are_deterministic_and_draw_on_from_a_generator():
    a = harness.random_records([5, 0, 12], seed=3, prefix="p")
    assert a == harness.random_records([5, 0, 12], seed=3, prefix="p")
    assert [rid for rid, _ in a] == ["p00000", "p00001", "p00002"]
    assert [len(s) for _, s in a] == [5, 0, 12]
    assert set("".join(s for _, s in a)) <= set("ACDEFGHIKLMNPQRSTVWY")
    assert a != harness.random_records([5, 0, 12], seed=4, prefix="p")
    # a generator goes on from where it stands: the same draws as numpy's own choice
    rng, ref = np.random.default_rng(7), np.random.default_rng(7)
    rng.integers(0, 10, 3), ref.integers(0, 10, 3)
    assert harness.random_records([4], seed=rng)[0][1] == "".join(ref.choice(list("ACDEFGHIKLMNPQRSTVWY"), 4))


def test_lognormal_lengths_are_clipped_and_deterministic():
    lengths = harness.lognormal_lengths(500, 300, seed=0)
    assert lengths == harness.lognormal_lengths(500, 300, seed=0)
    assert min(lengths) >= 20 and max(lengths) <= 1022
    assert 250 < float(np.median(lengths)) < 350


def test_cosine_against_a_hand_computation():
    assert harness.cosine(np.array([1.0, 0.0]), np.array([1.0, 1.0])) == pytest.approx(1 / 2**0.5)
    assert harness.cosine(np.array([3, 4], dtype=np.float16), np.array([-3, -4], dtype=np.float32)) == pytest.approx(-1)


def test_engine_env_pins_only_what_is_not_auto(monkeypatch):
    monkeypatch.setenv("EMBEDPIPE_ENGINE", "attention=math")
    env = harness.engine_env(batch_layout="padded", attention_inputs="auto")
    assert env["EMBEDPIPE_ENGINE"] == "batch_layout=padded"
    assert "EMBEDPIPE_ENGINE" not in harness.engine_env(batch_layout="auto")
    with harness.pinned_engine(batch_layout="packed", attention_inputs="fp32"):
        assert os.environ["EMBEDPIPE_ENGINE"] == "batch_layout=packed,attention_inputs=fp32"
    assert os.environ["EMBEDPIPE_ENGINE"] == "attention=math"


def test_a_child_reports_its_own_peak_memory_not_the_parents(tmp_path):
    """A child forked straight from a large process inherits its peak RSS; the launcher's does not."""
    ballast = np.ones(300 * 2**20 // 8)  # 300 MiB held by this process while the child runs
    done = harness.run_process([sys.executable, "-c", "print('hi')"], capture=True)
    assert ballast.sum() > 0
    assert done.returncode == 0 and done.stdout == "hi\n"
    assert done.peak_rss_mib < 150  # a bare Python: tens of MiB, not this process's 300+
    assert done.seconds > 0


def test_a_failing_process_is_named_and_a_stopped_one_is_marked(tmp_path):
    with pytest.raises(SystemExit, match="failed \\(3\\)"):
        harness.run_process([sys.executable, "-c", "import sys; sys.exit(3)"], capture=True)
    stopped = harness.run_process([sys.executable, "-c", "import time; time.sleep(30)"], limit=0.5)
    assert stopped.returncode == -9 and stopped.seconds != stopped.seconds  # nan


def test_time_call_counts_rounds_and_warmup():
    calls: list[int] = []
    timing = harness.time_call(lambda: calls.append(1), rounds=3, warmup=2)
    assert len(calls) == 5 and len(timing.seconds) == 3
    assert timing.best <= timing.median


def test_machine_header_reads_the_cpu_model_and_deciding_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 fma avx512_bf16 amx_int8\n"
                       "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n")
    assert harness.cpu_model(cpuinfo) == ("Test CPU 9000", ["avx2", "fma", "avx512_bf16", "amx_int8"])
    header = harness.machine_header(["--rounds", "2"], cpuinfo=cpuinfo)
    assert "machine: Test CPU 9000" in header and "flags avx2 fma avx512_bf16 amx_int8" in header
    assert "command: --rounds 2" in header and "torch " in header
