"""Labelled structures read lazily, by index, in the files' own order: a data set that is never held whole.

``open_source(paths, keys=None)`` gives a ``Source``: ``len(source)`` structures, ``source[k]`` reads structure k
from disk (a ``structures.Structure``; DataError naming the file and the index for one that cannot be used) and
keeps nothing of it. The formats:

* extxyz / xyz: a one-time index of each frame's byte offset (a scan of the count lines, no parsing), kept in a
  cache directory (``MLIP_PARALLEL_CACHE``, else ``~/.cache/mlip-parallel``) under the file's absolute path, size and
  modification time, so a changed file is indexed anew; frame k is then read by seeking to it and parsing it alone
  with ASE's extxyz reader;
* ASE db (``.db``, SQLite) and fairchem's ASE-LMDB (``.aselmdb``, the ``ase-db-backends`` package, as OMat24 and
  OMol25 ship): rows by id, in id order;
* any other file ASE reads: read whole, once (no random access there);
* a list of these: one data set, the files' structures in the listed order.

Labels: the energy, forces and stress of a frame's calculator results (as ASE reads them), else its info / arrays
entries of those names; ``keys`` renames them (``{"energy": "REF_energy", "forces": "REF_forces", "stress":
"REF_stress"}``, as MACE's ``--energy_key``): the label is then read from the results, info or arrays entry of that
name. Each structure's ``config_type``, ``charge`` (e) and ``spin`` (multiplicity) are info entries of those names
(renamed by ``keys`` alike); a charge or spin is read by a model that takes one (fairchem's omol task), else unused.
"""
from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np

from .structures import DataError, Structure, structure_of

QUANTITIES = ("energy", "forces", "stress")
EXTXYZ = (".xyz", ".extxyz")
DATABASES = {".db": None, ".aselmdb": "aselmdb"}


def cache_directory() -> Path:
    """Where the extxyz indices are kept: ``MLIP_PARALLEL_CACHE``, else ``~/.cache/mlip-parallel``."""
    return Path(os.environ.get("MLIP_PARALLEL_CACHE") or Path.home() / ".cache" / "mlip-parallel") / "index"


KEYS = QUANTITIES + ("config_type", "charge", "spin")  # what data.keys names: the labels, each structure's kind,
# its total charge and spin multiplicity


def check_keys(keys) -> dict:
    """``keys`` as {key: name} for the labels, config_type, charge and spin (missing ones: their own names); DataError for an
    unknown key or a name that is not text."""
    keys = dict(keys or {})
    unknown = sorted(set(keys) - set(KEYS))
    if unknown:
        raise DataError(f"data.keys: {unknown[0]!r} is not a key it takes ({', '.join(KEYS)})")
    for quantity, name in keys.items():
        if not isinstance(name, str) or not name:
            raise DataError(f"data.keys.{quantity}: the name of a label in the files, got {name!r}")
    return {q: keys.get(q, q) for q in KEYS}


class Source:
    """A data set's structures by index (``len``, ``[k]``, iteration); read from disk at every access."""

    def __init__(self, parts):
        self.parts = list(parts)  # FileSource (or Subset) each
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, k):
        if isinstance(k, slice):
            return Subset(self, np.arange(len(self))[k])
        if not -len(self) <= k < len(self):
            raise IndexError(f"structure {k} of {len(self)}")
        k = k % len(self)
        part = int(np.searchsorted(self.starts, k, side="right")) - 1
        return self.parts[part][k - int(self.starts[part])]

    def __iter__(self):
        for part in self.parts:
            for k in range(len(part)):
                yield part[k]


    def where(self, k: int) -> str:
        """Structure ``k`` named as its file names it: ``PATH:k`` (k counted within its file, from 0)."""
        part = int(np.searchsorted(self.starts, k, side="right")) - 1
        owner = self.parts[part]
        return f"{owner.path if isinstance(owner, FileSource) else owner.structures.name}:{k - int(self.starts[part])}"

    @property
    def name(self) -> str:
        """The files, comma-separated."""
        return ", ".join(p.path if isinstance(p, FileSource) else p.structures.name for p in self.parts)


class Subset:
    """``structures`` (a ``Source``, a ``Subset`` or a list) at ``indices``: ``len``, ``[k]`` (a slice: a ``Subset``),
    iteration; each structure read when used, none kept."""

    def __init__(self, structures, indices):
        self.structures, self.indices = structures, np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return Subset(self.structures, self.indices[k])
        return self.structures[int(self.indices[k])]

    def __iter__(self):
        for k in self.indices:
            yield self.structures[int(k)]


def take(structures, indices):
    """``structures`` at ``indices``: a list of a list (the structures held), else a ``Subset`` (read when used)."""
    if isinstance(structures, list):
        return [structures[int(k)] for k in indices]
    return Subset(structures, indices)


