"""The files an ``mlip-md`` run appends to (OUTPUT/thermo.csv, OUTPUT/trajectory.extxyz or .traj), written
by rank 0, and how a restart records them so that a continued run cuts them back to the restart's step.

As GROMACS's checkpoints do (``mdrun -cpi -append``), a restart records each output file's size and a
SHA-256 of its last ``TAIL_BYTES`` when it is written (after flushing them to disk). Continuing from it,
``check_recorded`` refuses a file that is missing, shorter or different in that tail, and ``cut_back``
truncates each file to the recorded size: rows and frames written after the restart (by a run that was
killed, or ran out of disk, before its next restart) go, and a partial frame with them, so every step
appears once and every frame is whole.

ASE's .traj files (ULM) also change in place: their header counts the frames (bytes 32-39), points to a
table of frame offsets (bytes 40-47), and the table gains an entry per frame. Their record keeps the
frame count and the table's place; the digest skips the header and the table, and ``cut_back`` writes
the recorded count and table position back after truncating.
"""
from __future__ import annotations

import csv
import hashlib
import os
from pathlib import Path

import numpy as np

from mlip_parallel.config import ConfigError
from potentials.files import naming_errors

TAIL_BYTES = 1 << 20
ULM_BLOCK = 42  # ase.io.ulm.N1: the frame-offset table holds 1, 42, 42², ... entries


def file_record(path) -> dict:
    """{"size", "tail_sha256"} of the file at ``path`` (+ "frames", "table" for a .traj file)."""
    path = Path(path)
    record = {"size": path.stat().st_size}
    if path.suffix == ".traj":
        with open(path, "rb") as f:
            header = f.read(48)
        frames, table = (int(v) for v in np.frombuffer(header[32:48], "<i8"))
        record.update(frames=frames, table=table)
    record["tail_sha256"] = tail_digest(path, record)
    return record


def _masked(record) -> list:
    """Byte ranges a .traj file rewrites in place after its record: the header and the offset table."""
    if "frames" not in record:
        return []
    capacity = 1
    while record["frames"] > capacity:
        capacity *= ULM_BLOCK
    return [(0, 48), (record["table"], record["table"] + 8 * capacity)]


def tail_digest(path, record) -> str:
    """SHA-256 of the bytes [size - TAIL_BYTES, size) of ``path`` (``record["size"]``), the ranges of
    ``_masked(record)`` read as zeros."""
    size = record["size"]
    start = max(0, size - TAIL_BYTES)
    with open(path, "rb") as f:
        f.seek(start)
        data = bytearray(f.read(size - start))
    for lo, hi in _masked(record):
        lo, hi = max(lo, start) - start, min(hi, size) - start
        if hi > lo:
            data[lo:hi] = bytes(hi - lo)
    return hashlib.sha256(data).hexdigest()


def check_recorded(directory, record: dict, restart) -> None:
    """ConfigError unless every file of ``record`` (name → ``file_record``, from the restart file
    ``restart``) in ``directory`` still holds what it held when the restart was written."""
    for name, saved in record.items():
        path = Path(directory) / name
        if not path.is_file():
            raise ConfigError(f"{path} is missing: {restart} continues it from its first {saved['size']} bytes; "
                              f"restore the file or start a new run")
        size = path.stat().st_size
        if size < saved["size"] or tail_digest(path, saved) != saved["tail_sha256"]:
            what = f"is shorter ({size} bytes)" if size < saved["size"] else "has different contents"
            raise ConfigError(f"{path} {what} than when {restart} was written ({saved['size']} bytes): it is "
                              f"not this run's file, and is left as it is; restore it or start a new run")


