"""The Python API's shape: every public function and method takes named, annotated parameters
(no ``*args``/``**kwargs``), the Embedder names the options a user decides and takes
``EmbedOptions`` for the rest, and what it returns (``Result``, ``Hits``) is plain data that
cannot be changed. mypy's view of the same API: tests/api/test_api_types.py."""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable

import numpy as np
import pytest

import embedpipe
from embedpipe.api.result import result_of
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.store import EmbeddedRecord

#: the keywords a user decides, named on the Embedder (the rest: options=EmbedOptions(...))
USER_CHOICES = ("precision", "layers", "pooling", "per_residue", "storage_dtype", "device")


def _problems(function: Callable[..., object], name: str) -> list[str]:
    """What makes ``function`` untyped or open-ended: a ``*args``/``**kwargs`` parameter, or a
    parameter or return without an annotation that resolves."""
    out = []
    signature = inspect.signature(function)
    hints = typing.get_type_hints(function)
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            out.append(f"{name}: takes {'*' if parameter.kind is parameter.VAR_POSITIONAL else '**'}{parameter.name}")
        elif parameter.name != "self" and parameter.name not in hints:
            out.append(f"{name}: parameter {parameter.name!r} is not annotated")
    if "return" not in hints:
        out.append(f"{name}: its return is not annotated")
    return out


def _public(cls: type) -> dict[str, Callable[..., object]]:
    """The methods a user calls on ``cls`` (the constructor and context manager too) and the getters of its properties."""
    out: dict[str, Callable[..., object]] = {}
    for name, member in inspect.getmembers(cls):
        if isinstance(member, property) and not name.startswith("_") and member.fget is not None:
            out[f"{cls.__name__}.{name}"] = member.fget
        elif inspect.isfunction(member) and (not name.startswith("_") or name in ("__init__", "__enter__", "__exit__")):
            out[f"{cls.__name__}.{name}"] = member
    return out


def _api() -> dict[str, Callable[..., object]]:
    """Every function of ``embedpipe.__all__``, every class's constructor, and the public methods
    of the Embedder and what it returns."""
    out: dict[str, Callable[..., object]] = {}
    for name in embedpipe.__all__:
        value = getattr(embedpipe, name)
        if inspect.isfunction(value):
            out[name] = value
        elif inspect.isclass(value) and not issubclass(value, BaseException):
            out[f"{name}.__init__"] = value.__init__
    for cls in (embedpipe.Embedder, embedpipe.Result, embedpipe.Hits):
        out |= _public(cls)
    return out


def test_the_check_finds_an_open_or_untyped_signature() -> None:
    def open_ended(a, *args: int, **kwargs: object) -> None:  # type: ignore[no-untyped-def]
        pass

    assert _problems(open_ended, "f") == ["f: parameter 'a' is not annotated", "f: takes *args", "f: takes **kwargs"]
    assert _problems(lambda: None, "g") == ["g: its return is not annotated"]


def test_every_public_callable_takes_named_annotated_parameters() -> None:
    api = _api()
    assert {"embed", "search", "read_fasta", "Embedder.__init__", "Embedder.embed", "Embedder.search",
            "Result.mean", "Result.per_residue", "Result.save", "Hits.write_tsv", "Hits.rows"} <= set(api)
    assert [problem for name, function in api.items() for problem in _problems(function, name)] == []


def test_each_root_name_is_the_object_it_names_every_time() -> None:
    """``embedpipe.X`` is the API's X, not a subpackage of that name (which takes the
    package's attribute once imported)."""
    import embedpipe.api as api

    for name in embedpipe.__all__:
        first, again = getattr(embedpipe, name), getattr(embedpipe, name)
        assert first is again and not isinstance(first, types.ModuleType), name
        if name in api.__all__:
            assert first is getattr(api, name), name


def test_the_embedder_names_the_user_choices_and_takes_options_for_the_rest() -> None:
    parameters = inspect.signature(embedpipe.Embedder).parameters
    keywords = [n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY]
    assert keywords == [*USER_CHOICES, "options", "quiet", "limits"]
    assert set(USER_CHOICES) <= {f.name for f in dataclasses.fields(EmbedOptions)}
    assert typing.get_type_hints(embedpipe.Embedder.__init__)["options"] == EmbedOptions | None
    # the one-call form takes the same keywords, in the same order, with the same types
    one_call = inspect.signature(embedpipe.embed).parameters
    assert [n for n, p in one_call.items() if p.kind is p.KEYWORD_ONLY] == keywords
    hints, one_call_hints = typing.get_type_hints(embedpipe.Embedder.__init__), typing.get_type_hints(embedpipe.embed)
    assert all(hints[name] == one_call_hints[name] for name in keywords)


