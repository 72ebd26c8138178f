"""mlip-batch CONFIG.yaml: single points or relaxations of many structures, batched, spread over ranks (mpiexec -n P).

Every rank reads the same config and the same structure files (extxyz, ASE db, ASE-LMDB: read one structure at a
time, as mlip-train reads them). The structures, largest first, form one queue shared by the ranks (an atomic
counter: a rank that finishes early takes more; none is done twice); each rank evaluates the structures it took in
batches (``md.batch.run_tasks``). Each finished structure is appended to the rank's OUTPUT/parts/rankR.extxyz and
recorded in OUTPUT/parts/rankR.done (its input index and the file's length after it, synced), so a killed job run
again with ``resume: true`` skips what was done and cuts a half-written frame off. At the end rank 0 writes
OUTPUT/results.extxyz: one frame per input structure in input order, with ``info["index"]`` (its position in the
input), "energy", "converged", "steps", forces and stress as ASE's single-point calculator keeps them (a committee's
deviation beside them). Here: the configuration's keys, the job and the command.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from mlip_parallel.config import ConfigError, ConfigTable, check_output_directory, config_parser, read_job, \
    report_error
from mlip_parallel.errors import MLIPError
from mlip_parallel.launch import end_job
from potentials.errors import OutputError
from potentials.families import FamilyError
from potentials.files import atomic_write, naming_errors

from .cli import model_keys

SECTIONS = {
    "structures": ((str, list), None, "the structures: an extxyz file, an ASE database (.db) or an ASE-LMDB "
                                      "(.aselmdb), or a list of them read as one set in order (required)"),
    "task": (str, "single_point", "single_point (energy, forces, stress of each structure) or relax (ASE's FIRE, "
                                  "each structure to its own fmax or step limit)"),
    "relax": {
        "fmax": (float, 0.05, "relax: converged when the largest force (with cell: the largest component of "
                              "FrechetCellFilter's gradient, stress × volume included) is below this, eV/Å"),
        "max_steps": (int, 1000, "relax: at most this many FIRE steps per structure (then converged: false)"),
        "cell": (bool, False, "relax: also relax the cell (ASE's FrechetCellFilter, at zero pressure)"),
    },
    "max_atoms": (int, None, "the most atoms evaluated together as one graph on a rank (default: 512 on a CPU, "
                             "where larger graphs cost more per atom; on a GPU as many as the memory model allows)"),
    "memory_budget_gb": (float, None, "GB one chunk of a block's per-edge temporaries may take (default: every edge "
                                      "at once where the memory pre-flight predicts that fits); never changes results"),
    "min_distance": (float, 0.5, "atoms closer than this (Å, periodic images included) are an error naming the "
                                 "structure and the pair (0: not checked)"),
    "device": (str, "auto", "auto (cuda:<local rank> where CUDA exists, else cpu), cpu or cuda"),
    "resume": (bool, False, "continue the run in output.directory: the structures it finished are kept and skipped, "
                            "the rest are done (the config must be the one that run had)"),
    "output": {
        "directory": (str, "batch_output", "output directory: results.extxyz at the end, parts/ while it runs"),
        "overwrite": (bool, False, "write over a non-empty output directory (refused otherwise, unless resume)"),
        "progress": (bool, True, "report progress on stderr (structures done, structures/s, ETA); false "
                                 "(or --no-progress): none"),
    },
}
RULES = {"task": ("single_point", "relax"), "device": ("auto", "cpu", "cuda"), "relax.fmax": "> 0",
         "max_atoms": "> 0", "memory_budget_gb": "> 0"}
TABLE = ConfigTable(SECTIONS, RULES, model_keys)
RESULTS, PARTS, RECORD = "results.extxyz", "parts", "batch.json"
RESUMABLE = ("resume", "output")  # keys a resumed run may change


def read_records(path: Path) -> list:
    """[(index, end offset)] of a rank's record file, its complete lines only (a line cut by a kill is not one)."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")[:-1]  # (the part after the last newline is unfinished)
    return [(int(a), int(b)) for a, b in (line.split() for line in lines)]


