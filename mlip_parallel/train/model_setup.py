"""What an ``mlip-train`` run trains and what it trains on: the model (a new one of this package's architectures,
or the starting model a model family's key names, in a pipeline stage only its parts), its checks (the weights'
memory, ``model.freeze``), a new model's scale and shift fitted to the data, and the data sets from the config.
(mlip-train's alone: the model section every tool reads is ``mlip_parallel/model_section.py``.)"""
from __future__ import annotations

import os

import numpy as np

from potentials.families import new_model_class as registry_new_model_class, with_long_range
from potentials.weights import weight_groups

from ..config import ConfigError
from ..model_section import chosen_family, load_section_model
from ..preflight import check_parameter_memory
from .sources import Source, open_source, split
from .training import QUANTITIES, LossRule

NEW_MODEL_KEYS = ("name", "cutoff", "hyperparameters", "species")  # model keys describing a new model


def starting_model(section) -> str | None:
    """The model family whose key names the model training starts from (None: a new model); ConfigError for
    keys that contradict each other (two starting models, a new model's keys beside one, an option of another
    family)."""
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
    """The class of the new model ``model.name`` names (where none is named, the registry's default:
    ``potentials.families.new_model_class``)."""
    return registry_new_model_class(section["name"])


def build_model(section, species, seed, parts=None):
    """The configured model: a new one (``parts``: only these parts, a pipeline stage's) initialised from
    ``seed`` part by part, or the starting model its family's key names (only ``parts`` of it), in
    ``model.dtype`` (default: its own)."""
    import torch

    key = starting_model(section)
    if key is not None:
        return load_section_model(section, key, parts=parts).train()
    cls = new_model_class(section)
    cutoff = 5.0 if section["cutoff"] is None else section["cutoff"]
    try:
        model = cls(species=species, cutoff=cutoff, **(section["hyperparameters"] or {}), parts=parts, seed=seed)
        model = with_long_range(model, section.get("long_range"), cls.__name__)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model: cannot build {cls.__name__}: {exc}") from None
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


def lora_settings(config) -> dict | None:
    """``model.lora`` as {targets, rank, alpha} (defaults rank 4, alpha 1.0), or None; ConfigError for other keys, no
    targets, a rank that is not an integer >= 1, an alpha that is not a finite number > 0, or pipeline parallel."""
    import math

    lora = config["model"]["lora"]
    if lora is None:
        return None
    unknown = sorted(set(lora) - {"targets", "rank", "alpha"})
    if unknown:
        raise ConfigError(f"model.lora: {unknown[0]!r} is not one of its keys (targets, rank, alpha)")
    targets = lora.get("targets")
    if isinstance(targets, str):
        targets = [targets]
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(f"model.lora.targets: a list of glob patterns over the weights' names, got {targets!r}")
    rank, alpha = lora.get("rank", 4), lora.get("alpha", 1.0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"model.lora.rank: an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"model.lora.alpha: a finite number > 0, got {alpha!r}")
    if config["model"]["freeze"]:
        raise ConfigError("model.lora with model.freeze: LoRA keeps every weight fixed already (only its updates "
                          "train); leave model.freeze out")
    return {"targets": list(targets), "rank": rank, "alpha": float(alpha)}


def check_patterns(model, patterns, procs, key: str = "model.freeze", matched=None) -> None:
    """ConfigError naming a glob of ``patterns`` (the config's ``key``: model.freeze, optimizer.lr_factors,
    model.lora.targets) that matches no weight of the model on any rank (pipeline stages each hold some parts), with
    the model's parameter groups (collective). ``matched``: every rank's names to match instead of its weights'
    (LoRA's adapted weights, named as before the adaptation)."""
    from fnmatch import fnmatchcase

    names = [name for held in procs.allgather([name for name, _ in model.named_weights()]) for name in held]
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in (names if matched is None else matched)):
            raise ConfigError(f"{key}: pattern {pattern!r} matches none of the {type(model).__name__}'s "
                              f"weights; its parameter groups are {', '.join(weight_groups(names))}")


