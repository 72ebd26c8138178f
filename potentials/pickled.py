"""Read a pickled torch module tree (``torch.save(model)``) without running any of the pickle's code.

A pickle names the classes and functions it needs ("GLOBAL module name") and the unpickler imports and
calls them: that is how a model file can run any command. Here only tensors, plain containers and a
few data types are rebuilt — torch's own ``weights_only`` allowlist, and e3nn's ``Irreps`` (tuples of
integers); every other global becomes a ``Pickled`` stand-in class that records what the pickle said
about its instances (constructor arguments and state) and imports nothing. A module traced by
``torch.fx`` (as ``mace.tools.compile.prepare`` traces MACE's symmetric contractions) reads as the
attributes its pickled body holds (the traced parameters and buffers under their module paths); a
``torch.compile`` wrapper is read as the module it wraps. The zip archive and its
tensor storages are read here too, not by ``torch.load`` (which would pass a TorchScript archive to
``torch.jit.load`` and a legacy, non-zip file to plain pickle).

e3nn modules that generate code (``CodeGenMixin``: tensor products, linears) pickle their generated
TorchScript (or fx) modules as bytes, and their constants (Wigner 3j coefficients) only there:
``codegen_tensors(tree)`` reads those constants out of the bytes the same way, nothing run.

The stand-ins answer attribute reads the way ``torch.nn.Module`` does (an instance's plain attributes,
then its ``_parameters``, ``_buffers`` and ``_modules``) and index like a ``ModuleList``, so that a
package's own code (or code written after it) can read hyper-parameters off the tree, and
``state_dict(tree)`` collects the tensors a strict ``load_state_dict`` needs.

``read_module_tree(path, deferred=True)`` reads no storage: each tensor is a ``Deferred`` record, and
``read_deferred(path, part)`` reads those of ``part`` (a dict or list of them) only: a pipeline stage
reads its own weights out of a whole model's file; ``read_each`` reads them one at a time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle

import torch

from .errors import MLIPError


GRAPH_MODULE = "torch.fx.graph_module.reduce_graph_module"  # how an fx.GraphModule pickles: (body dict, imports)
COMPILED_MODULE = "torch._dynamo.eval_frame.OptimizedModule"  # torch.compile's wrapper of a module


class PickleFileError(MLIPError, ValueError):
    """A pickled model file cannot be read: missing, not a torch archive, or damaged."""


class Pickled:
    """Stand-in for an object whose class the pickle named but the reader did not import.

    ``type(obj).path``: the class's "module.name"; ``obj.pickled_args``: the arguments the pickle
    constructed it with; ``obj.pickled_state``: what it handed to ``__setstate__`` (a module's
    ``__dict__``), or None.
    """

    path = ""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        object.__setattr__(obj, "pickled_args", args)
        object.__setattr__(obj, "pickled_state", None)
        return obj

    def __init__(self, *args, **kwargs):  # REDUCE calls the class; nothing runs
        pass

    def __setstate__(self, state):
        object.__setattr__(self, "pickled_state", state)

    def _fields(self) -> dict:
        state = self.pickled_state
        if state is None and type(self).path == GRAPH_MODULE and self.pickled_args:  # an fx.GraphModule: its body
            state = self.pickled_args[0]
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        return state if isinstance(state, dict) else {}

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        fields = self._fields()
        if name in fields:
            return fields[name]
        for group in ("_parameters", "_buffers", "_modules"):
            members = fields.get(group) or {}
            if name in members:
                return members[name]
        raise AttributeError(f"the pickled {type(self).path} has no attribute {name!r}")

    def _members(self) -> list:
        fields = self._fields()
        return list((fields.get("_modules") or fields.get("_parameters") or {}).values())

    def __getitem__(self, k):  # ModuleList / ParameterList
        return self._members()[k]

    def __len__(self):
        return len(self._members())

    def __iter__(self):
        return iter(self._members())

    def __repr__(self):
        return f"<pickled {type(self).path}>"


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A tensor of a torch archive not read yet: its storage's record in the archive, dtype, and the tensor's
    offset (in elements), size and stride within that storage."""

    record: str
    dtype: torch.dtype
    offset: int
    size: tuple
    stride: tuple


def _deferred_tensor(storage, offset, size, stride, *_):
    """``torch._utils._rebuild_tensor_v2`` of a deferred read: ``storage`` is (record, dtype)."""
    record, dtype = storage
    return Deferred(record, dtype, int(offset), tuple(size), tuple(stride))


def _deferred_parameter(data, *_):
    """``torch._utils._rebuild_parameter`` of a deferred read: the tensor's record itself."""
    return data


def _reconstructor(cls, base, state):
    """``copyreg._reconstructor`` for stand-ins only (protocol 0/1 objects)."""
    if not (isinstance(cls, type) and issubclass(cls, Pickled)):
        raise pickle.UnpicklingError(f"refused to reconstruct {cls!r}")
    return cls.__new__(cls)


