"""The one precision table (embedpipe/data/auto_precision_table.json, read by
embedpipe/runtime/advice.py): docs/precision.md shows it as it is, its numbers are
docs/benchmarks.md's, a malformed file is refused in one line naming the row, the warnings and
``--precision auto`` (embedpipe/extraction/auto_precision.py) follow it, and an ``auto`` store
records the request, the choice and why."""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction import auto_precision
from embedpipe.runtime import advice
from embedpipe.runtime.cpu_features import CpuFeatures
from embedpipe.runtime.precision import CUDA_CAPABILITY, POLICIES
from helpers.embed_helpers import embed_store, random_sequences, read_store

DOCS = Path(__file__).resolve().parents[2] / "docs"
AMX = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_fp16", "avx512_vnni"}))
ZEN5 = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni"}))  # no AMX, no FP16
CASCADE = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni"}))
CPU = torch.device("cpu")
ESM2_35M = 35_000_000  # the model most rows were measured on ("35M", "12 x 480 ESM-2")


def test_docs_precision_shows_the_table_the_code_uses() -> None:
    text = (DOCS / "precision.md").read_text()
    found = re.search(r"<!-- advice-table: embedpipe/data/auto_precision_table.json -->\n(.*?)\n<!-- /advice-table -->",
                      text, re.S)
    assert found, "docs/precision.md lost its advice-table markers"
    assert found[1] == advice.markdown_table()


def test_every_measured_factor_and_cited_section_is_in_docs_benchmarks() -> None:
    benchmarks = (DOCS / "benchmarks.md").read_text()
    headings = re.findall(r"^#+ (.*)$", benchmarks, re.M)
    for entry in advice.ADVICE.values():
        if entry.factor is not None:
            assert f"{entry.factor:.2f}" in benchmarks, entry.cpu_class
        for text in (entry.measured, *entry.not_advised.values()):
            for section in re.findall(r'docs/benchmarks.md, "([^"]+)"', text):
                assert any(h.startswith(section) for h in headings), (entry.cpu_class, section)


def test_where_bf16_is_native_int8_mixed_is_not_advised_and_bf16_mixed_is() -> None:
    # AMX: int8-mixed not faster (and collapsed on a loaded node); Zen 5: not faster at the 650M shape
    for cpu in (AMX, ZEN5):
        assert advice.fastest_policy(cpu)[0] == "bf16-mixed"
        assert "int8-mixed" in advice.advice_for(cpu).not_advised
        assert "bf16-mixed" in POLICIES["int8-mixed"].check_device(CPU, cpu)[0]
        assert POLICIES["bf16-mixed"].check_device(CPU, cpu) == []
    assert advice.fastest_policy(CASCADE)[0] == "fp32"  # its row was emulated only: no advice from it


def test_every_row_says_how_it_was_measured_and_only_real_measurements_advise() -> None:
    for row in advice.ADVICE.values():
        assert row.basis in (advice.REAL, advice.EMULATED, advice.NOT_MEASURED)
        if row.basis == advice.REAL:  # names the real CPU it ran on
            assert row.factor is not None and "real" in row.measured
        else:
            assert "real" not in row.measured.replace("never on a real", "")
            cpu = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni"} if row.cpu_class == "int8-dot" else set()))
            if cpu.cpu_class == row.cpu_class:
                assert auto_precision.cpu_choice(cpu, params=row.model_params or ESM2_35M)[0] == "fp32"
    assert "emulated only" in advice.markdown_table() and "not measured" in advice.markdown_table()


def test_the_warnings_name_the_advised_policy_on_an_amx_cpu() -> None:
    for name in ("fp16", "fp16-mixed", "int8-mixed"):
        notes = POLICIES[name].check_device(CPU, AMX)
        assert len(notes) == 1 and "bf16-mixed, 1.84x fp32's speed" in notes[0] and name in notes[0], name
        assert advice.MEASURE in notes[0]
    assert "no faster than fp32" in POLICIES["fp16"].check_device(CPU, AMX)[0]
    assert POLICIES["bf16-mixed"].check_device(CPU, AMX) == POLICIES["fp32"].check_device(CPU, AMX) == []