class PartFiles:
    """This rank's appended outputs in ``directory``: ``append(index, text)`` adds one finished structure's frame
    to rankR.extxyz, then its record (index, the file's length after it) to rankR.done, each synced: a frame without
    its record (a kill between the two) is cut off when the rank opens its files again."""

    def __init__(self, directory: Path, rank: int):
        self.frames, self.records = directory / f"rank{rank}.extxyz", directory / f"rank{rank}.done"
        done = read_records(self.records)
        with naming_errors(self.frames):
            with open(self.frames, "ab") as f:
                f.truncate(done[-1][1] if done else 0)
            with open(self.records, "a") as f:
                f.truncate(sum(len(f"{k} {e}\n") for k, e in done))
            self.frame_file, self.record_file = open(self.frames, "ab"), open(self.records, "a")

    def append(self, index: int, text: str) -> None:
        for handle, data, path in ((self.frame_file, text.encode(), self.frames), (self.record_file, None,
                                                                                   self.records)):
            with naming_errors(path):
                handle.write(data if data is not None else f"{index} {self.frame_file.tell()}\n")
                handle.flush()
                os.fsync(handle.fileno())

    def close(self) -> None:
        self.frame_file.close()
        self.record_file.close()


def finished_frames(directory: Path) -> dict:
    """{index: frame text} of every structure a rank recorded in ``directory`` (any number of ranks, any runs; the
    first record of an index wins)."""
    frames = {}
    for records in sorted(directory.glob("rank*.done")):
        done = read_records(records)
        if not done:
            continue
        data = records.with_suffix(".extxyz").read_bytes()
        start = 0
        for index, end in done:
            frames.setdefault(index, data[start:end].decode())
            start = end
    return frames


def result_frame(task) -> str:
    """The extxyz text of a finished task's structure: its results (``md.batch.attach_results``) and info "index",
    "converged" and "steps", every number at full precision."""
    import io

    from .outputs import write_extxyz

    atoms = task.atoms
    atoms.info.update(index=task.index, converged=task.converged, steps=task.steps)
    text = io.StringIO()
    write_extxyz(text, atoms)
    return text.getvalue()


def input_atoms(structure):
    """ASE Atoms of a read ``Structure``: geometry, and its charge, spin and config_type in ``info``."""
    atoms = structure.to_atoms()
    for name in ("charge", "spin", "config_type"):
        if getattr(structure, name) is not None:
            atoms.info[name] = getattr(structure, name)
    return atoms


