"""Checkpoints that are safe to load: a state_dict plus a JSON config, read with weights_only=True.

File layout (torch.save of a plain dict): {"config": <JSON string>, "state_dict": {name: tensor}}.
The config holds format, version, class, hyperparameters, species, cutoff, units and dtype. Nothing
is unpickled beyond tensors and plain containers, so a file cannot execute code on load.
"""
from __future__ import annotations

import itertools
import json
import os
import pickle
import struct
import zipfile

import torch

from . import families
from .base import BlockPotential, PackageModel, all_parts
from .errors import MLIPError
from .files import atomic_write
from .pickled import Deferred, read_each, read_module_tree

FORMAT = "mlip-parallel-potential"
VERSION = 1
_DTYPES = {"torch.float32": torch.float32, "torch.float64": torch.float64}
BUNDLED = {"cu-emt": os.path.join(os.path.dirname(__file__), "data", "cu-emt.pt")}  # name → shipped checkpoint


class CheckpointError(MLIPError, ValueError):
    """A checkpoint file is unreadable, corrupt, of another format/version/class, or holds objects."""


def save(model, path, extra: dict | None = None) -> None:
    """Write ``model`` (a potentials model) to ``path``, atomically (``files.atomic_write``: a kill or a
    full disk leaves the previous file). ``extra``: more entries of tensors and plain containers stored
    beside it (e.g. a trainer's optimizer state); ``load`` ignores them. An OSError is raised as OutputError."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    with atomic_write(path) as f:
        torch.save(dict(extra or {}, config=_config(model), state_dict=state), f)


def model_class(name: str, where: str = "checkpoint"):
    """The model class a checkpoint names (a family's ``model_classes``; its module imported now); None if unknown."""
    try:
        return families.model_class(name)
    except ImportError as exc:
        raise CheckpointError(f"{where}: a {name} model, whose package is not installed ({exc})") from None


def known_classes() -> list:
    """The class names a checkpoint may hold, for messages."""
    return sorted(name for record in families.families().values() for name in record.model_classes)


def _config(model) -> str:
    """The JSON config a checkpoint of ``model`` stores (CheckpointError for a class it cannot hold)."""
    name = type(model).__name__
    if model_class(name) is not type(model):
        raise CheckpointError(f"cannot save {name}: checkpoints support {known_classes()}")
    return json.dumps({"format": FORMAT, "version": VERSION, "class": name, "hyperparameters": model.hyperparameters,
                       "species": model.species, "cutoff": model.cutoff,
                       "units": {"energy": "eV", "length": "Angstrom"}, "dtype": str(model.dtype)})


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
        key, _, rest = path.partition(":")
        if rest and key != "checkpoint" and families.family(key) is not None:
            raise CheckpointError(f"{path}: a {key} model spec, not a checkpoint path: in mlip-md's and mlip-train's "
                                  f"model section, name the file with the key {key} (model: {{{key}: {rest}}})")
        hint = " or ".join(families.meant(path))
        raise CheckpointError(f"{path}: no such checkpoint file (bundled models: {sorted(BUNDLED)})"
                              + (f"; did you mean {hint}?" if hint else ""))
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
    except Exception as exc:  # torch.load raises many types for a damaged or foreign zip archive
        raise _refused(path, exc) from None
    if not isinstance(payload, dict) or not {"config", "state_dict"} <= set(payload):
        raise _refused(path)
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
    cls = model_class(str(config.get("class")), path)
    if cls is None:
        raise CheckpointError(f"{path}: unknown model class {config.get('class')!r}; known {known_classes()}")
    if parts is not None and not issubclass(cls, BlockPotential):
        raise CheckpointError(f"{path}: a {cls.__name__} is not written as parts; it cannot be loaded part by part")
    dtype = _DTYPES.get(config.get("dtype"), torch.float32)
    stage = {} if parts is None else {"parts": parts, "seed": 0}
    try:
        model = cls.rebuild(config["hyperparameters"], dtype, **stage) if issubclass(cls, PackageModel) else \
            cls(**config["hyperparameters"], **stage).to(dtype)
    except (TypeError, ValueError, KeyError) as exc:  # (an adapter's MLIPError is a ValueError)
        raise CheckpointError(f"{path}: hyper-parameters do not build a {cls.__name__}: {exc}") from None
    try:
        state = payload["state_dict"]
        if parts is not None:  # the held parts' entries and the shared buffers; strict on those
            state = {k: v for k, v in state.items() if model.part_of(k) in model.parts or model.part_of(k) is None}
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: weights do not fit a {cls.__name__} with these hyper-parameters: "
                              f"{str(exc).splitlines()[0]}") from None
    return model.to(map_location).eval()


