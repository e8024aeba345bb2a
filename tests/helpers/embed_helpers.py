"""Shared helpers for embedding tests: write FASTA, run the worker, compute fair-esm references,
and edit test checkpoints."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import h5py
import numpy as np
import torch

from embedpipe.core.errors import ModelError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.model.checkpoint import CONTACT_KEYS, MARKER_KEY, load_checkpoint_safely, upgrade_state_dict
from embedpipe.model.esm2 import any_checkpoint_info, build_model
from embedpipe.model.random_checkpoint import KEY_PREFIX, save
from embedpipe.runtime.engine_override import CHOICES
from helpers.engine import engine_override

AMINO = np.array(list("ACDEFGHIKLMNPQRSTVWY"))


def random_sequences(count: int, lengths: Sequence[int] | tuple[int, int], seed: int = 0,
                     alphabet: np.ndarray = AMINO) -> list[tuple[str, str]]:
    """Deterministic random proteins; ``lengths`` is a (low, high) range or explicit lengths."""
    rng = np.random.default_rng(seed)
    if isinstance(lengths, tuple) and len(lengths) == 2 and count != 2:
        sizes = rng.integers(lengths[0], lengths[1] + 1, size=count)
    else:
        sizes = list(lengths)
    return [(f"rec{i:03d}", "".join(rng.choice(alphabet, int(n)))) for i, n in enumerate(sizes)]


def structure_aware(records: Sequence[tuple[str, str]], seed: int = 0) -> list[tuple[str, str]]:
    """``records`` as SaProt's structure-aware sequences: after each residue a random 3Di state
    (lower case) or ``#`` (masked), two characters a residue."""
    rng = np.random.default_rng(seed)
    states = np.array(list("acdefghiklmnpqrstvwy#"))
    return [(rid, "".join(a + s for a, s in zip(seq, rng.choice(states, len(seq))))) for rid, seq in records]


def write_fasta(path: Path, records: Sequence[tuple[str, str]]) -> Path:
    with open(path, "w") as fh:
        for rid, seq in records:
            fh.write(f">{rid} test record\n")
            for i in range(0, len(seq), 60):
                fh.write(seq[i : i + 60] + "\n")
    return path


def merged_store(tmp: Path, model: Path, records: Sequence[tuple[str, str]] | Path, out: Path, *,
                 tokens_per_shard: int, options: EmbedOptions) -> Path:
    """``records`` (or a FASTA file) as the workflow stores them: sharded (invalid records
    skipped) under ``tmp/shards``, each shard embedded into ``tmp/stores``, merged into ``out``
    with the manifest (aliases and skipped IDs); at least two shards."""
    from embedpipe.shard.passes import shard_fasta
    from embedpipe.store import merge_stores

    fasta = records if isinstance(records, Path) else write_fasta(tmp / "in.fa", records)
    summary = shard_fasta([fasta], out=tmp / "shards", tokens_per_shard=tokens_per_shard, on_invalid="skip",
                          quiet=True)
    assert len(summary.shards) >= 2
    stores = []
    for info in summary.shards:
        stores.append(tmp / "stores" / f"shard-{info.index:05d}.h5")
        embed_fasta(tmp / "shards" / info.path, model=str(model), out=stores[-1], options=options, quiet=True)
    merge_stores(stores, out=out, manifest=tmp / "shards" / "manifest.tsv")
    return out


def embed_store(tmp: Path, model: Path, records: Sequence[tuple[str, str]], name: str = "out", **options) -> Path:
    """Write ``records`` to ``tmp/NAME.fasta`` and embed them (quietly) into ``tmp/NAME.h5``;
    ``options`` are :class:`EmbedOptions` fields, or engine choices (``attention``,
    ``batch_layout``, ...), given through ``EMBEDPIPE_ENGINE`` (helpers/engine.py)."""
    fasta = write_fasta(tmp / f"{name}.fasta", records)
    out = tmp / f"{name}.h5"
    engine = {key: options.pop(key) for key in list(options) if key in CHOICES}
    with engine_override(**engine):
        embed_fasta(fasta, model=str(model), out=out, options=EmbedOptions(**options), quiet=True)
    return out


def unmarked_family(directory: Path, whole_marker: bool = False) -> str:
    """The family ``describe`` gives a copy of ``directory`` whose config.json lacks
    make-test-model's family (``whole_marker``: its whole marker): what the files alone say."""
    from embedpipe.model import describe

    config = json.loads((directory / "config.json").read_text())
    if whole_marker:
        del config[MARKER_KEY]
    else:
        del config[MARKER_KEY]["family"]
    unmarked = directory.parent / "unmarked"
    shutil.copytree(directory, unmarked)
    try:
        (unmarked / "config.json").write_text(json.dumps(config))
        return describe(str(unmarked)).family
    finally:
        shutil.rmtree(unmarked)