def test_the_prior_on_the_cpu_is_the_advised_policy_where_a_real_cpu_measured_it_at_a_similar_size() -> None:
    for cpu in (AMX, ZEN5, CASCADE, CpuFeatures(frozenset({"avx2"})), CpuFeatures()):
        row = advice.advice_for(cpu)
        assert (row.model_params is not None) == (row.factor is not None)  # a measured row records its size
        size = row.model_params or ESM2_35M
        policy, why = auto_precision.cpu_choice(cpu, params=size)
        assert policy == (row.advised if row.trusted else "fp32")
        assert f"CPU class {cpu.cpu_class} (flags: {cpu.named()})" in why
        for far in (size // 5, size * 5, None):  # not within 4x, or not known: fp32, and says so
            policy, why = auto_precision.cpu_choice(cpu, params=far)
            assert policy == "fp32" and why.startswith("the table has no row") and "measures regardless" in why


def test_the_rows_record_the_model_size_their_factor_was_measured_at() -> None:
    assert advice.ADVICE["avx512_bf16"].model_params == 650_000_000  # "650M shape"
    for name in ("amx", "avx2", "int8-dot"):
        assert advice.ADVICE[name].model_params == ESM2_35M  # "35M", "12 x 480 ESM-2"
    assert "model size measured" in advice.markdown_table() and "650M parameters" in advice.markdown_table()


@pytest.mark.parametrize(("capability", "want", "candidates"), [
    ((9, 0), "bf16-mixed", ("fp32", "bf16-mixed", "fp16-mixed")), ((8, 0), "bf16-mixed", ("fp32", "bf16-mixed", "fp16-mixed")),
    ((7, 5), "fp16-mixed", ("fp32", "fp16-mixed")), ((5, 3), "fp16-mixed", ("fp32", "fp16-mixed")), ((5, 2), "fp32", ("fp32",))])
def test_auto_on_cuda_measures_what_the_gpu_computes_natively(monkeypatch, capability, want, candidates) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Some GPU")
    assert auto_precision.candidates(torch.device("cuda")) == candidates
    policy, why = auto_precision.prior(torch.device("cuda"))
    assert policy == want and f"Some GPU, compute capability {capability[0]}.{capability[1]}" in why
    for name in candidates:  # the thresholds are the ones the policies' own CUDA check refuses below
        need = CUDA_CAPABILITY.get(POLICIES[name].compute_dtype)
        assert need is None or capability >= need
        assert POLICIES[name].check_device(torch.device("cuda")) == []


def test_auto_never_chooses_what_the_other_options_exclude() -> None:
    from embedpipe.extraction.auto_precision import usable_candidates
    from embedpipe.extraction.resolved import resolve_run
    from embedpipe.model.identity import ModelIdentity
    from embedpipe.runtime.engine_override import EngineChoice

    fair = EmbedOptions(precision="auto", device="cpu")
    assert usable_candidates(EngineChoice(attention="fair-esm"), CPU) == ["fp32"]  # fair-esm's forward has no fp32 islands
    assert usable_candidates(EngineChoice(), CPU) == list(auto_precision.CPU_CANDIDATES)
    # a choice the options exclude (here the table's prior, planted) is refused in one line
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auto_precision, "prior", lambda device, cpu=None, **_: ("bf16-mixed", "a planted prior"))
        with pytest.raises(EmbedpipeError, match=r"^--precision auto chose bf16-mixed on this machine, but [^\n]*"
                                                 r"fair-esm[^\n]*name a policy with --precision$"):
            resolve_run(fair, CPU, num_layers=2, packs=True, model=ModelIdentity("0" * 64, True), width=32,
                        engine=EngineChoice(attention="fair-esm"), measure=lambda *_: auto_precision.from_table(CPU))
    # outside a job nothing decides auto: resolve_run refuses it rather than guess
    with pytest.raises(EmbedpipeError, match="^--precision auto is decided by an embed job"):
        resolve_run(fair, CPU, num_layers=2, packs=True, model=ModelIdentity("0" * 64, True), width=32)
    with pytest.raises(EmbedpipeError, match="applies to --precision int8-mixed only, not auto"):
        EmbedOptions(precision="auto", int8_smoothing="smoothquant").validate()


