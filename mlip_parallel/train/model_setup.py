"""What an ``mlip-train`` run trains and what it trains on: the model (a new one of this package's architectures,
or the starting model a model family's key names, in a pipeline stage only its parts), its checks (the weights'
memory, ``model.freeze``), a new model's scale and shift fitted to the data, and the data sets from the config."""
from __future__ import annotations

from ..config import ConfigError
from ..preflight import check_parameter_memory
from .training import QUANTITIES


NEW_MODEL_KEYS = ("name", "cutoff", "hyperparameters", "species")  # model keys describing a new model


def starting_model(section) -> str | None:
    """The model family whose key names the model training starts from (None: a new model); ConfigError for
    keys that contradict each other (two starting models, a new model's keys beside one, an option of another
    family)."""
    from ..model_section import chosen_family

    given = chosen_family(section, trainable=True, conflict="model: start from one of")
    if given is not None and given != "checkpoint":  # (a checkpoint's architecture replaces these keys, as it always did)
        described = [k for k in NEW_MODEL_KEYS if section[k] is not None]
        if described:
            raise ConfigError(f"model.{described[0]} describes a new model, but model.{given} starts from a trained "
                              f"one, whose architecture, cutoff and species are its own: remove model.{described[0]}")
    return given


def model_species(section, training) -> list:
    """A new model's element symbols: model.species, else those of the training set (its ``survey.Survey``)."""
    if section["species"] is not None:
        return section["species"]
    from ase.data import chemical_symbols
    return [chemical_symbols[z] for z in training.elements]


def new_model_class(section):
    """The class of the new model ``model.name`` names (SchNet where none is named)."""
    from potentials.families.checkpoint import architecture

    return architecture(section["name"] or "SchNet")


def build_model(section, species, seed, parts=None):
    """The configured model: a new one (``parts``: only these parts, a pipeline stage's) initialised from
    ``seed`` part by part, or the starting model its family's key names (only ``parts`` of it), in
    ``model.dtype`` (default: its own)."""
    import torch

    from ..model_section import load_section_model

    key = starting_model(section)
    if key is not None:
        return load_section_model(section, key, parts=parts).train()
    cls = new_model_class(section)
    cutoff = 5.0 if section["cutoff"] is None else section["cutoff"]
    try:
        model = cls(species=species, cutoff=cutoff, **(section["hyperparameters"] or {}), parts=parts, seed=seed)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model: cannot build {section['name'] or 'SchNet'}: {exc}") from None
    dtype = {"float32": torch.float32, "float64": torch.float64, None: torch.float32}[section["dtype"]]
    return model.to(dtype)


def check_new_model_size(section, species, config, procs, device) -> None:
    """MemoryLimitError (every rank) when the new model's weights would not fit a rank for training
    (``preflight.check_parameter_memory``; counted on small builds of the same class)."""
    import inspect

    hyperparameters = section["hyperparameters"] or {}

    def construct(**size):
        return build_model(dict(section, hyperparameters={**hyperparameters, **size}), species, 0)

    cls = new_model_class(section)
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    stages = config["pipeline"]["stages"] if procs.parallel == "pipeline" else 1
    itemsize = {"float64": 8}.get(section["dtype"], 4)
    check_parameter_memory(procs.backend, cls.__name__, construct, hyperparameters, defaults, device, itemsize, stages)


def check_freeze(model, freeze, procs) -> None:
    """ConfigError naming a ``model.freeze`` pattern that matches no weight of the model on any rank
    (pipeline stages each hold some parts), with the model's parameter groups (collective)."""
    from fnmatch import fnmatchcase

    from potentials.base import weight_groups

    names = [name for held in procs.allgather([name for name, _ in model.named_weights()]) for name in held]
    for pattern in freeze:
        if not any(fnmatchcase(name, pattern) for name in names):
            raise ConfigError(f"model.freeze: pattern {pattern!r} matches none of the {type(model).__name__}'s "
                              f"weights; its parameter groups are {', '.join(weight_groups(names))}")


def fit_scale_shift(model, training) -> None:
    """Per-species reference energies by least squares and the force RMS as the energy scale, into the
    model's scale/shift (where it holds the readout), from the training set's ``survey.Survey``."""
    import torch
    from ase.data import atomic_numbers

    if not training.energies.rows or "readout" not in model.parts:
        return
    shift = training.reference_energies([atomic_numbers[x] for x in model.species])
    scale = training.force_rms or 1.0
    model.scale_shift.shift.copy_(torch.as_tensor(shift))
    model.scale_shift.scale.fill_(max(scale, 1e-3))


def load_data(config):
    """(train, validation, test) structures of the data section: lists held in memory, or with ``data.stream``
    ``sources.Subset`` views read from disk at each use (memory flat in the data set's size)."""
    from .sources import open_source
    from .training import split

    d = config["data"]
    if d["train"] is None:
        raise ConfigError("data.train is required: a file of labelled structures")

    def structures(paths):
        source = open_source(paths, d["keys"])
        return source if d["stream"] else list(source)

    train = structures(d["train"])
    fractions = [0.0 if d["validation"] else d["validation_fraction"], 0.0 if d["test"] else d["test_fraction"]]
    if sum(fractions) >= 1:
        raise ConfigError(f"data.validation_fraction + data.test_fraction must be < 1, got {sum(fractions)}")
    train, validation, test = split(train, fractions, config["seed"])
    if d["validation"]:
        validation = structures(d["validation"])
    if d["test"]:
        test = structures(d["test"])
    if not len(train) or not len(validation):
        raise ConfigError(f"need at least one training and one validation structure, got {len(train)} and "
                          f"{len(validation)} (set data.validation or a larger data.validation_fraction)")
    weights = {q: config["loss"][f"{q}_weight"] for q in QUANTITIES}
    if not any(weights.values()):
        raise ConfigError(f"loss: every weight is 0 ({', '.join(f'{q}_weight' for q in QUANTITIES)}): nothing to fit")
    return train, validation, test, weights