class FileSource:
    """One file's structures (``len``, ``[k]``: a ``training.Structure`` named ``PATH:k``, or with ``as_atoms`` the
    ASE Atoms as read, its info and arrays whole, no calculator, after the same checks; ``read``: many in turn)."""

    as_atoms = False

    def __init__(self, path: str, keys: dict):
        self.path, self.keys = path, keys

    def structure(self, atoms, k: int):
        record = structure_of(atoms, self.path, k, self.keys)
        if self.as_atoms:
            atoms.calc = None
            return atoms
        return record

    def read(self, positions):
        """The structures at ``positions``, in turn (a generator: one held at a time; DataError at one that cannot
        be read)."""
        for k in positions:
            yield self[k]


class ExtxyzSource(FileSource):
    """An extxyz file by the byte offsets of its frames (``index_extxyz``)."""

    def __init__(self, path, keys):
        super().__init__(path, keys)
        self.offsets = extxyz_offsets(path)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, k: int):
        with open(self.path, "rb") as f:
            return self.frame(f, k)

    def read(self, positions):
        with open(self.path, "rb") as f:  # (one open file for all: a survey reads every structure)
            for k in positions:
                yield self.frame(f, k)

    def frame(self, f, k: int):
        """Structure ``k`` read from ``f``, this file opened in binary."""
        from ase.io.extxyz import read_xyz

        f.seek(int(self.offsets[k]))
        text = f.read(int(self.offsets[k + 1] - self.offsets[k])).decode()
        try:
            atoms = next(read_xyz(io.StringIO(text), index=0))
        except Exception as exc:  # ASE raises many types for a malformed frame
            raise DataError(f"{self.path}: structure {k} (counting from 0) cannot be read: {type(exc).__name__}: "
                            f"{exc}") from None
        return self.structure(atoms, k)


class DatabaseSource(FileSource):
    """An ASE database's rows (SQLite ``.db``, or ``.aselmdb`` through ase-db-backends), in id order."""

    def __init__(self, path, keys, kind):
        super().__init__(path, keys)
        self.kind = kind
        db = self.connect()
        try:  # (ASE-LMDB keeps its ids beside the rows: listed without decoding a row)
            self.ids = sorted(db.ids if self.kind == "aselmdb" else
                              (row.id for row in db.select(include_data=False, columns=["id"])))
        except Exception as exc:  # a damaged index: sqlite3 and lmdb raise many types
            raise DataError(f"{self.path}: cannot list its rows: {type(exc).__name__}: "
                            f"{(str(exc).splitlines() or [''])[0]}") from None

    def connect(self):
        """A connection of this process's own (``serial``: under MPI, ASE's databases otherwise read on rank 0 alone
        and broadcast what it read, so every rank would get rank 0's rows, not the ones it asked for)."""
        if self.kind == "aselmdb":
            try:
                from ase_db_backends.aselmdb import LMDBDatabase
            except ImportError:
                raise DataError(f"{self.path}: reading ASE-LMDB needs the ase-db-backends package (pip install "
                                f"ase-db-backends; the fairchem extra has it)") from None
            return LMDBDatabase(self.path, readonly=True, serial=True)
        import ase.db

        return ase.db.connect(self.path, type="db", serial=True)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: int):
        if getattr(self, "_db", None) is None or self._pid != os.getpid():  # one connection per process
            self._db, self._pid = self.connect(), os.getpid()
        try:
            row = self._db.get(id=self.ids[k])
            atoms = row.toatoms()
            atoms.info.update(row.key_value_pairs)
            for name, value in (row.data or {}).items():
                array = np.asarray(value)
                (atoms.arrays if array.ndim and array.shape[0] == len(atoms) and name not in atoms.info
                 else atoms.info)[name] = array
        except Exception as exc:  # a row gone or damaged: sqlite3, zlib, numpy, ase.db and lmdb raise many types
            raise DataError(f"{self.path}: structure {k} (counting from 0; row id {self.ids[k]}) cannot be read: "
                            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}") from None
        return self.structure(atoms, k)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_db", "_pid")}


class WholeFileSource(FileSource):
    """A file ASE reads only whole (no index): read once, kept."""

    def __init__(self, path, keys):
        from ase.io import read

        super().__init__(path, keys)
        try:
            self.frames = read(path, index=":")
        except Exception as exc:  # ASE raises many types for unreadable files
            raise DataError(f"{path}: cannot read structures: {type(exc).__name__}: {exc}") from None

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, k: int):
        return self.structure(self.frames[k].copy() if self.as_atoms else self.frames[k], k)  # (a task moves its atoms)