def test_a_small_auto_job_takes_the_prior_records_why_and_holds_what_that_policy_computes(tiny_model_path,
                                                                                           tmp_path) -> None:
    records = random_sequences(4, (20, 60), seed=5)
    auto = embed_store(tmp_path, tiny_model_path, records, "auto", precision="auto", device="cpu")
    from embedpipe.extraction.auto_precision import model_params
    from embedpipe.model import load_model

    policy, why = auto_precision.prior(CPU, params=model_params(load_model(str(tiny_model_path))))
    assert policy == "fp32"  # the 2-layer test model: no table row was measured at a similar size
    named = embed_store(tmp_path, tiny_model_path, records, "named", precision=policy, device="cpu")
    got, want = read_store(auto), read_store(named)
    with h5py.File(auto, "r") as f, h5py.File(named, "r") as g:
        assert (f.attrs["precision_policy"], f.attrs["precision_requested"]) == (policy, "auto")
        reason = str(f.attrs["precision_reason"])
        assert reason.startswith(f"auto -> {policy}: not measured (the job is too small to pay for the probe")
        assert reason.endswith(f"; {why}")
        assert f.attrs["embed_identity"] == g.attrs["embed_identity"]  # resume and --reuse see the policy
        assert "precision_requested" not in g.attrs
    for layer, vectors in want["mean"].items():
        for rid, vector in vectors.items():
            np.testing.assert_array_equal(got["mean"][layer][rid], vector)


def test_the_table_ships_with_the_package_and_a_malformed_one_is_refused_naming_its_row(tmp_path) -> None:
    import fnmatch
    import json

    data = re.search(r"^embedpipe = (\[.*\])$", (DOCS.parent / "pyproject.toml").read_text(), re.M)
    assert data, "pyproject.toml lost the package's data files"
    relative = advice.TABLE.relative_to(DOCS.parent / "embedpipe").as_posix()
    assert any(fnmatch.fnmatch(relative, pattern) for pattern in json.loads(data[1]))  # a wheel carries it
    assert advice.read_table(advice.TABLE) == (advice.ADVICE, advice.CUDA_CHOICES)
    good = json.loads(advice.TABLE.read_text())

    def broken(change) -> dict:
        table = json.loads(json.dumps(good))
        change(table)
        return table

    cases = {
        r"cpu row 2: factor \(a positive number\) and model_params": broken(lambda t: t["cpu"][1].pop("model_params")),
        r"cpu row 1: 'bf17' is not a precision policy": broken(lambda t: t["cpu"][0].update(advised="bf17")),
        r"cpu row 3: basis must be one of real, emulated, none": broken(lambda t: t["cpu"][2].update(basis="guessed")),
        r"cpu row 1 not_advised 1: needs the fields policies, why": broken(
            lambda t: t["cpu"][0]["not_advised"][0].update(names=t["cpu"][0]["not_advised"][0].pop("policies"))),
        r"one cpu row per class, `other` among them": broken(lambda t: t["cpu"][-1].update({"class": "avx2"})),
        r"from the highest capability down to \[0, 0\]": broken(lambda t: t["cuda"][-1].update(capability=[9, 0])),
        r"needs the fields cpu, cuda": broken(lambda t: t.pop("cuda")),
    }
    path = tmp_path / "table.json"
    for message, table in cases.items():
        path.write_text(json.dumps(table))
        with pytest.raises(EmbedpipeError, match=rf"^{re.escape(str(path))}: .*{message}") as refused:
            advice.read_table(path)
        assert "\n" not in str(refused.value)
    path.write_text(json.dumps(good)[:-2])
    with pytest.raises(EmbedpipeError, match=rf"^{re.escape(str(path))}: cannot read the precision table \("):
        advice.read_table(path)