class BatchJob:
    """One ``mlip-batch`` run on every rank: ``BatchJob(config).run()``. Building checks the config, the structures
    (readable, elements the model knows, finite positions) and the output directory on every rank alike, before
    anything is written; ``run`` takes structures from the shared queue until it is empty, then rank 0 writes
    results.extxyz."""

    def __init__(self, config):
        import torch

        from mlip_parallel import get_backend
        from mlip_parallel.backend import rank_device, set_threads
        from mlip_parallel.train.sources import open_source
        from potentials.graph import check_positions, complete_cell

        from .start import build_model

        self.config = config
        if config["structures"] is None:
            raise ConfigError("structures: no structure file given (an extxyz file, an ASE db or an ASE-LMDB, or a "
                              "list of them)")
        self.backend = get_backend()
        set_threads(self.backend)
        self.model = build_model(config["model"])
        self.model.to(torch.device("cpu") if config["device"] == "cpu" else rank_device(self.backend))
        self.source = open_source(config["structures"])
        self.out = Path(config["output"]["directory"])
        self.parts = self.out / PARTS
        recorded = self.out / RECORD
        kept = {k: v for k, v in config.items() if k not in RESUMABLE}
        if config["resume"] and recorded.exists():
            if json.loads(recorded.read_text()) != json.loads(json.dumps(kept)):
                raise ConfigError(f"resume: {self.out} holds a run of another config ({recorded}); resume it with "
                                  f"that config, or start this one in another directory")
            self.fresh = False
        else:
            check_output_directory(self.out, config["output"]["overwrite"])
            self.fresh = True
        sizes = []
        for k in range(len(self.source)):
            structure = self.source[k]  # (a DataError names the file and the structure)
            try:
                check_positions(structure.positions)
                complete_cell(structure.cell, structure.pbc)
                self.model.species_index(structure.numbers)
            except MLIPError as exc:
                raise ConfigError(f"structures: {structure.source}: {exc}") from None
            sizes.append(len(structure.numbers))
        self.sizes = sizes
        self.kept = kept

    def prepare_outputs(self) -> set:
        """The output directory made (rank 0, then every rank), and the indices already finished."""
        if self.backend.rank == 0:
            with naming_errors(self.out):
                if self.fresh:
                    for old in (self.out / RESULTS, *self.parts.glob("rank*")):
                        if old.exists():
                            old.unlink()
                self.parts.mkdir(parents=True, exist_ok=True)
                with atomic_write(self.out / RECORD, "w") as f:
                    json.dump(self.kept, f, indent=1)
        self.backend.barrier()
        return set(finished_frames(self.parts))

    def tasks(self, order, counter, finished_counter):
        """The tasks this rank takes from the shared queue ``order`` (input indices), one at a time."""
        from .batch import Relaxation, SinglePoint

        relax = self.config["relax"]
        while True:
            k = counter.add(1)
            if k >= len(order):
                return
            index = int(order[k])
            atoms = input_atoms(self.source[index])
            if self.config["task"] == "relax":
                yield Relaxation(index, atoms, relax["fmax"], relax["max_steps"], relax["cell"])
            else:
                yield SinglePoint(index, atoms)

    def run(self) -> int:
        """Run every structure not yet finished; return how many this rank ran."""
        import numpy as np

        from mlip_parallel.progress import Progress

        from .batch import run_tasks

        done = self.prepare_outputs()
        remaining = [k for k in range(len(self.sizes)) if k not in done]
        order = sorted(remaining, key=lambda k: -self.sizes[k])  # the largest first: the ranks end together
        counter, finished = self.backend.counter(), self.backend.counter()
        parts = PartFiles(self.parts, self.backend.rank)
        root = self.backend.rank == 0
        if root:
            print(f"mlip-batch: {len(self.sizes)} structures ({len(done)} done before), task {self.config['task']}, "
                  f"{self.backend.size} rank(s)", flush=True)
        progress = Progress("mlip-batch", len(self.sizes), len(done), unit="structure") \
            if root and self.config["output"]["progress"] else None
        ran = []
        start = time.perf_counter()

        def finish(task):
            parts.append(task.index, result_frame(task))
            ran.append(task.index)
            total = len(done) + finished.add(1) + 1
            if progress is not None:
                progress.update(total)

        try:
            run_tasks(self.model, self.tasks(order, counter, finished), finish, self.config["max_atoms"],
                      self.config["memory_budget_gb"], self.config["min_distance"])
        finally:
            parts.close()
            if progress is not None:
                progress.close()
        self.seconds = time.perf_counter() - start
        self.backend.barrier()
        counter.free(), finished.free()
        if root:
            self.write_results()
        self.backend.barrier()
        self.ran = np.array(ran, dtype=np.int64)
        return len(ran)

    def write_results(self) -> None:
        """results.extxyz: every structure's frame in input order (rank 0)."""
        frames = finished_frames(self.parts)
        missing = [k for k in range(len(self.sizes)) if k not in frames]
        if missing:
            raise OutputError(f"{self.parts}: no result for {len(missing)} structure(s), first {missing[:5]}")
        with atomic_write(self.out / RESULTS, "w") as f:
            f.writelines(frames[k] for k in range(len(self.sizes)))


def main(argv=None) -> int:
    try:
        keys = TABLE.schema()
    except FamilyError as exc:
        report_error("mlip-batch", exc)
        return 2
    args = config_parser("mlip-batch", __doc__.splitlines()[0], keys).parse_args(argv)
    try:
        config = read_job(args, keys, TABLE.all_rules())
        job = BatchJob(config)
    except (ConfigError, MLIPError) as exc:  # alike on every rank, before anything is written
        report_error("mlip-batch", exc)
        return 2
    try:
        job.run()
    except (OutputError, MLIPError) as exc:  # a structure that cannot be evaluated, an output that cannot be written
        end_job("mlip-batch", exc)
        return 1
    if job.backend.rank == 0:
        print(f"mlip-batch: {len(job.sizes)} structures in {job.out / RESULTS} ({job.seconds:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
