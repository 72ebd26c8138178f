"""Model families: what every tool knows of a kind of model, one ``Family`` record each.

A family is a kind of model file or model, named in every tool by one key: ``checkpoint`` (this package's
checkpoints and bundled models), ``lennard_jones``, ``sevennet``, ``mace``, ``nequip``, ``fairchem``, and any
family another package registers. Its record holds its name (the config key and the ``name:`` prefix of a
model spec), its options (each with a type, a default, a help text and a rule), ``load(spec, **options)``,
``recognise(path)`` (is this file one of mine?), the name of the file a trained model is written to in its own
package's format, and optionally a translator of LAMMPS decks that name its models in their own pair style.

The command-line tools build their model sections, ``--help`` texts, rules and ``mlip-lammps`` flags from the
records, and ``load_model`` dispatches through them: code outside ``potentials`` names no family.

Built-in families are the modules ``potentials/families/NAME.py`` (each defines ``FAMILY``); other packages add
theirs through the entry-point group ``mlip_parallel.families``::

    [project.entry-points."mlip_parallel.families"]
    mymodel = "my_package.family:FAMILY"

``examples/family_plugin/`` is a complete one. Nothing here imports torch: a tool reads the records to check a
config and print ``--help`` before any model is needed (a record's ``load`` imports what it needs).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import zipfile
from typing import Any, Callable, Mapping, NamedTuple

from ..errors import MLIPError
from ..rules import value_problem

ENTRY_POINT_GROUP = "mlip_parallel.families"
# potentials.families.NAME
BUILTIN = ("checkpoint", "lennard_jones", "born_coulomb", "sevennet", "mace", "nequip", "fairchem", "aimnet")
OPTION_TYPES = (str, int, float, bool)
# names no option may take: the model section's own keys in the tools and the keywords load_model keeps for itself
# (a tool's command-line flags are the tool's: ``model_section.add_option_arguments`` refuses an option that is one)
RESERVED = frozenset({"dtype", "parts", "checkpoint_dtype", "name", "cutoff", "hyperparameters", "species", "freeze",
                      "lora", "reference_energies", "committee", "committee_forces", "model", "long_range"})


class ModelSpecError(MLIPError, ValueError):
    """A model named by a string that does not fit: an unknown family, an option the family does not take or a
    value its rule refuses."""


class FamilyError(MLIPError, RuntimeError):
    """A family that cannot be registered: its entry point fails to import or is not a ``Family``, or its name or
    an option collides with another."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a family's models: its ``type`` (str, int, float or bool), its ``default`` (what ``load``
    uses when it is not given; for the help text), ``help`` and ``rule`` (as the tools' config rules: ``"> 0"``,
    a closed range ``"[-100, 100]"``, a tuple of choices; None: any value of the type)."""

    type: type
    default: Any = None
    help: str = ""
    rule: Any = None

    def problem(self, name: str, value) -> str | None:
        """What is wrong with ``value`` for this option called ``name`` (None: nothing)."""
        return value_problem(name, value, self.type, self.rule)


class DeckModel(NamedTuple):
    """What a family's LAMMPS deck translator found: the model spec to run, the element of each atom type (type
    1, 2, ...), and the indices of the deck's commands it replaces (dropped from the deck)."""

    model: str
    elements: list
    dropped: list


