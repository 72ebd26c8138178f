"""The model a tool runs, as its config and command line name it, built from the model families
(``potentials.families``): every family's key and every option any family declares. For every tool; what
``mlip-train`` alone does with the model (a new one, its checks, its data) is ``train/model_setup.py``.

In a YAML model section a model is one family's key with its spec as the value (``mace: FILE``; Lennard-Jones:
``lennard_jones: {epsilon, sigma, cutoff}``), its options as keys beside it (``head: x``) and ``dtype``. On a
command line it is ``--model name:SPEC`` with ``--option VALUE`` flags. This module imports neither torch nor
MPI: a tool checks its config and prints ``--help`` before loading anything."""
from __future__ import annotations

import argparse

from mlip_parallel.config import validate
from potentials.families import FamilyError, families, option_table

from .config import ConfigError

DTYPE_HELP = ("float32 or float64 (default: the model's own, as its file or package gives it; mlip-md and mlip-lammps "
              "run potentials checkpoints in float64)")


LONG_RANGE_HELP = ("the Coulomb energy of a model's charges summed over the whole periodic structure: {method: ewald | "
                   "pme | p3m, accuracy: 1.0e-6} (the force error between two unit charges 1 Å apart; smearing and "
                   "resolution in Å fix the split instead; mesh: auto | replicated | distributed, how ranks hold "
                   "a PME/P3M mesh); for a model that predicts charges, e.g. born_coulomb")


def model_families(trainable: bool = False) -> list:
    """The families a tool names (``trainable``: those ``mlip-train`` may start from)."""
    return [f for f in families().values() if f.trainable or not trainable]


def _option_help(option, owners) -> str:
    rule = f", {option.rule}" if isinstance(option.rule, str) else (f", one of {option.rule}" if option.rule else "")
    default = "" if option.default is None else f"; default {option.default}"
    return f"{'/'.join(owners)}: {option.help}{rule}{default}"


def model_schema(trainable: bool = False) -> dict:
    """The model section's keys (``config.validate``'s schema entries): each family's key (``trainable``: those
    ``mlip-train`` starts from), then each option of those families (help: which families take it), then ``dtype``."""
    records = model_families(trainable)
    schema = {}
    for f in records:
        native = f" (fine-tuned: {f.native_file.format(stem='best')} is written beside best.pt, in its package's " \
                 f"format)" if trainable and f.native_file else ""
        schema[f.name] = (f.spec_type, None, f.help + native)
    for key, (option, owners) in option_table(records).items():
        schema[key] = (option.type, None, _option_help(option, owners))
    schema["dtype"] = (str, None, DTYPE_HELP)
    schema["long_range"] = (dict, None, LONG_RANGE_HELP)
    return schema


def model_rules(trainable: bool = False, prefix: str = "model.") -> dict:
    """The rules of the model section's keys: ``dtype``'s choices, and each option's rule where the families that
    take it agree on one (a number without one: any finite number; each family checks its own when it loads)."""
    rules = {f"{prefix}dtype": ("float32", "float64")}
    records = model_families(trainable)
    for key, (option, owners) in option_table(records).items():
        agreed = {repr(r.options[key].rule) for r in records if key in r.options}
        if len(agreed) == 1 and option.rule is not None:
            rules[f"{prefix}{key}"] = option.rule
        elif option.type in (int, float):
            rules[f"{prefix}{key}"] = "finite"
    return rules


def chosen_family(section: dict, trainable: bool = False, conflict: str = "model takes one of",
                  where: str = "model") -> str | None:
    """The family key set in the validated model ``section`` (None: none); ConfigError for two, or for an option
    of a family that is not the chosen one (``where``: the section's name in messages)."""
    keys = [f.name for f in model_families(trainable)]
    given = [k for k in keys if section.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"{conflict} {', '.join(keys)} (got {', '.join(given)})")
    name = given[0] if given else None
    for key, (_, owners) in option_table(model_families(trainable)).items():
        if section.get(key) is not None and name not in owners:
            raise ConfigError(f"{where}.{key} is set for a {' or '.join(owners)} model "
                              f"({' or '.join(f'{where}.{o}' for o in owners)})")
    return name