def cut_back(directory, record: dict, appended=()) -> None:
    """Truncate each file of ``record`` in ``directory`` to its recorded size (a .traj file's header
    written back as recorded); ``check_recorded`` has accepted them. The files of ``appended`` (names a run
    appends to) that ``record`` does not hold were begun after the restart: they go (a record of none keeps them:
    a restart written without one)."""
    for name in appended if record else ():
        if name is not None and name not in record:
            with naming_errors(Path(directory) / name):
                (Path(directory) / name).unlink(missing_ok=True)
    for name, saved in record.items():
        path = Path(directory) / name
        with naming_errors(path), open(path, "r+b") as f:
            f.truncate(saved["size"])
            if "frames" in saved:
                f.seek(32)
                f.write(np.array([saved["frames"], saved["table"]], "<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())


DEVIATION_COLUMNS = ("step", "max_devi_f", "min_devi_f", "avg_devi_f", "devi_e")  # DeePMD's model_devi.out names
CANDIDATES = "candidates.extxyz"


class RunFiles:
    """Rank 0's open outputs of one run: ``row`` appends to thermo.csv, ``frame`` to the trajectory
    (``trajectory``: its file name, None for none); with ``deviation`` (a committee's run), ``deviation_row`` to
    model_devi.csv and ``candidate`` to candidates.extxyz; ``record`` flushes them and returns what a restart keeps
    of them. ``fresh``: start the files anew (else append to them: a continued run)."""

    def __init__(self, directory: Path, columns, trajectory: str | None, fresh: bool, deviation: bool = False):
        self.directory, self.trajectory = Path(directory), trajectory
        self.tables = {}  # file name -> (open file, csv writer)
        with naming_errors(self.directory):
            for name in ([trajectory] if trajectory is not None else []) + ([CANDIDATES] if deviation else []):
                if fresh:
                    (self.directory / name).unlink(missing_ok=True)
        self._open_table("thermo.csv", columns, fresh)
        if deviation:
            self._open_table("model_devi.csv", DEVIATION_COLUMNS, fresh)

    def _open_table(self, name: str, columns, fresh: bool) -> None:
        with naming_errors(self.directory / name):
            handle = open(self.directory / name, "w" if fresh else "a", newline="")
            writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
            if handle.tell() == 0:
                writer.writeheader()
        self.tables[name] = (handle, writer)

    def _append(self, name: str, row: dict) -> None:
        handle, writer = self.tables[name]
        with naming_errors(self.directory / name):
            writer.writerow(row)
            handle.flush()

    def row(self, row: dict) -> None:
        self._append("thermo.csv", row)

    def deviation_row(self, row: dict) -> None:
        self._append("model_devi.csv", row)

    def candidate(self, atoms) -> None:
        """A frame to label: its structure and the per-atom array devi_f, no energy or forces (they are the
        committee's guesses, not labels)."""
        path = self.directory / CANDIDATES
        with naming_errors(path), open(path, "a") as f:
            write_extxyz(f, atoms)

    def frame(self, atoms) -> None:
        path = self.directory / self.trajectory
        with naming_errors(path):
            if path.suffix == ".traj":  # ase.io.write cannot append to .traj files: use the Trajectory
                from ase.io.trajectory import Trajectory
                with Trajectory(path, "a") as trajectory_file:
                    trajectory_file.write(atoms)
            else:
                with open(path, "a") as f:
                    write_extxyz(f, atoms)

    def record(self) -> dict:
        """{file name: file_record} of every output file written so far, after flushing them to disk."""
        for name, (handle, _) in self.tables.items():
            with naming_errors(self.directory / name):
                handle.flush()
                os.fsync(handle.fileno())
        names = [*self.tables, self.trajectory, CANDIDATES]  # a file not written yet: not recorded
        return {name: file_record(self.directory / name) for name in names
                if name is not None and (self.directory / name).exists()}

    def close(self) -> None:
        for handle, _ in self.tables.values():
            handle.close()


def write_extxyz(file, atoms) -> None:
    """Write ``atoms`` to the open text ``file`` as extended XYZ as ASE writes it (info, calculator
    energy/stress, momenta, forces), with every number at full precision (ASE's writer keeps 8 decimals)."""
    from ase.io.extxyz import output_column_format, save_calc_results
    from ase.stress import voigt_6_to_full_3x3_stress

    frame = atoms.copy()
    if atoms.calc is not None:
        save_calc_results(frame, atoms.calc, calc_prefix="")  # energy, stress → info; forces → arrays
    if "stress" in frame.info:
        frame.info["stress"] = voigt_6_to_full_3x3_stress(frame.info["stress"])
    columns = ["symbols", "positions"] + [k for k in ("momenta", "forces") if k in frame.arrays] + \
        sorted(k for k in frame.arrays if k not in ("numbers", "positions", "momenta", "forces"))
    arrays = dict(frame.arrays, symbols=np.array(frame.get_chemical_symbols()))
    comment = output_column_format(frame, columns, arrays)[0]
    values = np.hstack([np.asarray(arrays[k]).reshape(len(frame), -1) for k in columns[1:]]).tolist()
    file.write(f"{len(frame)}\n{comment}\n")
    file.writelines(f"{symbol} {' '.join(map(repr, row))}\n" for symbol, row in zip(arrays["symbols"], values))