@dataclasses.dataclass(frozen=True)
class Family:
    """The record of a model family (see the module docstring).

    * ``name``: the config key and spec prefix (``mace`` in ``model: {mace: FILE}`` and ``mace:FILE``);
    * ``load(spec, **options) -> Potential``: ``spec`` is the text after ``name:`` (in a YAML model section, the
      key's value), the options those given. A ``load`` that takes ``dtype`` (a torch dtype or None) builds the
      model in it; otherwise the model is converted after. One that takes ``parts`` builds only those pipeline
      parts (a ``BlockPotential``'s); otherwise the family's models do not split into pipeline stages. Errors
      are ``MLIPError``s naming the problem (an error class per family), or ImportError naming the install;
    * ``options``: {name: ``Option``}; in a YAML model section each is a key beside the family's, on
      ``mlip-lammps``'s and ``mlip-train eval``'s command lines ``--name VALUE``;
    * ``recognise(path)``: what the file is (a short phrase, e.g. "a MACE model file") when it is one of this
      family's files, else None: a file named as a potentials checkpoint then names the key that reads it;
    * ``native_file``: the file name, with ``{stem}``, under which a trained model is written in its package's
      own format beside ``best.pt`` (``"{stem}.model"``), None where there is none;
    * ``lammps_deck(deck, commands) -> DeckModel | None``: a deck that names this family's model in its own pair
      style, run as it is by ``mlip-lammps`` (``commands``: [(first line, last line, words)] of the deck);

    and, keyword-only: ``help`` (what the spec names, for ``--help``), ``aliases`` (other spec prefixes), ``names``
    (``names(text)``: whether ``text`` is a model the family knows by name, without a file, e.g. SevenNet's "7net-0":
    a spec without the family's prefix then suggests it),
    ``trainable`` (``mlip-train`` may start from its models), ``model_classes`` ({class name: "module:attr"}:
    the classes of its models, so that a potentials checkpoint of a trained one rebuilds them), ``new_models``
    ({name: "module:attr"}: the architectures ``mlip-train`` builds new as ``model.name``, the first family's first
    the default), ``check_models`` ({name: build() -> a small model with seeded random weights for Ag and Cu}: what
    ``python -m mlip_parallel.check`` runs) and ``spec_type`` (the YAML types of the key's value)."""

    name: str
    load: Callable
    options: Mapping[str, Option] = dataclasses.field(default_factory=dict)
    recognise: Callable[[str], Any] | None = None
    native_file: str | None = None
    lammps_deck: Callable | None = None
    _: dataclasses.KW_ONLY
    help: str = ""
    aliases: tuple = ()
    names: Callable[[str], bool] | None = None
    trainable: bool = True
    model_classes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    new_models: Mapping[str, str] = dataclasses.field(default_factory=dict)
    check_models: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    spec_type: Any = str

    def takes(self, keyword: str) -> bool:
        """Whether ``load`` takes the keyword argument ``keyword`` (``dtype``, ``parts``)."""
        parameters = inspect.signature(self.load).parameters.values()
        return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)

    def option_help(self) -> str:
        """Its options in words, for messages: "head (str)", or "none"."""
        return ", ".join(f"{k} ({o.type.__name__})" for k, o in self.options.items()) or "none"


# ------------------------------------------------------------------------------------------------- the registry
@functools.lru_cache(maxsize=None)
def families() -> dict:
    """{name: Family}: the built-in families, then those of the entry-point group (in the order their packages
    are found). FamilyError for an entry point that fails to load, a name or alias taken twice, an option
    with a reserved name, or one option name of two types; the first such problem is raised at every call."""
    from importlib import import_module
    from importlib.metadata import entry_points

    found = {}
    for name in BUILTIN:
        _add(found, import_module(f"{__name__}.{name}").FAMILY, "built-in")
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        where = f"the entry point {point.name} = {point.value} of {_package(point)} (group {ENTRY_POINT_GROUP})"
        try:
            record = point.load()
        except Exception as exc:  # an entry point's import may raise anything
            raise FamilyError(f"{where} cannot be imported: {type(exc).__name__}: "
                              f"{(str(exc).splitlines() or [''])[0]}") from None
        if not isinstance(record, Family):
            raise FamilyError(f"{where} is a {type(record).__name__}, not a potentials.families.Family")
        if record.name != point.name:
            raise FamilyError(f"{where} is the family {record.name!r}: the entry point's name must be the family's")
        _add(found, record, where)
    return found


def _package(point) -> str:
    dist = getattr(point, "dist", None)
    return f"the package {dist.name}" if dist is not None else "an installed package"