def _data_types() -> dict:
    """Globals rebuilt as themselves: torch's weights_only allowlist (tensors, storages, dtypes, plain
    containers) and e3nn's irreps (tuples of integers, built without running other code)."""
    from torch._weights_only_unpickler import _get_allowed_globals

    allowed = dict(_get_allowed_globals())
    allowed["copyreg._reconstructor"] = _reconstructor
    allowed["builtins.object"] = object
    try:
        from e3nn.o3 import _irreps
    except ImportError:
        pass
    else:
        for name in ("Irrep", "Irreps", "_MulIr"):
            allowed[f"e3nn.o3._irreps.{name}"] = getattr(_irreps, name)
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    allowed: dict = {}
    standins: dict = {}

    def find_class(self, module, name):
        path = f"{module}.{name}"
        if module == "__builtin__":  # protocol 2 pickles written by Python 2 era code paths
            path = f"builtins.{name}"
        if path in self.allowed:
            return self.allowed[path]
        if path not in self.standins:
            self.standins[path] = type(name, (Pickled,), {"path": path, "__module__": "pickled." + module})
        return self.standins[path]


def _archive_root(archive) -> str:
    """The prefix of a torch zip archive's records ("PREFIX/"), checked to be one little-endian torch archive."""
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise pickle.UnpicklingError(f"not a torch archive: {len(pickles)} data.pkl records")
    root = pickles[0][: -len("data.pkl")]
    if f"{root}byteorder" in archive.namelist() and archive.read(f"{root}byteorder").strip() != b"little":
        raise pickle.UnpicklingError("written on a big-endian machine; not supported")
    return root


def _storage(archive, record: str, dtype: torch.dtype):
    data = torch.UntypedStorage.from_buffer(archive.read(record), dtype=torch.uint8)
    return torch.storage.TypedStorage(wrap_storage=data, dtype=dtype, _internal=True)


def _load_archive(archive, what: str, deferred: bool = False):
    """The object pickled in a torch zip archive (``torch.save`` or ``torch.jit.save`` layout: one
    ``PREFIX/data.pkl`` and its storages in ``PREFIX/data/KEY``), unpickled with the restricted
    unpickler; storages are read from the archive's records (``deferred``: not read, each tensor a
    ``Deferred``). No torch loader runs (torch.load would hand a TorchScript archive to torch.jit.load,
    and a file that is not a zip to plain pickle)."""
    import io

    root = _archive_root(archive)
    storages: dict = {}
    allowed = _data_types()
    if deferred:
        allowed["torch._utils._rebuild_tensor_v2"] = _deferred_tensor
        allowed["torch._utils._rebuild_parameter"] = _deferred_parameter

    class Unpickler(_RestrictedUnpickler):
        standins: dict = {}

        def persistent_load(self, saved_id):
            if not (isinstance(saved_id, tuple) and len(saved_id) == 5 and saved_id[0] == "storage"):
                raise pickle.UnpicklingError(f"unknown persistent id {str(saved_id)[:80]}")
            _, storage_type, key, _location, _numel = saved_id
            dtype = getattr(storage_type, "dtype", None)
            if not isinstance(dtype, torch.dtype):
                raise pickle.UnpicklingError(f"storage of unknown type {storage_type!r}")
            if deferred:
                return f"{root}data/{key}", dtype
            if key not in storages:
                storages[key] = _storage(archive, f"{root}data/{key}", dtype)
            return storages[key]

    Unpickler.allowed = allowed

    try:
        return Unpickler(io.BytesIO(archive.read(f"{root}data.pkl"))).load()
    except RecursionError:
        raise pickle.UnpicklingError(f"{what} nests too deeply") from None


def read_module_tree(path, deferred: bool = False):
    """The object tree of a ``torch.save(module)`` file, every class of it a ``Pickled`` stand-in
    (tensors are real, on the CPU; ``deferred``: ``Deferred`` records, for ``read_deferred``). Nothing
    the pickle names is imported or run. PickleFileError if the file is missing, is not a torch zip
    archive, or is damaged."""
    path = _check_archive(path)
    with _opened(path) as archive:
        tree = _load_archive(archive, path, deferred)
    while isinstance(tree, Pickled) and type(tree).path == COMPILED_MODULE and tree.pickled_args:
        tree = tree.pickled_args[0]  # torch.compile's wrapper pickles as (the module, its compile options)
    return tree