def test_a_keyword_merges_with_options_and_a_disagreement_is_one_line(tiny_model_path) -> None:
    merged = embedpipe.Embedder(tiny_model_path, precision="bf16-mixed", layers=2, pooling="bos",
                                options=EmbedOptions(threads=2, layers=(2,)))
    assert merged.options == EmbedOptions(precision="bf16-mixed", layers=(2,), pooling=("bos",), threads=2)
    assert embedpipe.Embedder(tiny_model_path, layers=[0, 1]).options.layers == (0, 1)
    assert embedpipe.Embedder(tiny_model_path, options=EmbedOptions(precision="fp16")).options.precision == "fp16"
    with pytest.raises(EmbedpipeError) as caught:
        embedpipe.Embedder(tiny_model_path, precision="bf16-mixed", options=EmbedOptions(precision="fp16-mixed"))
    assert str(caught.value) == ("Embedder: precision='bf16-mixed' and options.precision='fp16-mixed' disagree; "
                                 "give it once")
    refusals = [
        (dict(options=EmbedOptions(accept_platform_mix=True)), "options.accept_platform_mix is for the stores"),
        (dict(options={"threads": 2}), "options must be an embedpipe.EmbedOptions, not dict"),
        (dict(layers="x"), "layers must be a layer index or a sequence of them, not 'x'"),
        (dict(layers=True), "layers must be a layer index"),
        (dict(pooling=[1]), "pooling must be a name or a sequence of names"),
        (dict(per_residue="yes"), "per_residue must be True or False"),
    ]
    for given, words in refusals:
        with pytest.raises(EmbedpipeError, match=words) as caught:
            embedpipe.Embedder(tiny_model_path, **given)
        assert "\n" not in str(caught.value)


def test_search_by_ids_refuses_options_of_embedding() -> None:
    with pytest.raises(EmbedpipeError, match=r"^search: options= is for queries"):
        embedpipe.search(index="any.index", ids=["P1"], options=EmbedOptions())


@pytest.fixture(scope="module")
def result(tiny_model_path) -> embedpipe.Result:
    return embedpipe.embed([("a", "MKTAYIAK"), ("b", "GSHM")], tiny_model_path, layers=(0, -1), pooling="bos",
                           per_residue=True, device="cpu")


def test_a_result_is_frozen_plain_data(result: embedpipe.Result) -> None:
    assert dataclasses.is_dataclass(result) and type(result).__dataclass_params__.frozen  # type: ignore[attr-defined]
    public = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if not f.name.startswith("_")}
    assert set(public) == {"ids", "sequences", "precision_used", "fallback_reason", "rows", "layers", "pooling",
                           "storage_dtype", "identity", "provenance"}
    for name, value in public.items():
        if isinstance(value, tuple):
            assert all(isinstance(v, (str, int)) for v in value), name
        else:
            assert isinstance(value, (str, types.MappingProxyType)), name
    assert not hasattr(result, "run") and not hasattr(result, "records")
    assert result.ids == ("a", "b") and result.sequences == ("MKTAYIAK", "GSHM") and result.pooling == ("mean", "bos")
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.ids = ("c",)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.anything = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="does not support item assignment"):
        result.provenance["precision_policy"] = "fp16"  # type: ignore[index]
    with pytest.raises(TypeError, match="does not support item assignment"):
        result.rows["c"] = 2  # type: ignore[index]
    for array in (result.mean(), result.bos(0), result.pooled(-1, "mean"), result.per_residue("a"),
                  result.per_residue(1, 0)):
        assert not array.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0] = 1.0
    with pytest.raises(TypeError, match="made by Embedder.embed"):
        embedpipe.Result()


def test_a_result_looks_records_up_by_id_in_one_table(result: embedpipe.Result) -> None:
    """10,000 records: ``rows`` is one mapping of every ID to its row, built once with the
    result; ``per_residue(ID)`` gives that row's record."""
    layer = result.layers[-1]
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((10_000, 3, 4)).astype(np.float32)
    records = [EmbeddedRecord(f"r{i}", "MKV", "fp32", mean={layer: v.mean(0)}, per_residue={layer: v})
               for i, v in enumerate(vectors)]
    big = result_of(records, result._run, result.provenance)
    assert isinstance(big.rows, types.MappingProxyType) and big.rows is big.rows
    assert dict(big.rows) == {f"r{i}": i for i in range(10_000)}
    assert big.per_residue("r9876").tobytes() == vectors[9876].tobytes()
    assert big.mean()[9876].tobytes() == vectors[9876].mean(0).tobytes()


def test_hits_are_frozen_plain_data_and_their_tsv_is_unchanged(tmp_path) -> None:
    scores = np.array([[0.9, 0.25], [0.5, np.nan]], dtype=np.float32)
    hits = embedpipe.Hits(("q1", "q2"), (("a", "b"), ("c",)), scores)
    scores[0, 0] = 0.0  # the caller's array is not the hits' scores
    assert hits.scores[0, 0] == np.float32(0.9) and not hits.scores.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        hits.scores[0, 0] = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        hits.hits = ()  # type: ignore[misc]
    assert hits.write_tsv(tmp_path / "h.tsv").read_text() == \
        "query\thit\tscore\trank\nq1\ta\t0.9\t1\nq1\tb\t0.25\t2\nq2\tc\t0.5\t1\n"
    grouped = embedpipe.Hits(("q1",), (("a",),), np.array([[0.75]], dtype=np.float32), groups=((("a", "a2"),),))
    assert grouped.to_tsv() == "query\thit\tscore\trank\tgroup\nq1\ta\t0.75\t1\ta a2\n"
