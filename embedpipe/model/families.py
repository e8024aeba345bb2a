"""One row per model family: its name, how its specs are recognised, what it can do, how it
loads and how ``make-test-model`` writes one (docs/architecture.md, "The family table").

A :class:`FamilySpec` is a family as stores name it (``model_family``): its token layout,
trained window, whether it packs batches and its forward's version, declared here once. Its
:class:`Format` entries are the ways its models come: which :class:`Reader` takes the spec (a
fair-esm name or ``.pt``, a Hugging Face directory or hub name, the esm package's ``.pth``), the
names and the Hugging Face reading (:class:`~embedpipe.model.hf_families.HfFamily`) that recognise
it, the module that loads it and the :class:`Writer` of its test model. The registry
(:mod:`embedpipe.model.registry`), the Hugging Face reader (:mod:`embedpipe.model.hf_checkpoint`),
the fair-esm reader (:mod:`embedpipe.model.downloads`), the test-model writers and
``make-test-model --family`` read this table; model classes and facts take their capabilities
from their row's :meth:`FamilySpec.capabilities`. No other module lists families.

Torch-free, loaders and writers named by module and imported when used: the workflow describes
specs while Snakemake parses its rules, and importing torch costs 2.5 s.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from embedpipe.core.errors import ModelError
from embedpipe.model import esm1b_spec, esm2_spec, esmc_spec, saprot_spec, t5_spec, t5_vocab
from embedpipe.model.capabilities import Capabilities
from embedpipe.model.hf_families import HfFamily
from embedpipe.model.identity import versioned
from embedpipe.model.layout import ESM2_LAYOUT, TokenLayout


@dataclass(frozen=True)
class Reader:
    """One kind of spec the registry asks about (a :class:`~embedpipe.model.registry.Family`):
    ``module`` (torch-free) answers ``claims``, ``describe``, ``is_model_name`` and
    ``file_identity``; ``loader`` ``load`` and ``inspect``; ``sources`` ``download_problem``,
    ``fetch_model`` and ``model_files``."""

    name: str
    module: str
    loader: str
    sources: str


ESM_PTH = Reader("esmc-pth", "embedpipe.model.esmc_pth_spec", "embedpipe.model.esmc_pth", "embedpipe.model.esmc_pth_spec")
HUGGING_FACE = Reader("hf", "embedpipe.model.hf_checkpoint", "embedpipe.model.hf_checkpoint", "embedpipe.model.hf_sources")
FAIR_ESM = Reader("fair-esm", "embedpipe.model.downloads", "embedpipe.model.pt_checkpoint", "embedpipe.model.downloads")
#: asked in this order: the esm package's names and ``.pth`` first (a fair-esm checkpoint named
#: ``.pth`` stays fair-esm's), fair-esm last (it takes every spec: its names and any path)
READERS = (ESM_PTH, HUGGING_FACE, FAIR_ESM)


@dataclass(frozen=True)
class Writer:
    """``make-test-model``'s writer of a format: ``function(out, family=, layers=, dim=, heads=,
    seed=, **options)`` of ``module``, imported when called (it imports torch)."""

    module: str
    function: str
    what: str  # what it writes, as ``make-test-model --family`` lists it
    suffix: str  # how ``OUT`` ends (``.pt``, ``.pth``; empty: a directory)
    options: Mapping[str, Any] = field(default_factory=dict)
    #: the writer's own values of options the command line did not give (esmc-pth: dim 128)
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def write(self, out: Path, family: str, *, given: Collection[str] = (), **shape: Any) -> Path:
        """The test model of format ``family`` at ``out`` (``given``: the options the user set)."""
        shape |= {key: value for key, value in self.defaults.items() if key not in given}
        function = getattr(importlib.import_module(self.module), self.function)
        return Path(function(out, family=family, **shape, **self.options))


@dataclass(frozen=True)
class Format:
    """One way a family's models come, how it is recognised and loaded (``name``: what
    ``make-test-model --family`` and its marker call it)."""

    name: str
    reader: Reader
    #: builds the model: a Hugging Face format's ``load_directory(spec, directory, config, format)``, a
    #: ``.pt`` format's ``load_checkpoint(spec, path, sha, data)`` and ``checkpoint_facts(facts, data)``
    loader: str
    names: tuple[str, ...] = ()  # registered names: fair-esm's, Hugging Face hub names
    #: a registered name -> its (layers, dim, heads) and parameter count (fair-esm's name tables)
    name_sizes: Callable[[str], tuple[tuple[int, int, int], int]] | None = None
    hf: HfFamily | None = None  # how a Hugging Face directory is read and told to be this format
    hf_style: str | None = None  # the tokenization style of a type several rows share (``HfFamily.style``)
    #: a loaded ``.pt``'s layout is this format's; None: the layout none of the others claim (ESM-2's ``cfg``)
    pt_layout: Callable[[Mapping[str, Any]], bool] | None = None
    writer: Writer | None = None


@dataclass(frozen=True)
class FamilySpec:
    """One model family (a store's ``model_family``): what it can do, and its formats."""

    name: str
    layout: TokenLayout  # its special tokens, with the hard window of a model as released
    window: int  # residues per trained forward window, as released
    packs: bool  # whether its runner takes packed batches
    version: Callable[[], int]  # its forward's version, read at call time (where the forward sets it)
    formats: tuple[Format, ...]

    def __post_init__(self) -> None:
        if self.layout.window not in (None, self.window):
            raise ValueError(f"family {self.name}: its layout's window {self.layout.window} is not its window {self.window}")

    def capabilities(self, window: int | None = None) -> Capabilities:
        """The row's capabilities; ``window``: the trained window a model's own config sets (the
        layout's hard window follows it)."""
        window = self.window if window is None else window
        layout = self.layout if self.layout.window is None else replace(self.layout, window=window)
        return Capabilities(self.name, layout, window, self.packs)

    def versioned(self) -> str:
        """``name vN``: the family and its forward version (a store's identity)."""
        return versioned(self.name, self.version())


def _hf_writer(function: str, what: str, **options: Any) -> Writer:
    return Writer("embedpipe.model.random_hf", function, f"{what}, a Hugging Face directory", "", options)


def _pt_writer(what: str, layout: str, **options: Any) -> Writer:
    return Writer("embedpipe.model.random_checkpoint", "write_checkpoint", what, ".pt", {"layout": layout, **options})


#: T5 has no hard window (relative position buckets), but attention memory is quadratic: the score
#: matrix of one record is heads x L^2 x 4 bytes per layer, 2.1 GiB for ProtT5-XL (32 heads) at 4096
T5_WINDOW = 4096
#: T5 encoders (ProtT5, Ankh): no BOS, one ``</s>`` after the residues, no hard window
T5_LAYOUT = TokenLayout(bos=False, eos=True, window=None)


ESM2 = FamilySpec(
    "esm2", layout=ESM2_LAYOUT, window=1022, packs=True, version=lambda: esm2_spec.FAMILY_VERSION, formats=(
        Format("esm2", FAIR_ESM, "embedpipe.model.esm2", names=tuple(esm2_spec.ESM2_MODELS),
               name_sizes=esm2_spec.name_sizes, writer=_pt_writer("ESM-2, a fair-esm .pt", "cfg")),
        Format("hf-esm", HUGGING_FACE, "embedpipe.model.hf_esm", hf=esm2_spec.HF_ESM,
               names=tuple(f"facebook/{name}" for name in esm2_spec.ESM2_MODELS),
               writer=_hf_writer("esm_directory", "ESM-2")),
    ))
#: SaProt: ESM-2's forward over amino-acid x 3Di pair tokens, two characters a residue, case kept
SAPROT = FamilySpec(
    "saprot", layout=TokenLayout(bos=True, eos=True, window=1022, keeps_case=True, chars_per_residue=2), window=1022,
    packs=True, version=lambda: esm2_spec.FAMILY_VERSION, formats=(
        Format("saprot-pt", FAIR_ESM, "embedpipe.model.saprot_checkpoint", pt_layout=saprot_spec.is_pt_layout,
               writer=_pt_writer("SaProt, its esm-format .pt", "config", pairs=True)),
        # asked before ESM-1b's variant: a pair vocabulary with absolute positions is SaProt's (refused)
        Format("saprot", HUGGING_FACE, "embedpipe.model.saprot", hf=saprot_spec.HF_SAPROT,
               names=("westlake-repl/SaProt_650M_AF2", "westlake-repl/SaProt_35M_AF2", "westlake-repl/SaProt_650M_PDB"),
               writer=_hf_writer("esm_directory", "SaProt", pairs=True)),
    ))
#: ESM-1b and ESM-1v (one network, one forward): learned positions, 1024 as released
ESM1B = FamilySpec(
    "esm1b", layout=ESM2_LAYOUT, window=1022, packs=True, version=lambda: esm1b_spec.FAMILY_VERSION, formats=(
        Format("esm1b", FAIR_ESM, "embedpipe.model.esm2", names=tuple(esm1b_spec.ESM1B_MODELS),
               name_sizes=esm1b_spec.name_sizes, pt_layout=esm1b_spec.is_pt_layout,
               writer=_pt_writer("ESM-1b, a fair-esm .pt", "args")),
        Format("hf-esm1b", HUGGING_FACE, "embedpipe.model.hf_esm", hf=esm1b_spec.HF_ESM1B,
               names=tuple(f"facebook/{name}" for name in esm1b_spec.ESM1B_MODELS),
               writer=_hf_writer("esm_directory", "ESM-1b", absolute=True)),
    ))
PROT_T5 = FamilySpec(
    "prot-t5", layout=T5_LAYOUT, window=T5_WINDOW, packs=False, version=lambda: t5_vocab.FAMILY_VERSION, formats=(
        Format("prot-t5", HUGGING_FACE, "embedpipe.model.t5", hf=t5_spec.HF_T5, hf_style=t5_vocab.SPACED,
               names=("Rostlab/prot_t5_xl_uniref50", "Rostlab/prot_t5_xl_half_uniref50-enc", "Rostlab/prot_t5_xl_bfd"),
               writer=_hf_writer("t5_directory", "ProtT5")),
    ))
#: ProstT5: its direction prefix (``<AA2fold>`` or ``<fold2AA>``, chosen by the record's case) at
#: 0 in BOS's place, ``</s>`` after the residues; case kept (docs/models.md, "ProstT5")
PROSTT5 = FamilySpec(
    "prostt5", layout=TokenLayout(bos=True, eos=True, window=None, keeps_case=True), window=T5_WINDOW, packs=False,
    version=lambda: t5_vocab.FAMILY_VERSION, formats=(
        Format("prostt5", HUGGING_FACE, "embedpipe.model.t5", hf=t5_spec.HF_T5, hf_style=t5_vocab.SPACED_3DI,
               names=("Rostlab/ProstT5", "Rostlab/ProstT5_fp16"), writer=_hf_writer("t5_directory", "ProstT5")),
    ))
ANKH = FamilySpec(
    "ankh", layout=T5_LAYOUT, window=T5_WINDOW, packs=False, version=lambda: t5_vocab.FAMILY_VERSION, formats=(
        Format("ankh", HUGGING_FACE, "embedpipe.model.t5", hf=t5_spec.HF_T5, hf_style=t5_vocab.PER_CHARACTER,
               names=("ElnaggarLab/ankh-base", "ElnaggarLab/ankh-large"),
               writer=_hf_writer("t5_directory", "Ankh", gated=True)),  # T5 v1.1-style (gated-gelu)
    ))
#: ESM C: trained on 2048 tokens (2046 residues, BOS and EOS); a directory's config may say otherwise
ESMC = FamilySpec(
    "esmc", layout=TokenLayout(bos=True, eos=True, window=2046), window=2046, packs=True,
    version=lambda: esmc_spec.FAMILY_VERSION, formats=(
        Format("esmc", HUGGING_FACE, "embedpipe.model.esmc", hf=esmc_spec.HF_ESMC,
               names=tuple(f"biohub/ESMC-{size}" for size in ("300M", "600M", "6B")),
               writer=_hf_writer("esmc_directory", "ESM C")),
        # Synthyra's port under the esm package's weight names (make-test-model writes none)
        Format("esm++", HUGGING_FACE, "embedpipe.model.esmc", hf=esmc_spec.HF_ESM_PLUSPLUS,
               names=tuple(f"Synthyra/ESMplusplus_{size}" for size in ("small", "large"))),
        # the esm package's releases (their names: embedpipe.model.esmc_pth_spec.RELEASES) and .pth files
        Format("esmc-pth", ESM_PTH, "embedpipe.model.esmc_pth",
               writer=Writer("embedpipe.model.esmc_pth", "make_test_model", "ESM C as the esm package saves it, a .pth",
                             ".pth", defaults={"dim": 128, "heads": None})),
    ))

#: every family embedpipe reads, one row each
FAMILY_TABLE: tuple[FamilySpec, ...] = (ESM2, SAPROT, ESM1B, PROT_T5, PROSTT5, ANKH, ESMC)

#: every format, in table order (Hugging Face variants are asked in this order)
FORMATS: tuple[Format, ...] = tuple(fmt for row in FAMILY_TABLE for fmt in row.formats)
_ROW_OF = {fmt.name: row for row in FAMILY_TABLE for fmt in row.formats}
_BY_NAME = {fmt.name: fmt for fmt in FORMATS}


def row_of(fmt: Format) -> FamilySpec:
    """The family ``fmt`` is a format of."""
    return _ROW_OF[fmt.name]


def format_named(name: str) -> Format | None:
    """The format called ``name`` (``make-test-model --family``), or None."""
    return _BY_NAME.get(name)


def of_reader(reader: Reader) -> tuple[Format, ...]:
    """The formats ``reader`` takes, in table order."""
    return tuple(fmt for fmt in FORMATS if fmt.reader is reader)


def named(spec: str, reader: Reader) -> Format | None:
    """The format of ``reader`` that registers the name ``spec``, or None."""
    return next((fmt for fmt in of_reader(reader) if spec in fmt.names), None)


def pt_format(data: Mapping[str, Any]) -> Format:
    """The fair-esm reader's format of a loaded ``.pt``, from its layout (ESM-1b's ``args``,
    SaProt's ``config``; else ESM-2's ``cfg``, whose checks refuse anything else)."""
    formats = of_reader(FAIR_ESM)
    return next((f for f in formats if f.pt_layout is not None and f.pt_layout(data)),
                next(f for f in formats if f.pt_layout is None))


def written(module: str | None = None) -> tuple[Format, ...]:
    """The formats make-test-model writes (``module``: only those whose writer is in this module)."""
    return tuple(fmt for fmt in FORMATS if fmt.writer is not None and module in (None, fmt.writer.module))


def test_model_format(family: str, module: str | None = None, what: str = "family") -> Format:
    """The format ``make-test-model --family family`` writes (``module``: one written by this
    module); a one-line refusal naming the choices otherwise."""
    choices = written(module)
    found = next((fmt for fmt in choices if fmt.name == family), None)
    if found is None:
        raise ModelError(f"make-test-model: unknown {what} {family!r}; choose {', '.join(f.name for f in choices)}")
    return found
