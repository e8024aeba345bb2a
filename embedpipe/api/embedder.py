"""``embedpipe.Embedder`` and ``embedpipe.embed``: sequences held in memory embedded in
process, with the guarantees of ``embedpipe embed``.

Why it goes through the job: the options are checked, the policy configured, the device
claimed, the model loaded and the run resolved by the very functions ``embed`` uses
(:mod:`embedpipe.extraction.run`'s checks, :func:`embedpipe.extraction.job.open_job`, and through it
:func:`~embedpipe.extraction.resolved.resolve_run`), so the same records and options give the same
bits as the CLI's store. The model stays loaded between calls until :meth:`Embedder.close`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Union

from embedpipe.api.choices import merged_options
from embedpipe.api.compatible import check_compatible
from embedpipe.api.reading import fasta_path, read_fasta
from embedpipe.api.result import Result, result_of
from embedpipe.core.checksums import file_sha256
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import FASTA_LIMITS, EmbedOptions, FastaLimits
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.job import JobInput, open_job
from embedpipe.extraction.provenance import provenance
from embedpipe.extraction.run import run_attrs, start_checks  # the checks and root attributes `embed` makes
from embedpipe.inputs.fasta import check_regular_file
from embedpipe.inputs.memory import Sequences, check_records
from embedpipe.model.registry import model_files
from embedpipe.neighbours.hits import Hits, check_k, search_index
from embedpipe.neighbours.index_file import LoadedIndex, open_index
from embedpipe.neighbours.stored import alias_groups, filtered_search
from embedpipe.store import EmbeddedRecord

__all__ = ["Embedder", "Input", "embed"]

#: what ``embed`` and ``search`` take: sequences held in memory, or a FASTA file
#: (:func:`~embedpipe.api.reading.fasta_path`: a ``pathlib.Path``, or a str naming an existing ``.fasta`` file)
Input = Union[Sequences, str, "os.PathLike[str]"]


class Embedder:
    """A model loaded once (at the first call), with one set of ``embed`` options, resolved once.

    ``Embedder(model, precision="bf16-mixed", layers=-1)`` takes the model spec of ``embed
    --model`` and, as keywords, the options a user decides: ``precision`` (a policy, or
    ``"auto"``), ``layers`` (an index or several; negative from the last), ``pooling``
    (``"bos"`` stores BOS vectors besides the mean), ``per_residue``, ``storage_dtype`` and
    ``device``. Each left None is ``options``' (an :class:`~embedpipe.core.options.EmbedOptions`,
    which holds the rest of ``embed``'s options: batch budget, threads, long sequences, int8
    smoothing, ...); a keyword and a field set in ``options`` that disagree are refused. Use it
    as a context manager, or call :meth:`close`, to release the model. ``quiet=False`` shows
    progress and the job's notes; ``limits``: the input limits of ``--max-record-length`` and
    ``--max-id-length``."""

    def __init__(self, model: str | os.PathLike[str], *, precision: str | None = None,
                 layers: int | Sequence[int] | None = None, pooling: str | Sequence[str] | None = None,
                 per_residue: bool | None = None, storage_dtype: str | None = None, device: str | None = None,
                 options: EmbedOptions | None = None, quiet: bool = True, limits: FastaLimits = FASTA_LIMITS) -> None:
        named = {"precision": precision, "layers": layers, "pooling": pooling, "per_residue": per_residue,
                 "storage_dtype": storage_dtype, "device": device}
        self._model = str(model)
        self._options = EmbedOptions(**merged_options("Embedder", options, named))
        self._quiet = quiet
        # embed's checks, before the model loads; the limits as the family reads records (ProstT5 keeps case)
        self._policy, self._limits = start_checks([], self._model, self._options, (), limits)
        self._model_files = model_files(self._model)
        self._stack = contextlib.ExitStack()
        self._engine: Engine | None = None
        self._closed = False

    @property
    def model(self) -> str:
        """The model spec, as ``embed --model`` takes it."""
        return self._model

    @property
    def options(self) -> EmbedOptions:
        """The options every call embeds with: ``options`` with the keywords given."""
        return self._options

    @property
    def limits(self) -> FastaLimits:
        """The input limits, as the model's family reads records (case kept for ProstT5, SaProt's pairs)."""
        return self._limits

    @property
    def loaded(self) -> bool:
        """Whether the model is loaded (at the first call, until :meth:`close`)."""
        return self._engine is not None

    def _engine_for(self, records: list[tuple[str, str]]) -> Engine:
        """The engine, its model loaded and its run resolved at the first call, as ``embed`` does
        for a FASTA of these records (``--precision auto`` probes them, the job's residues are
        theirs); later calls reuse it."""
        if self._closed:
            raise EmbedpipeError("this Embedder is closed: its model was released; make a new one")
        if self._engine is None:
            job = self._stack.enter_context(open_job(self._model, self._options, self._policy, (), self._quiet,
                                                     JobInput(limits=self._limits, records=tuple(records))))
            self._engine = job.engine()  # the device claimed, the model loaded, the run resolved
        return self._engine

    def embed(self, sequences: Input) -> Result:
        """Embed ``sequences`` (a list of sequences, of ``(id, sequence)`` pairs, or a dict of them),
        or the records of a FASTA file: a ``pathlib.Path``, or a str naming an existing file
        ending in ``.fa``, ``.fasta``, ``.faa`` or ``.fas`` (``.gz`` too), read by
        :func:`~embedpipe.api.reading.read_fasta` with this Embedder's rules; the records come
        back in input order. A record ``embed`` would refuse in a FASTA is refused in one line
        naming it, before anything is computed. A file's result records it as ``embed`` does
        (``config.input``, ``input_sha256``)."""
        path = fasta_path(sequences)
        if path is None:
            return self._embed(check_records(sequences, self._limits))  # type: ignore[arg-type]
        check_regular_file(path, "Embedder.embed", "it reads the records, then the file again for the input_sha256 "
                           "its result records")
        records = read_fasta(path, self)
        return self._embed(records, path, {"input_sha256": file_sha256(path)})

    def _records(self, sequences: Input) -> list[tuple[str, str]]:
        """The records of ``sequences``, or of the FASTA file it names, under this Embedder's rules."""
        path = fasta_path(sequences)
        return check_records(sequences, self._limits) if path is None else read_fasta(path, self)  # type: ignore[arg-type]

    def _embed(self, records: list[tuple[str, str]], source: Path | None = None,
               extra: dict[str, str] | None = None) -> Result:
        engine = self._engine_for(records)
        engine.new_input()
        plan = engine.plan(records)
        done: list[EmbeddedRecord | None] = [None] * len(records)
        with contextlib.closing(engine.embed(records, plan, quiet=self._quiet)) as results:
            for j, record in results:
                done[j] = record
        attrs = provenance(engine.loaded, engine.run, source) | (extra or {}) | run_attrs(engine, plan)
        return result_of([r for r in done if r is not None], engine.run, attrs, self._model_files)

    def search(self, queries: Input, index: str | os.PathLike[str] | LoadedIndex, *, k: int = 10,
               collapse_aliases: bool = False) -> Hits:
        """The ``k`` nearest neighbours in ``index`` of every query (:mod:`embedpipe.neighbours`),
        embedded by this Embedder (sequences, or a FASTA file as :meth:`embed` takes it);
        refused, before anything is embedded, in one line naming what differs when its run is
        not the index's store's (:mod:`embedpipe.api.compatible`), or naming the index's file
        that is damaged or was changed (every file is checked first). ``collapse_aliases``: one
        hit for each alias group of the store (the IDs of one sequence), named by its record."""
        loaded = index if isinstance(index, LoadedIndex) else open_index(Path(index))
        check_k(k)
        groups = alias_groups(loaded) if collapse_aliases else None  # the store is read before anything is embedded
        records = self._records(queries)
        check_compatible(self._engine_for(records).run, loaded.meta, loaded.path)
        result = self._embed(records)
        vectors = result.pooled(loaded.meta.layer, loaded.meta.pooling)
        if groups is not None:
            return filtered_search(loaded, result.ids, vectors, k, [()] * len(result), groups)
        return search_index(loaded, result.ids, vectors, k)

    def close(self) -> None:
        """Release the model (and the device it holds)."""
        self._engine, self._closed = None, True
        self._stack.close()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def embed(sequences: Input, model: str | os.PathLike[str], *, precision: str | None = None,
          layers: int | Sequence[int] | None = None, pooling: str | Sequence[str] | None = None,
          per_residue: bool | None = None, storage_dtype: str | None = None, device: str | None = None,
          options: EmbedOptions | None = None, quiet: bool = True, limits: FastaLimits = FASTA_LIMITS) -> Result:
    """One call: load ``model``, embed ``sequences`` (or a FASTA file, as :meth:`Embedder.embed`
    takes it) with the options :class:`Embedder` takes, release the model."""
    with Embedder(model, precision=precision, layers=layers, pooling=pooling, per_residue=per_residue,
                  storage_dtype=storage_dtype, device=device, options=options, quiet=quiet,
                  limits=limits) as embedder:
        return embedder.embed(sequences)