def check_factors(factors, key: str, what: str) -> dict:
    """``factors`` ({name: number} or None) as a dict; ConfigError naming ``key``.name for a value that is not a
    finite number >= 0 (``what`` it is)."""
    factors = dict(factors or {})
    for name, factor in factors.items():
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 <= factor < float("inf"):
            raise ConfigError(f"{key}.{name}: {what} is a number >= 0, got {factor!r}")
    return factors


def parameter_groups(model, parameters, lr: float, factors: dict | None) -> list:
    """The optimizer's parameter groups: ``parameters`` (the trained ones, in their order) at ``lr``, except those
    whose name (``model.named_weights``) matches a glob of ``factors`` ({glob: factor}; the first that matches
    wins), at lr × factor, a group per glob (the first group: the unmatched ones, possibly none); each group's
    ``lr_factor`` is kept (stage two's learning rate is set through it)."""
    from fnmatch import fnmatchcase

    factors = check_factors(factors, "optimizer.lr_factors", "a factor of the learning rate")
    names = {id(p): name for name, p in model.named_weights()}
    groups = [{"params": [], "lr": lr, "lr_factor": 1.0}] + [{"params": [], "lr": lr * f, "lr_factor": f}
                                                              for f in factors.values()]
    for p in parameters:
        name = names.get(id(p), "")
        k = next((k for k, pattern in enumerate(factors, start=1) if fnmatchcase(name, pattern)), 0)
        groups[k]["params"].append(p)
    return groups


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


def training_entries(train) -> tuple:
    """(files read whole [path, ...], sampled files [(path, share), ...]) of ``data.train``: a path, or a list of
    paths and ``{file: PATH, share: s}`` entries (0 < s < 1; the shares sum below 1 and at least one file is read
    whole); ConfigError naming an entry that is not one of these."""
    entries = [train] if not isinstance(train, list) else train
    whole, sampled = [], []
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):
            if set(entry) != {"file", "share"}:
                raise ConfigError(f"data.train[{i}]: a sampled file is {{file: PATH, share: S}}, got keys "
                                  f"{sorted(entry)}")
            share = entry["share"]
            if not isinstance(entry["file"], str) or isinstance(share, bool) or not isinstance(share, (int, float)) \
                    or not 0 < share < 1:
                raise ConfigError(f"data.train[{i}]: file must be a path and share a number in (0, 1) (the fraction "
                                  f"of each epoch's structures drawn from it), got {entry}")
            sampled.append((entry["file"], float(share)))
        else:
            whole.append(entry)
    if sampled and not whole:
        raise ConfigError("data.train: every file has a share; at least one file is read whole (the shares are "
                          "fractions of an epoch whose other structures are those files')")
    if sum(share for _, share in sampled) >= 1:
        raise ConfigError(f"data.train: the shares sum to {sum(share for _, share in sampled):g}; they must sum "
                          f"below 1 (the rest of each epoch is the files read whole)")
    return whole, sampled


# data.stream's default: the structures are streamed from disk where the data files take more than this on disk (the
# same decision on every rank). Held, 200,000 32-atom structures (about 740 MB of extxyz) grew the peak 1.72× and the
# wall 3.3× over 10,000 in a 40-step run (each structure parsed up front); streamed, 0.99× and 1.11×
STREAM_ABOVE_BYTES = 256 * 10**6