def _refused(path, exc: Exception | None = None) -> CheckpointError:
    """Why the zip archive ``path`` is not a potentials checkpoint — ``torch.load(weights_only=True)`` refused
    it with ``exc``, or (None) it holds something else than {config, state_dict}: another package's model
    file (named, with the model key that reads it: ``families.recognise``), pickled objects, damage, or other data."""
    foreign = families.recognise(path) if FORMAT.encode() not in families.archive_pickle(path)[1] else None
    if foreign is not None:
        what, key = foreign
        return CheckpointError(f"{path}: {what}, not a potentials checkpoint: name it with the key {key} "
                               f"(model: {{{key}: FILE}} in mlip-md and mlip-train, {key}:FILE elsewhere)")
    if exc is None:
        return CheckpointError(f"{path}: not an {FORMAT} checkpoint (expected keys 'config' and 'state_dict')")
    if isinstance(exc, pickle.UnpicklingError):
        objects = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line]
        if objects:
            return CheckpointError(f"{path}: holds pickled Python objects, refused (only tensors and a JSON config "
                                   f"are allowed): {objects[0]}")
        return CheckpointError(f"{path}: truncated or corrupt checkpoint (not a torch.save file)")
    return CheckpointError(f"{path}: truncated or corrupt checkpoint ({type(exc).__name__}: "
                           f"{(str(exc).splitlines() or [''])[0]})")