def section_options(section: dict, name: str) -> dict:
    """The options of the family ``name`` set in ``section``."""
    return {key: section[key] for key in families()[name].options if section.get(key) is not None}


def load_section_model(section: dict, name: str, checkpoint_dtype: str | None = None, parts=None,
                       where: str = "model"):
    """The model of family ``name`` in the validated ``section`` (its spec, options and ``dtype``): ConfigError
    naming the key (``where``: the section's name) for anything the family refuses, or a package not installed."""
    import potentials

    try:
        return potentials.load_model((name, section[name]), section["dtype"], checkpoint_dtype=checkpoint_dtype,
                                     parts=parts, long_range=section.get("long_range"),
                                     **section_options(section, name))
    except (potentials.MLIPError, ImportError) as exc:
        raise ConfigError(f"{where}.{name}: {exc}") from None


# ------------------------------------------------------------------------------------------------- committees
COMMITTEE_KEYS = {
    "committee": (list, None, "a committee of models instead of one: a list of model sections ({checkpoint: a.pt}, "
                              "{mace: b.model, head: x}, ...), run on one decomposition; the run's forces, energy and "
                              "stress are their mean (or the first's: committee_forces) and uncertainty reads their "
                              "deviation"),
    "committee_forces": (str, "mean", "committee: mean (the members' mean forces, energy and stress) or first (the "
                                      "first member's, DeePMD's convention)"),
}
COMMITTEE_RULES = {"model.committee_forces": ("mean", "first")}


def load_section_committee(section: dict, checkpoint_dtype: str | None = None):
    """The ``potentials.Committee`` of the validated model ``section``'s ``committee``: each member a model section
    of its own (validated here; messages name ``model.committee[k]``), and no model named beside the list."""
    from potentials.committee import Committee, CommitteeError  # (torch: at first use)

    beside = [k for k in model_schema() if k != "dtype" and section.get(k) is not None]  # families' keys, options
    if beside:
        raise ConfigError(f"model.committee names the models: move model.{beside[0]} into one of its members")
    if not section["committee"]:
        raise ConfigError("model.committee is empty: name at least one member, e.g. [{checkpoint: a.pt}, "
                          "{checkpoint: b.pt}]")
    members = []
    for k, member in enumerate(section["committee"], start=1):
        where = f"model.committee[{k}]"
        if not isinstance(member, dict):
            raise ConfigError(f"{where} must be a model section such as {{checkpoint: best.pt}} or {{mace: "
                              f"FILE.model}}, got {member!r}")
        member = validate(member, model_schema(), model_rules(prefix=f"{where}."), path=f"{where}.")
        name = chosen_family(member, where=where)
        if name is None:
            raise ConfigError(f"{where} names no model: give one of {', '.join(f.name for f in model_families())}")
        if member["dtype"] is None and section["dtype"] is not None:
            member["dtype"] = section["dtype"]
        members.append(load_section_model(member, name, checkpoint_dtype, where=where))
    try:
        return Committee(members, forces=section["committee_forces"])
    except CommitteeError as exc:
        raise ConfigError(f"model.committee: {exc}") from None


def _parse_bool(text: str) -> bool:
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """``--option VALUE`` for every option any family declares (``_`` written ``-``), its help naming the
    families that take it; called after the tool's own flags: FamilyError for an option that is one of them."""
    for key, (option, owners) in option_table().items():
        try:
            parser.add_argument(f"--{key.replace('_', '-')}", dest=key, metavar=option.type.__name__.upper(),
                                type=_parse_bool if option.type is bool else option.type,
                                help=_option_help(option, owners).replace("%", "%%"))
        except argparse.ArgumentError:
            raise FamilyError(f"option {key!r} of the {owners[0]} family is {parser.prog}'s own flag "
                              f"--{key.replace('_', '-')}: the family's package must rename it") from None


def argument_options(args) -> dict:
    """The family options given on the command line (``add_option_arguments``)."""
    return {key: getattr(args, key) for key in option_table() if getattr(args, key, None) is not None}