def open_source(paths, keys=None, as_atoms: bool = False) -> Source:
    """The data set of ``paths`` (a path, or a list of them read as one set in order); DataError for a missing,
    unreadable or empty file. ``as_atoms``: its items are ASE Atoms (``FileSource``), not ``Structure`` records."""
    keys = check_keys(keys)
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise DataError("no data file given")
    parts = []
    for path in paths:
        if not isinstance(path, (str, os.PathLike)):
            raise DataError(f"a data file is a path, got {path!r}")
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such data file")
        suffix = Path(path).suffix.lower()
        if suffix in EXTXYZ:
            part = ExtxyzSource(path, keys)
        elif suffix in DATABASES:
            part = DatabaseSource(path, keys, DATABASES[suffix])
        else:
            part = WholeFileSource(path, keys)
        if len(part) == 0:
            raise DataError(f"{path}: no structures in the file")
        part.as_atoms = as_atoms
        parts.append(part)
    return Source(parts)


def cached_file(key: str, suffix: str) -> Path:
    """Where the cache keeps what was learnt of a file under ``key`` (text naming the file and what it holds)."""
    return cache_directory() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}{suffix}"


def file_stamp(path) -> np.ndarray:
    """[size, modification time in ns] of a file: a cached entry of another stamp is of another file."""
    stat = os.stat(path)
    return np.array([stat.st_size, stat.st_mtime_ns], dtype=np.int64)


def load_cached(cached: Path, stamp) -> dict | None:
    """The arrays cached at ``cached`` when they were saved under ``stamp``, else None (none, another stamp, a
    damaged file)."""
    try:
        with np.load(cached) as saved:
            if np.array_equal(saved["stamp"], stamp):
                return {name: saved[name] for name in saved.files if name != "stamp"}
    except (OSError, KeyError, ValueError):
        pass
    return None


def save_cached(cached: Path, stamp, arrays: dict) -> None:
    """Keep ``arrays`` at ``cached`` under ``stamp``, atomically; where the cache is not writable, nothing (they are
    computed again next time)."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.stem}.{os.getpid()}.partial.npz")
        np.savez(partial, stamp=stamp, **arrays)
        os.replace(partial, cached)
    except OSError:
        pass


def extxyz_offsets(path) -> np.ndarray:
    """[frames + 1] byte offsets of an extxyz file's frames (and its end): from the cache when it holds the index of
    this very file (its path, size and modification time), else ``index_extxyz`` (then cached, where writable)."""
    path = os.path.abspath(path)
    cached, stamp = cached_file(path, ".npz"), file_stamp(path)
    found = load_cached(cached, stamp)
    if found is not None:
        return found["offsets"]
    offsets = index_extxyz(path)
    save_cached(cached, stamp, {"offsets": offsets})
    return offsets


def index_extxyz(path) -> np.ndarray:
    """The byte offset of every frame of an extxyz file, and the file's end [frames + 1]: each frame is a count line
    N, a comment line and N atom lines. DataError naming the line where that does not hold."""
    offsets = []
    with open(path, "rb") as f:
        line_number, position = 0, 0
        while True:
            line = f.readline()
            if not line:
                break
            line_number += 1
            if not line.strip():  # blank lines between or after frames
                position += len(line)
                continue
            try:
                count = int(line)
            except ValueError:
                raise DataError(f"{path}: cannot read structures: line {line_number}: expected the atom count of a "
                                f"frame (extxyz), got "
                                f"{line[:40].decode(errors='replace').strip()!r}") from None
            offsets.append(position)
            position += len(line)
            for _ in range(count + 1):
                body = f.readline()
                if not body:
                    raise DataError(f"{path}: cannot read structures: frame {len(offsets) - 1} (counting from 0) "
                                    f"ends early: the file ends inside it")
                position += len(body)
            line_number += count + 1
    offsets.append(position)
    return np.asarray(offsets, dtype=np.int64)


def read_structures(path, keys=None) -> list[Structure]:
    """All structures of a data set (a file ASE reads, or a list of them; ``keys``: the labels' names, see
    the module docstring), read into memory."""
    return list(open_source(path, keys))


def split(structures, fractions, seed: int):
    """Shuffle (seeded) and cut into len(fractions) + 1 parts: the first takes what the others leave. Lists give
    lists; a ``sources.Source`` gives ``Subset`` views (nothing read)."""
    order = np.random.default_rng(seed).permutation(len(structures))
    sizes = [int(round(f * len(structures))) for f in fractions]
    parts, start = [], sum(sizes)
    parts.append(take(structures, order[:len(structures) - start]))
    for size in sizes:
        parts.append(take(structures, order[len(structures) - start: len(structures) - start + size]))
        start -= size
    return parts