def choose_streaming(d: dict, paths: list) -> str:
    """Set ``d["stream"]`` where the config left it None (``STREAM_ABOVE_BYTES``; data.workers read ahead from disk,
    so they stream); return the log's line saying what was chosen and why."""
    size = sum(os.path.getsize(p) for p in paths if isinstance(p, (str, os.PathLike)) and os.path.isfile(p))
    if d["stream"] is not None:
        return f"mlip-train: data {size / 1e6:.3g} MB on disk, {'streamed' if d['stream'] else 'held'} (data.stream)"
    d["stream"] = bool(d["workers"]) or size > STREAM_ABOVE_BYTES
    why = "data.workers read ahead" if d["workers"] else \
        f"{'above' if d['stream'] else 'within'} {STREAM_ABOVE_BYTES / 1e6:.0f} MB"
    return (f"mlip-train: data {size / 1e6:.3g} MB on disk, {'streamed from disk' if d['stream'] else 'held in memory'}"
            f" ({why}; data.stream: {'false' if d['stream'] else 'true'} to {'hold' if d['stream'] else 'stream'} it)")


def load_data(config):
    """(train, validation, test, mixture, note) of the data section: structures held in memory (lists), or with
    ``data.stream`` (by default where the files are large: ``choose_streaming``, whose log line is ``note``)
    ``sources`` views read from disk at each use (memory flat in the data set's size). The files
    read whole are split into train / validation / test; each sampled file (``training_entries``) joins the
    training set whole, after them, and ``mixture`` holds its positions there and its share (``loader.StepBatches``).
    """
    d = config["data"]
    if d["train"] is None:
        raise ConfigError("data.train is required: a file of labelled structures")
    whole, sampled = training_entries(d["train"])
    listed = [p for key in ("validation", "test") for p in ([d[key]] if isinstance(d[key], str) else d[key] or [])]
    note = choose_streaming(d, whole + [path for path, _ in sampled] + listed)

    def structures(paths):
        source = open_source(paths, d["keys"])
        return source if d["stream"] else list(source)

    train = structures(whole)
    fractions = [0.0 if d["validation"] else d["validation_fraction"], 0.0 if d["test"] else d["test_fraction"]]
    if sum(fractions) >= 1:
        raise ConfigError(f"data.validation_fraction + data.test_fraction must be < 1, got {sum(fractions)}")
    train, validation, test = split(train, fractions, config["seed"])
    mixture = []
    if sampled:
        parts = [train] + [structures(path) for path, _ in sampled]
        starts = np.cumsum([0] + [len(p) for p in parts])
        mixture = [(int(starts[i + 1]), int(starts[i + 2]), share) for i, (_, share) in enumerate(sampled)]
        train = [s for part in parts for s in part] if not d["stream"] else Source(parts)
    if d["validation"]:
        validation = structures(d["validation"])
    if d["test"]:
        test = structures(d["test"])
    if not len(train) or not len(validation):
        raise ConfigError(f"need at least one training and one validation structure, got {len(train)} and "
                          f"{len(validation)} (set data.validation or a larger data.validation_fraction)")
    return train, validation, test, mixture, note


def loss_rules(config):
    """(stage one's ``training.LossRule``, stage two's or None) of the loss and stage_two sections; ConfigError for
    weights that fit nothing or a config_type weight that is not a number >= 0."""
    loss, two = config["loss"], config["stage_two"]
    factors = check_factors(loss["config_type_weights"], "loss.config_type_weights", "a weight")
    rule = LossRule(**{q: loss[f"{q}_weight"] for q in QUANTITIES}, type=loss["type"], huber_delta=loss["huber_delta"],
                    config_type_weights={str(k): float(v) for k, v in factors.items()})
    second = None
    if two["start_epoch"]:
        second = rule.weighted(**{q: two[f"{q}_weight"] for q in QUANTITIES if two[f"{q}_weight"] is not None})
    elif any(v not in (None, False) for k, v in two.items()):
        raise ConfigError("stage_two: set stage_two.start_epoch (the first epoch of the second stage) for its "
                          "other keys to take effect")
    for name, r in (("loss", rule), ("stage_two", second)):
        if r is not None and not any(r[q] for q in QUANTITIES):
            raise ConfigError(f"{name}: every weight is 0 ({', '.join(f'{q}_weight' for q in QUANTITIES)}): "
                              "nothing to fit")
    return rule, second