def read_deferred(path, part):
    """``part`` (a ``Deferred``, or a dict, list or tuple holding them) with each ``Deferred`` read from the torch
    archive at ``path`` as its tensor (on the CPU; a storage shared by several read once)."""
    path = _check_archive(path)
    storages: dict = {}

    def tensor(archive, value):
        if isinstance(value, Deferred):
            return _tensor(archive, value, storages)
        if isinstance(value, dict):
            return type(value)((k, tensor(archive, v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(tensor(archive, v) for v in value)
        return value

    with _opened(path) as archive:
        return tensor(archive, part)


def read_each(path, deferred: dict):
    """(key, tensor) of each ``Deferred`` of ``deferred`` {key: Deferred}, read from the torch archive at ``path``
    one at a time as the caller takes them (the archive opened once; nothing kept between them)."""
    path = _check_archive(path)
    with _opened(path) as archive:
        for key, value in deferred.items():
            yield key, _tensor(archive, value, {})


def _tensor(archive, value: Deferred, storages: dict) -> torch.Tensor:
    """The tensor of ``value`` out of ``archive``, its storage read into ``storages`` {record: storage} once."""
    if value.record not in storages:
        storages[value.record] = _storage(archive, value.record, value.dtype)
    return torch._utils._rebuild_tensor_v2(storages[value.record], value.offset, value.size, value.stride, False, {})


def _check_archive(path) -> str:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PickleFileError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":  # torch's own test: a zip from its first byte (not a pickle with a zip after)
        raise PickleFileError(f"{path}: not a torch.save archive (truncated, corrupt, or another format)")
    return path


@contextlib.contextmanager
def _opened(path: str):
    """The torch zip archive at ``path``, open within; what goes wrong reading it is raised as PickleFileError."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            yield archive
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError, KeyError, AttributeError,
            TypeError, IndexError, OSError) as exc:
        raise PickleFileError(f"{path}: cannot read the pickled model ({type(exc).__name__}: "
                              f"{(str(exc).splitlines() or [''])[0]})") from None


def _archive_tensors(raw: bytes) -> dict:
    """The tensor attributes of the module pickled in a TorchScript archive (``torch.jit.save`` bytes),
    read with the restricted unpickler: {attribute: tensor}. The archive's code is never loaded."""
    import io
    import zipfile

    module = _load_archive(zipfile.ZipFile(io.BytesIO(raw)), "generated code")
    fields = module._fields() if isinstance(module, Pickled) else {}
    return {k: v for k, v in fields.items() if isinstance(v, torch.Tensor)}


def codegen_tensors(tree, prefix: str = "") -> dict:
    """The constants of every e3nn code-generated submodule in a pickled tree, keyed as the rebuilt
    model's ``state_dict`` keys them ("interactions.1.conv_tp._compiled_main_left_right._w3j_1_2_1").
    e3nn 0.4 pickles each as TorchScript bytes, e3nn >= 0.5 as ("torchscript", bytes) or ("fx", bytes)."""
    out = {}
    fields = tree._fields()
    for fname, saved in (fields.get("__codegen__") or {}).items():
        kind, raw = saved if isinstance(saved, tuple) else ("torchscript", saved)
        if kind == "torchscript":
            tensors = _archive_tensors(raw)
        else:  # an fx.GraphModule pickled with plain pickle: its body dict holds the constants
            import io

            class Unpickler(_RestrictedUnpickler):
                allowed = dict(_data_types(), **{"torch.storage._load_from_bytes": _storage_from_bytes})
                standins: dict = {}

            module = Unpickler(io.BytesIO(raw)).load()  # reduce_graph_module(body, imports): a stand-in
            body = module.pickled_args[0] if isinstance(module, Pickled) and module.pickled_args else {}
            body = body if isinstance(body, dict) else {}
            tensors = {k: v for group in ("_parameters", "_buffers") for k, v in (body.get(group) or {}).items()
                       if isinstance(v, torch.Tensor)}
        out.update({f"{prefix}{fname}.{k}": v for k, v in tensors.items()})
    for name, child in (fields.get("_modules") or {}).items():
        if isinstance(child, Pickled):
            out.update(codegen_tensors(child, f"{prefix}{name}."))
    return out


def traced_prefixes(tree, prefix: str = "") -> list:
    """The ``state_dict`` key prefixes ("products.0.symmetric_contractions.") of the modules of a pickled tree
    that ``torch.fx`` traced: their bodies hold only the tensors the traced forward reads."""
    if type(tree).path == GRAPH_MODULE:
        return [prefix]
    return [p for name, child in (tree._fields().get("_modules") or {}).items() if isinstance(child, Pickled)
            for p in traced_prefixes(child, f"{prefix}{name}.")]


def _storage_from_bytes(raw: bytes):
    """``torch.storage._load_from_bytes`` (how plain pickle stores a tensor's storage), tensors only."""
    import io

    return torch.load(io.BytesIO(raw), weights_only=True)


def state_dict(tree, prefix: str = "") -> dict:
    """The persistent parameters and buffers of a pickled module tree, keyed as ``Module.state_dict``
    keys them ("interactions.0.linear.weight")."""
    out = {}
    fields = tree._fields()
    transient = set(fields.get("_non_persistent_buffers_set") or ())
    for name, value in (fields.get("_parameters") or {}).items():
        if value is not None:
            out[prefix + name] = value.detach() if isinstance(value, torch.Tensor) else value
    for name, value in (fields.get("_buffers") or {}).items():
        if value is not None and name not in transient:
            out[prefix + name] = value
    for name, child in (fields.get("_modules") or {}).items():
        if isinstance(child, Pickled):
            out.update(state_dict(child, f"{prefix}{name}."))
    return out
