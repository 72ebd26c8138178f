"""Checkpoints that are safe to load: a state_dict plus a JSON config, read with weights_only=True.

File layout (torch.save of a plain dict): {"config": <JSON string>, "state_dict": {name: tensor}}.
The config holds format, version, class, hyperparameters, species, cutoff, units and dtype. Nothing
is unpickled beyond tensors and plain containers, so a file cannot execute code on load.
"""
from __future__ import annotations

import json
import os
import pickle
import zipfile

import torch

from .base import BlockPotential, all_parts
from .errors import MLIPError
from .files import atomic_write, naming_errors
from .lj import LennardJones
from .nequip import NequIP
from .painn import PaiNN
from .schnet import SchNet

FORMAT = "mlip-parallel-potential"
VERSION = 1
MODEL_CLASSES = {cls.__name__: cls for cls in (LennardJones, SchNet, PaiNN, NequIP)}
_DTYPES = {"torch.float32": torch.float32, "torch.float64": torch.float64}
BUNDLED = {"cu-emt": os.path.join(os.path.dirname(__file__), "data", "cu-emt.pt")}  # name → shipped checkpoint


class CheckpointError(MLIPError, ValueError):
    """A checkpoint file is unreadable, corrupt, of another format/version/class, or holds objects."""


def save(model, path, extra: dict | None = None, state_dict: dict | None = None) -> None:
    """Write ``model`` (a potentials model) to ``path``, atomically (``files.atomic_write``: a kill or a
    full disk leaves the previous file). ``extra``: more entries of tensors and plain containers stored
    beside it (e.g. a trainer's optimizer state); ``load`` ignores them. ``state_dict``: the weights to
    write instead of ``model``'s own (see ``save_parts``). An OSError is raised as OutputError."""
    name = type(model).__name__
    if MODEL_CLASSES.get(name) is not type(model):
        raise CheckpointError(f"cannot save {name}: checkpoints support {sorted(MODEL_CLASSES)}")
    config = {"format": FORMAT, "version": VERSION, "class": name, "hyperparameters": model.hyperparameters,
              "species": model.species, "cutoff": model.cutoff, "units": {"energy": "eV", "length": "Angstrom"},
              "dtype": str(model.dtype)}
    state = {k: v.detach().cpu() for k, v in (model.state_dict() if state_dict is None else state_dict).items()}
    with atomic_write(path) as f:
        torch.save(dict(extra or {}, config=json.dumps(config), state_dict=state), f)


def load(path, map_location="cpu", parts=None):
    """Rebuild the model saved at ``path`` (eval mode, saved dtype, on ``map_location``). ``path`` may
    be a bundled model's name (``BUNDLED``: "cu-emt", a small PaiNN for copper trained on EMT data).
    ``parts``: build and read only these parts of a ``BlockPotential`` (a pipeline stage's; the file is
    memory-mapped, so the other parts' weights are never read into memory).

    Raises CheckpointError for a missing, truncated or corrupt file, pickled objects, another format,
    a newer version, an unknown class, or weights that do not fit the class.
    """
    path = os.fspath(path)
    if not os.path.isfile(path) and path in BUNDLED:
        path = BUNDLED[path]
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file (bundled models: {sorted(BUNDLED)})")
    try:
        with open(path, "rb") as f:
            empty, archive = not f.read(1), zipfile.is_zipfile(f)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read checkpoint ({exc.strerror})") from None
    if not archive:  # potentials.save writes torch's zip format; text, CSV or empty files are not checkpoints
        raise CheckpointError(f"{path}: not a checkpoint: truncated or corrupt, or not written by potentials.save "
                              f"({'an empty file' if empty else 'not a zip archive'})")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True, mmap=parts is not None)
    except pickle.UnpicklingError as exc:
        objects = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line]
        if objects:
            raise CheckpointError(f"{path}: holds pickled Python objects, refused (only tensors and a JSON config "
                                  f"are allowed): {objects[0]}") from None
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint (not a torch.save file)") from None
    except Exception as exc:  # torch.load raises many types for a damaged or foreign zip archive
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({type(exc).__name__}: "
                              f"{(str(exc).splitlines() or [''])[0]})") from None
    if not isinstance(payload, dict) or not {"config", "state_dict"} <= set(payload):
        raise CheckpointError(f"{path}: not an {FORMAT} checkpoint (expected keys 'config' and 'state_dict')")
    try:
        config = json.loads(payload["config"])
    except (TypeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: config is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config is a JSON {type(config).__name__}, expected an object")
    if config.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {config.get('format')!r}, expected {FORMAT!r}")
    if not isinstance(config.get("version"), int) or config["version"] > VERSION:
        raise CheckpointError(f"{path}: format version {config.get('version')!r}; this mlip-parallel reads "
                              f"versions up to {VERSION}")
    cls = MODEL_CLASSES.get(config.get("class"))
    if cls is None:
        raise CheckpointError(f"{path}: unknown model class {config.get('class')!r}; known {sorted(MODEL_CLASSES)}")
    if parts is not None and not issubclass(cls, BlockPotential):
        raise CheckpointError(f"{path}: a {cls.__name__} is not written as parts; it cannot be loaded part by part")
    try:
        model = cls(**config["hyperparameters"], **({} if parts is None else {"parts": parts, "seed": 0}))
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: hyper-parameters do not build a {cls.__name__}: {exc}") from None
    model.to(_DTYPES.get(config.get("dtype"), torch.float32))
    try:
        state = payload["state_dict"]
        if parts is not None:  # the held parts' entries and the shared buffers; strict on those
            state = {k: v for k, v in state.items() if model.part_of(k) in model.parts or model.part_of(k) is None}
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: weights do not fit a {cls.__name__} with these hyper-parameters: "
                              f"{str(exc).splitlines()[0]}") from None
    return model.to(map_location).eval()


def save_parts(model, path, pieces, extra: dict | None = None) -> None:
    """Write one ordinary checkpoint (``load`` reads it) of a model whose weights are spread over
    processes, holding one piece at a time: ``model`` (any part of it: it gives the class,
    hyper-parameters and dtype) and ``pieces``, an iterable of state-dict fragments that together cover
    the whole model (e.g. one per pipeline stage, received from its rank while iterating). Each piece
    is spooled to a temporary file beside ``path`` and memory-mapped back for the final (atomic) write;
    ``extra`` as for ``save``."""
    import tempfile

    name = type(model).__name__
    if MODEL_CLASSES.get(name) is not type(model):
        raise CheckpointError(f"cannot save {name}: checkpoints support {sorted(MODEL_CLASSES)}")
    directory = os.path.dirname(os.path.abspath(path))
    with naming_errors(path), tempfile.TemporaryDirectory(dir=directory, prefix=".parts-") as spool:
        state = {}
        for k, piece in enumerate(pieces):
            spooled = os.path.join(spool, f"{k}.pt")
            torch.save({key: v.detach().cpu() for key, v in piece.items()}, spooled)
            del piece
            state.update(torch.load(spooled, weights_only=True, mmap=True))
        missing = sorted(set(all_parts(model.layers)) - {model.part_of(key) for key in state})
        if missing:
            raise CheckpointError(f"cannot write {path}: no piece holds the parts {missing}")
        save(model, path, extra=extra, state_dict=state)