def _add(found: dict, record: Family, where: str) -> None:
    """Add ``record`` to ``found``, after checking its name, aliases and options against those there."""
    shared = option_table(found.values())
    for name in (record.name, *record.aliases):
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            raise FamilyError(f"{where}: family name {name!r}: lower-case letters, digits and _ only")
        owner = next((f for f in found.values() if name == f.name or name in f.aliases), None)
        if owner is not None:
            raise FamilyError(f"{where}: the family name {name!r} is taken by the {owner.name} family"
                              + (" (built-in)" if owner.name in BUILTIN else ""))
        if name in shared or name in RESERVED:
            raise FamilyError(f"{where}: the family name {name!r} is an option's or a model section's key")
    for key, option in record.options.items():
        if key in RESERVED or key in found or key == record.name:
            raise FamilyError(f"{where}: option {key!r} of the {record.name} family: that name is reserved")
        if not isinstance(option, Option) or option.type not in OPTION_TYPES:
            raise FamilyError(f"{where}: option {key!r} of the {record.name} family must be an Option of type "
                              f"str, int, float or bool")
        if key in shared and shared[key][0].type is not option.type:
            raise FamilyError(f"{where}: option {key!r} of the {record.name} family is {option.type.__name__}, "
                              f"the {shared[key][1][0]} family's {shared[key][0].type.__name__}")
    if any(key in record.options for f in found.values() for key in (f.name, *f.aliases)):
        raise FamilyError(f"{where}: an option of the {record.name} family takes another family's name")
    found[record.name] = record


def family(name: str) -> Family | None:
    """The family called ``name`` (or by an alias), None when there is none."""
    for record in families().values():
        if name == record.name or name in record.aliases:
            return record
    return None


def new_models() -> dict:
    """{name: "module:attr"}: every family's ``new_models``, in the registry's order (the first: mlip-train's
    default ``model.name``)."""
    return {name: target for record in families().values() for name, target in record.new_models.items()}


def new_model_class(name: str | None = None):
    """The class of the new model ``name`` (one of ``new_models()``; None: the default, the first)."""
    from importlib import import_module

    found = new_models()
    module, _, attribute = found[next(iter(found)) if name is None else name].partition(":")
    return getattr(import_module(module), attribute)


def check_models() -> dict:
    """{name: build()}: every family's ``check_models``, in the registry's order."""
    return {name: build for record in families().values() for name, build in record.check_models.items()}


def option_table(records=None) -> dict:
    """{option name: (Option, [names of the families that take it])} over ``records`` (default: every family);
    the Option is the first family's."""
    table = {}
    for record in families().values() if records is None else records:
        for key, option in record.options.items():
            table.setdefault(key, (option, []))[1].append(record.name)
    return table


def meant(text: str) -> list:
    """The specs "name:TEXT" of the families whose ``names`` know ``text`` (what a spec without a prefix probably
    meant); a ``names`` that raises knows nothing."""
    found = []
    for record in families().values():
        try:
            if record.names is not None and record.names(text):
                found.append(f"{record.name}:{text}")
        except Exception:  # noqa: BLE001 - a hint, never an error of its own
            pass
    return found


def split_spec(spec: str) -> tuple:
    """(family, text) of a model spec: "name:TEXT" (a family's name or alias), else a potentials checkpoint's
    path or bundled name (the ``checkpoint`` family)."""
    prefix, colon, rest = spec.partition(":")
    record = family(prefix) if colon else None
    return (record, rest) if record is not None else (families()["checkpoint"], spec)


def load_model(spec, dtype: str | None = None, *, parts=None, checkpoint_dtype: str | None = None, long_range=None,
               **options):
    """The model named by ``spec`` ("name:TEXT" for a family, e.g. "mace:FILE.model", "sevennet:7net-0",
    "fairchem:FILE"; else a potentials checkpoint path or bundled name such as "cu-emt"; for a family whose
    YAML value is not text, e.g. Lennard-Jones's mapping, ``spec`` may be ``(name, value)``), with the family's
    ``options`` (those None are not given). ``dtype``: "float32", "float64" or None (the model's own; for a
    potentials checkpoint ``checkpoint_dtype`` if given: the MD tools run checkpoints in float64). ``parts``:
    only these pipeline parts of a model that splits into stages. ``long_range``: the Coulomb solver of a model that
    predicts charges, {method: ewald | pme | p3m, accuracy, ...} (``potentials.coulomb.Coulomb``'s keywords).

    Raises ModelSpecError (an option the family does not take, or a value its rule refuses), the family's own
    ``MLIPError`` naming the problem, or ImportError naming what to install."""
    import torch

    if isinstance(spec, tuple):
        record, text = family(spec[0]), spec[1]
        if record is None:
            raise ModelSpecError(f"no model family {spec[0]!r}; the families are {', '.join(families())}")
    else:
        record, text = split_spec(str(spec))
    given = {k: v for k, v in options.items() if v is not None}
    label = spec if isinstance(spec, str) else record.name
    unknown = [k for k in given if k not in record.options]
    if unknown:
        owners = {name: sorted(names) for name, (_, names) in option_table().items()}
        whose = "; ".join(f"{k} is an option of {' and '.join(owners[k])} models" for k in unknown if k in owners)
        raise ModelSpecError(f"{label}: {', '.join(unknown)} {'is not an option' if len(unknown) == 1 else 'are not options'}"
                             f" of {record.name} models (its options: {record.option_help()})"
                             + (f"; {whose}" if whose else ""))
    for key, value in given.items():
        problem = record.options[key].problem(key, value)
        if problem:
            raise ModelSpecError(f"{label}: {problem}")
    if dtype is None and record.name == "checkpoint":
        dtype = checkpoint_dtype
    dtypes = {None: None, "float32": torch.float32, "float64": torch.float64}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
    if record.takes("dtype"):
        given["dtype"] = dtypes[dtype]
    if parts is not None:
        if not record.takes("parts"):
            raise ModelSpecError(f"{label}: a {record.name} model does not split into pipeline stages")
        given["parts"] = parts
    model = record.load(text, **given)
    model = model if record.takes("dtype") or dtype is None else model.to(dtypes[dtype])
    return with_long_range(model, long_range, label)