def save_parts(model, path, layout: dict, tensors, extra: dict | None = None) -> None:
    """Write one ordinary checkpoint (``load`` reads it) of a model whose weights are spread over
    processes, holding one tensor at a time: ``model`` (any part of it: it gives the class,
    hyper-parameters and dtype); ``layout`` {name: (shape, dtype)}, the whole model's state dict;
    ``tensors``, an iterable of (name, tensor) that gives each entry of ``layout`` once, in any order
    (e.g. received from the process that holds it while iterating). ``extra``: plain entries (no
    tensors) stored beside the weights.

    The archive is written first with every tensor's bytes left empty (``torch.save`` under
    ``torch.serialization.skip_data``); each tensor is then written into its record as it comes, and the
    records' CRC-32s filled in. Atomic as ``save``; an OSError is raised as OutputError."""
    import zlib

    config = _config(model)
    if any(isinstance(v, torch.Tensor) for v in (extra or {}).values()):
        raise CheckpointError("save_parts: extra entries must be plain values, not tensors")
    missing = sorted(set(all_parts(model.n_blocks)) - {model.part_of(key) for key in layout})
    if missing:
        raise CheckpointError(f"cannot write {path}: no piece holds the parts {missing}")
    placeholders = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in layout.items()}  # never touched
    with atomic_write(path, "w+b") as f:
        with torch.serialization.skip_data():
            torch.save(dict(extra or {}, config=config, state_dict=placeholders), f)
        f.flush()
        records = _data_records(f, torch.load(f.name, weights_only=True, mmap=True)["state_dict"], path)
        del placeholders
        crcs = {}
        for key, tensor in tensors:
            if key not in records or key in crcs:
                raise CheckpointError(f"cannot write {path}: {key!r} is {'given twice' if key in crcs else 'not in the layout'}")
            shape, dtype = layout[key]
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise CheckpointError(f"cannot write {path}: {key!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                                      f"the layout says {tuple(shape)} {dtype}")
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            offset, _ = records[key]
            if offset is not None:  # (an empty tensor has no bytes)
                f.seek(offset)
                f.write(memoryview(data))
            crcs[key] = zlib.crc32(data)
        if len(crcs) != len(layout):
            raise CheckpointError(f"cannot write {path}: no tensor given for {sorted(set(layout) - set(crcs))[:5]}")
        _write_crcs(f, {records[key][1]: crc for key, crc in crcs.items() if records[key][1] is not None})


def save_native_from(checkpoint, path, data=None) -> None:
    """Write the package's own file (``save_native``) of the model saved at ``checkpoint`` to ``path``, atomically.
    Where the model's class builds that file from its weights alone (``native_object``), one weight at a time: the
    file is written with its tensors' bytes left empty (``torch.save`` under ``skip_data``), then each weight is read
    from ``checkpoint`` and written into its record (a pipeline's rank 0 writes a model whose weights do not fit
    beside its stage's training state); else the model is loaded whole. ``data``: as ``save_native``'s."""
    import zlib

    checkpoint = os.fspath(checkpoint)
    try:
        payload = read_module_tree(checkpoint, deferred=True)
        config = json.loads(payload["config"])
        cls, sources = model_class(str(config["class"]), checkpoint), payload["state_dict"]
        hyperparameters = config["hyperparameters"]
    except (MLIPError, TypeError, KeyError, json.JSONDecodeError):
        cls = None  # (load names what is wrong with the file)
    placeholders = {} if cls is None else {k: torch.empty(d.size, dtype=d.dtype) for k, d in sources.items()
                                           if isinstance(d, Deferred)}  # never touched
    skeleton = cls.native_object(hyperparameters, placeholders) \
        if cls is not None and issubclass(cls, PackageModel) else None
    if skeleton is None:
        load(checkpoint).save_native(path, data=data)
        return
    source_of = {id(t): k for k, t in placeholders.items()}
    with atomic_write(path, "w+b") as f:
        with torch.serialization.skip_data():
            torch.save(skeleton, f)
        f.flush()
        written = read_module_tree(f.name, deferred=True)
        offsets = _record_offsets(f)
        records = {}  # record: the tensor of the checkpoint's state (its key) or of the skeleton itself
        for tensor, deferred in _paired(skeleton, written):
            records.setdefault(deferred.record, source_of.get(id(tensor), tensor))
        del placeholders, skeleton, source_of
        weights = {record: sources[key] for record, key in records.items() if isinstance(key, str)}
        constants = [(record, t) for record, t in records.items() if not isinstance(t, str)]
        crcs = {}
        for record, tensor in itertools.chain(read_each(checkpoint, weights), constants):
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            offset, info = offsets[record]
            if info.file_size != raw.nbytes:
                raise CheckpointError(f"cannot write {path}: {record} holds {info.file_size} bytes, its weight "
                                      f"{raw.nbytes}")
            f.seek(offset)
            f.write(memoryview(raw))
            crcs[info] = zlib.crc32(raw)
        _write_crcs(f, crcs)


def _paired(ours, theirs):
    """(tensor, Deferred) of each tensor of the object ``ours`` and the same place in ``theirs`` (the object as
    ``read_module_tree(deferred=True)`` reads it back: plain containers, stand-ins whose fields are an object's
    attributes)."""
    if isinstance(ours, torch.Tensor):
        yield ours, theirs
    elif isinstance(ours, dict):
        for k, v in ours.items():
            yield from _paired(v, theirs[k])
    elif isinstance(ours, (list, tuple)):
        for a, b in zip(ours, theirs, strict=True):
            yield from _paired(a, b)
    elif hasattr(ours, "__dict__"):
        yield from _paired(vars(ours), theirs._fields())


def _record_offsets(f) -> dict:
    """{record name: (file offset of its bytes, ZipInfo)} of the zip archive ``f``'s records."""
    f.seek(0)
    offsets = {}
    for info in zipfile.ZipFile(f).infolist():
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        offsets[info.filename] = info.header_offset + 30 + name_length + extra_length, info
    return offsets


def _data_records(f, skeleton: dict, path) -> dict:
    """{name: (file offset of its bytes, ZipInfo of its record)} of the state-dict entries of the
    archive ``f`` (``save_parts``' skeleton, whose only tensors are the state dict's, each with its own
    storage). ``skeleton``: the archive loaded memory-mapped (nothing is read but the pickle), so each
    tensor lies as far from the map's start as its record's bytes from the file's: the tensors in
    address order are the data records in file order. Empty tensors have no bytes (offset None)."""
    data = sorted(record for name, record in _record_offsets(f).items() if "/data/" in name and record[1].file_size > 0)
    held = sorted((t.untyped_storage().data_ptr(), k) for k, t in skeleton.items() if t.untyped_storage().nbytes())
    records = {k: (None, None) for k, t in skeleton.items() if not t.untyped_storage().nbytes()}
    if len(held) != len(data):
        raise CheckpointError(f"cannot write {path}: torch.save wrote {len(data)} data records for {len(held)} tensors")
    for (pointer, key), (offset, info) in zip(held, data):
        if pointer - held[0][0] != offset - data[0][0] or skeleton[key].untyped_storage().nbytes() != info.file_size:
            raise CheckpointError(f"cannot write {path}: this torch lays out checkpoints differently "
                                  f"({key!r} is not at {info.filename})")
        records[key] = offset, info
    return records


def _write_crcs(f, crcs: dict) -> None:
    """Set the CRC-32 of each record of ``crcs`` {ZipInfo: crc} in its local header and in the central
    directory of the zip archive ``f`` (``save_parts`` writes the bytes after torch.save's skeleton)."""
    by_name = {info.filename: crc for info, crc in crcs.items()}
    for info, crc in crcs.items():
        f.seek(info.header_offset + 14)
        f.write(struct.pack("<I", crc))
    f.seek(0)
    start = zipfile.ZipFile(f).start_dir  # the central directory: 46-byte headers, each with its name
    f.seek(start)
    while True:
        header = f.read(46)
        if len(header) < 46 or header[:4] != b"PK\x01\x02":
            break
        name_length, extra_length, comment_length = struct.unpack("<HHH", header[28:34])
        name = f.read(name_length).decode()
        if name in by_name:
            here = f.tell()
            f.seek(here - name_length - 46 + 16)
            f.write(struct.pack("<I", by_name[name]))
            f.seek(here)
        f.seek(extra_length + comment_length, 1)