def reuse_twins(tmp: Path, model: Path, first: tuple[str, str], twin: str) -> tuple[int, dict, dict]:
    """Embed ``first`` into ``tmp/earlier.h5``, then ``("other", twin)`` and ``("again", first's
    sequence)`` with ``--reuse`` of it: (records reused, the earlier store, the next store)."""
    earlier = embed_store(tmp, model, [first], "earlier", device="cpu", tokens_per_batch=4096)
    summary = embed_fasta(write_fasta(tmp / "next.fasta", [("other", twin), ("again", first[1])]),
                          model=str(model), out=tmp / "next.h5", reuse=[earlier], quiet=True,
                          options=EmbedOptions(device="cpu", tokens_per_batch=4096))
    return summary.reused, read_store(earlier), read_store(tmp / "next.h5")


def embed_and_read(tmp: Path, model: Path, records: Sequence[tuple[str, str]], name: str = "out",
                   **options) -> dict:
    """:func:`embed_store`, then the store as :func:`read_store` reads it."""
    return read_store(embed_store(tmp, model, records, name, **options))


def fair_esm_tokens(model, alphabet, seq: str, layers: Sequence[int]) -> dict[int, np.ndarray]:
    """fair-esm's own forward on one record alone: every token's vector (BOS at 0, EOS last), fp32."""
    converter = alphabet.get_batch_converter()
    _, _, tokens = converter([("x", seq)])
    with torch.no_grad():
        reps = model(tokens, repr_layers=list(layers))["representations"]
    return {k: reps[k][0].float().numpy() for k in layers}


def fair_esm_forward(model, alphabet, seq: str, layers: Sequence[int]) -> dict[int, np.ndarray]:
    """fair-esm's own forward on one record alone: per-residue vectors (BOS/EOS dropped), fp32."""
    return {k: v[1 : len(seq) + 1] for k, v in fair_esm_tokens(model, alphabet, seq, layers).items()}


def fair_esm_bos(model, alphabet, seq: str, layers: Sequence[int]) -> dict[int, np.ndarray]:
    """fair-esm's own forward on one record alone: the BOS token's vector (position 0), fp32."""
    return {k: v[0] for k, v in fair_esm_tokens(model, alphabet, seq, layers).items()}


def flip_byte_in_chunk(path: Path, dataset: str, chunk: int = 0, at: int = 3) -> None:
    """Corrupt one byte of a stored chunk in place (its fletcher32 checksum then fails)."""
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(chunk)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + at)
        byte = fh.read(1)
        fh.seek(info.byte_offset + at)
        fh.write(bytes([byte[0] ^ 0xFF]))


def plain_sequences(f: h5py.File) -> list[str]:
    """A store's sequences by plain h5py: format 2's bytes + offsets, or format 1's padded strings."""
    if isinstance(f["sequence"], h5py.Group):
        data, offsets = f["sequence/data"][()], f["sequence/offsets"][()]
        return [bytes(data[offsets[i] : offsets[i + 1]]).decode("ascii") for i in range(len(offsets) - 1)]
    return [s.decode() if isinstance(s, bytes) else str(s) for s in f["sequence"][()]]


def read_store(path: Path) -> dict:
    """Plain h5py read of a store into dicts keyed by ID (independent of embedpipe.io)."""
    out: dict = {"attrs": {}, "mean": {}, "per_residue": {}, "fields": {}}
    with h5py.File(path, "r") as f:
        out["attrs"] = dict(f.attrs)
        ids = [x.decode() if isinstance(x, bytes) else str(x) for x in f["ids"][()]]
        out["ids"] = ids
        for name in ("precision_used", "fallback_reason", "long_handling"):
            if name in f:
                out["fields"][name] = {
                    i: (v.decode() if isinstance(v, bytes) else str(v)) for i, v in zip(ids, f[name][()])
                }
        for name in ("length", "embedded_length", "windows", "max_abs_activation"):
            if name in f:
                out["fields"][name] = dict(zip(ids, f[name][()].tolist()))
        for key in f["mean"]:
            layer = int(key.split("_")[1])
            matrix = f["mean"][key][()]
            out["mean"][layer] = {i: matrix[n] for n, i in enumerate(ids)}
        if "per_residue" in f and "offsets" in f["per_residue"]:
            offsets = f["per_residue/offsets"][()]
            for key in f["per_residue"]:
                if key == "offsets":
                    continue
                layer = int(key.split("_")[1])
                data = f["per_residue"][key][()]
                out["per_residue"][layer] = {i: data[offsets[n] : offsets[n + 1]] for n, i in enumerate(ids)}
    return out