def with_long_range(model, long_range, label: str):
    """``model`` with the Coulomb solver ``long_range`` attached (None: as loaded): ModelSpecError for settings given
    to a model that predicts no charges, or none for a model whose Coulomb energy is its long-range term."""
    from ..coulomb import ChargeModel, LongRangeError

    if not isinstance(model, ChargeModel) or not model.predicts_charges:
        if long_range is not None:
            raise ModelSpecError(f"{label}: long_range is given, but a {type(model).__name__} predicts no charges (a "
                                 "model whose family predicts charges takes it)")
        return model
    try:
        if long_range is not None:
            model.set_long_range(long_range)
        if model.needs_long_range and getattr(model, "long_range", None) is None:
            raise LongRangeError(f"a {type(model).__name__} needs long_range: {{method: ewald | pme | p3m, accuracy: "
                                 "1.0e-6} beside it (its Coulomb energy is the long-range term)")
    except LongRangeError as exc:
        raise ModelSpecError(f"{label}: {exc}") from None
    return model


# ------------------------------------------------------------------------------------------------- files
def recognise(path) -> tuple | None:
    """(what the file is, the family that reads it) for another family's model file, None when no family
    recognises it (its ``recognise`` raising counts as no)."""
    for record in families().values():
        if record.recognise is None:
            continue
        try:
            what = record.recognise(str(path))
        except Exception:  # noqa: BLE001 - a recogniser that cannot read the file does not recognise it
            what = None
        if what:
            return (what if isinstance(what, str) else f"a {record.name} model file"), record.name
    return None


def archive_pickle(path) -> tuple:
    """(the member names, the bytes of the top-level pickle) of a torch zip archive ``path`` (a file
    ``torch.save`` wrote), for recognisers: nothing is unpickled. ([], b"") when it is not one."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
            return names, archive.read(pickles[0]) if len(pickles) == 1 else b""
    except (OSError, zipfile.BadZipFile, KeyError, RuntimeError):
        return [], b""


def model_class(name: str):
    """The model class of a potentials checkpoint's "class" entry, from the families' ``model_classes`` (its
    module imported now); None when no family names it. ImportError when its module cannot be imported."""
    from importlib import import_module

    for record in families().values():
        if name in record.model_classes:
            module, _, attribute = record.model_classes[name].partition(":")
            return getattr(import_module(module), attribute)
    return None


def class_family(cls) -> Family | None:
    """The family whose ``model_classes`` names the class ``cls`` (by its name and module), None if none."""
    for record in families().values():
        target = record.model_classes.get(cls.__name__)
        if target is not None and target.partition(":")[0] == cls.__module__:
            return record
    return None


def native_file(cls, stem: str) -> str | None:
    """The file name a trained model of class ``cls`` called ``stem`` ("best") is written to in its package's
    own format (its family's ``native_file``), None where it has none."""
    record = class_family(cls)
    return None if record is None or record.native_file is None else record.native_file.format(stem=stem)