def edit_test_checkpoint(path: Path, *, token_row_overrides: Mapping[str, float] | None = None,
                         edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
                         key_prefix: str = KEY_PREFIX) -> Path:
    """Rewrite a ``make_test_model`` checkpoint in place with test-only changes.

    ``token_row_overrides`` sets whole rows of ``embed_tokens.weight`` (e.g. ``{"C": 7e4}``);
    ``edit`` gets the unprefixed state dict (tensors aliasing the model's, embed and LM head
    tied) to change in place or replace entries; ``key_prefix`` replaces fair-esm's prefix.
    The marker records what was done. The contact-regression companion is left as it is.
    """
    data = load_checkpoint_safely(path)
    model, alphabet = build_model(any_checkpoint_info(data, where=str(path)), upgrade_state_dict(data["model"]),
                                  where=str(path))
    overrides = dict(token_row_overrides or {})
    for token in overrides:
        if token not in alphabet.tok_to_idx:
            raise ModelError(f"make-test-model: {token!r} is not a token of the ESM-2 alphabet")
    state = model.state_dict()  # detached tensors sharing the model's storage
    with torch.no_grad():
        for token, value in overrides.items():
            state["embed_tokens.weight"][alphabet.get_idx(token)].fill_(float(value))
        if edit is not None:
            edit(state)
            # Entries the hook replaced go back into the model; the tie keeps embed == LM head.
            model.load_state_dict(state, strict=True)
    data["model"] = {key_prefix + k: v for k, v in model.state_dict().items() if k not in CONTACT_KEYS}
    data[MARKER_KEY] |= {"token_row_overrides": {k: float(v) for k, v in overrides.items()}, "edited": edit is not None}
    save(data, Path(path))
    return Path(path)


def overflowing_prot_t5(directory: Path) -> Path:
    """A 2-layer ProtT5 test directory whose 'C' embeds at 7e4 (inf once cast to fp16): the
    records holding a C overflow under fp16, the others do not."""
    import json

    from safetensors.torch import load_file, save_file

    from embedpipe.model.random_hf import make_hf_test_model

    make_hf_test_model(directory, family="prot-t5", layers=2, dim=32, heads=4, seed=2)
    state = load_file(str(directory / "model.safetensors"))
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    state["shared.weight"][[p for p, _ in vocab].index("▁C")] = 7e4
    save_file(state, str(directory / "model.safetensors"))
    return directory


def stored_values(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """Every number a store holds for each record, by plain h5py: id -> {dataset: value}
    (pooled vectors and BOS of every layer, per-residue rows, the largest activation and the
    precision used), for comparing stores bit for bit record by record."""
    out: dict[str, dict[str, np.ndarray]] = {}
    with h5py.File(path, "r") as f:
        ids = [x.decode() if isinstance(x, bytes) else str(x) for x in f["ids"][()]]
        columns = {name: f[name][()] for name in ("max_abs_activation", "precision_used", "fallback_reason")}
        for group in ("mean", "bos"):
            columns |= {f"{group}/{key}": f[group][key][()] for key in f.get(group, {})}
        offsets = f["per_residue/offsets"][()] if "per_residue" in f else None
        rows = {key: f["per_residue"][key][()] for key in f.get("per_residue", {}) if key != "offsets"}
        for n, rid in enumerate(ids):
            out[rid] = {name: np.asarray(values[n]) for name, values in columns.items()}
            if offsets is not None:
                out[rid] |= {f"per_residue/{key}": data[offsets[n]:offsets[n + 1]] for key, data in rows.items()}
    return out


def bitwise_differences(reference: Mapping[str, Mapping[str, np.ndarray]],
                        other: Mapping[str, Mapping[str, np.ndarray]]) -> list[str]:
    """'record dataset: max |diff|' for every value of a record both hold that is not
    bit-identical (NaN equal to NaN); empty when every shared record matches exactly."""
    out = []
    for rid in sorted(set(reference) & set(other)):
        if set(reference[rid]) != set(other[rid]):
            out.append(f"{rid}: datasets {sorted(reference[rid])} != {sorted(other[rid])}")
            continue
        for name, want in reference[rid].items():
            got = other[rid][name]
            same = want.shape == got.shape and (want.tobytes() == got.tobytes())
            if not same:
                diff = float(np.nanmax(np.abs(want.astype(np.float64) - got.astype(np.float64)))) \
                    if want.dtype.kind == "f" and want.shape == got.shape else float("nan")
                out.append(f"{rid} {name}: max |diff| {diff:.3g}")
    return out
