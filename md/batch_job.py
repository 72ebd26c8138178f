"""One ``mlip-batch`` run, on every rank (``BatchJob(config).run()``; the keys and the command: ``batch_cli``).

Every rank reads the same config and the same structure files (extxyz, ASE db, ASE-LMDB: read one structure at a
time, as mlip-train reads them) and checks them before anything is written. Structures too large for one rank (or
above ``decompose_above`` atoms) are run first, one after another, by all ranks together, spatially decomposed
(``md.batch.run_decomposed``). The rest, largest first, form one queue shared by the ranks (``SharedQueue``: an atomic
counter; a rank that finishes early takes more, none is done twice); each rank evaluates the structures it took in
batches (``md.batch.run_tasks``). Each finished structure is appended to the rank's OUTPUT/parts/rankR.extxyz (MD
frames: rankR.trajectory.extxyz) and recorded in OUTPUT/parts/rankR.done (its input index and the files' lengths
after it, synced: ``PartFiles``), so a killed job run again with ``resume: true`` skips what was done and cuts a
half-written frame off. At the end rank 0 writes OUTPUT/results.extxyz (one frame per input structure, in input order)
and for MD OUTPUT/trajectory.extxyz (every structure's frames, grouped by structure in input order).
"""
from __future__ import annotations

import io
import json
import math
import os
import time
from pathlib import Path

import torch

from mlip_parallel import get_backend
from mlip_parallel.backend import rank_device, set_threads
from mlip_parallel.config import ConfigError, check_output_directory
from mlip_parallel.domain import Domain
from mlip_parallel.errors import MLIPError
from mlip_parallel.preflight import memory_everywhere, rank_load
from mlip_parallel.progress import Progress
from mlip_parallel.train.sources import open_source
from potentials.errors import OutputError
from potentials.files import atomic_write, naming_errors
from potentials.messages import memory_budget_bytes

from .batch import MDRun, Relaxation, SinglePoint, run_decomposed, run_tasks
from .outputs import write_extxyz
from .start import build_integrator, build_model, thermalize

RESULTS, TRAJECTORY, PARTS, RECORD = "results.extxyz", "trajectory.extxyz", "parts", "batch.json"
RESUMABLE = ("resume", "output")  # keys a resumed run may change
OUTPUTS = ("extxyz", "trajectory.extxyz")  # a rank's part files: results' frames, MD trajectories' frames


def read_records(path: Path) -> list:
    """[(index, end offset in each of OUTPUTS)] of a rank's record file, its complete lines only (a line cut by a kill
    is not one)."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # (the part after the last newline is unfinished)
    return [(int(fields[0]), tuple(int(f) for f in fields[1:])) for fields in (line.split() for line in lines)]


def record_line(index: int, ends) -> str:
    return f"{index} {' '.join(map(str, ends))}\n"


class PartFiles:
    """This rank's appended outputs in ``directory``: ``append(index, texts)`` adds one finished structure's text to
    each of rankR.extxyz (its result frame) and rankR.trajectory.extxyz (its MD frames, or nothing), then its record
    (index, each file's length after it) to rankR.done, each synced: text without its record (a kill before the
    record was synced) is cut off when the rank opens its files again."""

    def __init__(self, directory: Path, rank: int):
        self.paths = [directory / f"rank{rank}.{suffix}" for suffix in OUTPUTS]
        self.records = directory / f"rank{rank}.done"
        done = read_records(self.records)
        with naming_errors(directory):
            for k, path in enumerate(self.paths):
                with open(path, "ab") as f:
                    end = done[-1][1][k] if done else 0
                    if f.tell() < end:
                        raise OutputError(f"{path} is shorter ({f.tell()} bytes) than its record {self.records} says "
                                          f"({end}): the run's parts were changed; start it in another directory")
                    f.truncate(end)
            with open(self.records, "a") as f:
                f.truncate(sum(len(record_line(index, ends)) for index, ends in done))
            self.files = [open(path, "ab") for path in self.paths]
            self.record_file = open(self.records, "a")

    def append(self, index: int, texts) -> None:
        for handle, text, path in zip(self.files, texts, self.paths):
            with naming_errors(path):
                handle.write(text.encode())
                handle.flush()
                os.fsync(handle.fileno())
        with naming_errors(self.records):
            self.record_file.write(record_line(index, [handle.tell() for handle in self.files]))
            self.record_file.flush()
            os.fsync(self.record_file.fileno())

    def close(self) -> None:
        for handle in (*self.files, self.record_file):
            handle.close()


def finished_parts(directory: Path) -> dict:
    """{index: (its text in each of OUTPUTS)} of every structure a rank recorded in ``directory`` (any number of
    ranks, any runs; the first record of an index wins)."""
    parts = {}
    for records in sorted(directory.glob("rank*.done")):
        done = read_records(records)
        if not done:
            continue
        stem = records.name[:-len(".done")]
        data = [(directory / f"{stem}.{suffix}").read_bytes() for suffix in OUTPUTS]
        starts = [0] * len(OUTPUTS)
        for index, ends in done:
            parts.setdefault(index, tuple(d[a:b].decode() for d, a, b in zip(data, starts, ends)))
            starts = ends
    return parts


def extxyz_text(atoms) -> str:
    """``atoms`` as extxyz text, its results included, every number at full precision (``outputs.write_extxyz``)."""
    text = io.StringIO()
    write_extxyz(text, atoms)
    return text.getvalue()


def result_frame(task) -> str:
    """The extxyz text of a finished task's structure: its results (``md.batch.attach_results``) and info "index",
    "converged" and "steps"."""
    task.atoms.info.update(index=task.index, converged=task.converged, steps=task.steps)
    return extxyz_text(task.atoms)


def md_settings(section: dict, atoms, index: int) -> dict:
    """Structure ``index``'s MD settings in mlip-md's keys (what ``start.build_integrator`` reads), from the batch's md
    ``section`` and the structure's own info "temperature_K", "pressure_GPa" and "seed"."""
    temperature = float(atoms.info.get("temperature_K", section["temperature_K"]))
    return {"ensemble": section["ensemble"], "timestep_fs": section["timestep_fs"], "temperature_K": temperature,
            "seed": int(atoms.info.get("seed", section["seed"] + index)),
            "thermostat": {"temperature_K": temperature, "friction_per_fs": section["friction_per_fs"],
                           "tau_fs": section["tau_fs"], "tdamp_fs": section["tdamp_fs"]},
            "barostat": {"pressure_GPa": float(atoms.info.get("pressure_GPa", section["pressure_GPa"])),
                         "pdamp_fs": section["pdamp_fs"], "isotropic": section["isotropic"]}}


class SharedQueue:
    """The structures ``order`` (input indices, the largest first) shared by the ``ranks`` ranks through ``counter``
    (an atomic fetch-and-add, ``backend.counter()``), as ``md.batch.run_tasks`` reads a queue: ``next_size()`` the
    atoms of the next not yet taken by any rank, ``take()`` takes the next (``make(index)``: its task) — no larger
    than the one seen, the order being by size. None where none is left. ``plenty(n)``: whether at least ``n``
    structures are left for each rank."""

    def __init__(self, order, sizes, counter, make, ranks: int):
        self.order, self.sizes, self.counter, self.make, self.ranks = order, sizes, counter, make, ranks

    def next_size(self) -> int | None:
        k = self.counter.add(0)
        return self.sizes[self.order[k]] if k < len(self.order) else None

    def take(self):
        k = self.counter.add(1)
        return self.make(int(self.order[k])) if k < len(self.order) else None

    def plenty(self, n: int) -> bool:
        return len(self.order) - self.counter.add(0) >= n * self.ranks


class BatchJob:
    """One ``mlip-batch`` run on every rank: ``BatchJob(config).run()``. Building checks the config, the structures
    (readable, elements the model knows, finite positions) and the output directory on every rank alike, before
    anything is written; ``run`` takes structures from the shared queue until it is empty, then rank 0 writes
    results.extxyz."""

    def __init__(self, config):
        self.config = config
        if config["structures"] is None:
            raise ConfigError("structures: no structure file given (an extxyz file, an ASE db or an ASE-LMDB, or a "
                              "list of them)")
        self.backend = get_backend()
        set_threads(self.backend)
        self.model = build_model(config["model"])
        self.model.to(torch.device("cpu") if config["device"] == "cpu" else rank_device(self.backend))
        self.source = open_source(config["structures"], as_atoms=True)
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
        too_large = self.too_large_for_one_rank(config["decompose_above"])  # (collective)
        self.sizes, large = [], set()
        for k in range(len(self.source)):
            atoms = self.source[k]  # (checked as mlip-train checks its data: a DataError names the file and frame)
            self.check(k, atoms)
            self.sizes.append(len(atoms))
            if too_large(atoms):
                large.add(k)
        self.large = self.backend.bcast(large)  # (rank 0's decision: the free memory each rank reads may differ)
        self.kept = kept
        self.trajectories = {}  # input index -> the MD frames of a structure in flight (extxyz text)

    def check(self, k: int, atoms) -> None:
        """ConfigError naming structure ``k`` where the task cannot run it: an element the model does not know, MD
        settings it cannot run with, a moving cell (npt, relax.cell) on a structure not periodic in every direction."""
        config = self.config
        try:
            self.model.species_index(atoms.numbers)
            if config["task"] == "md":
                build_integrator(md_settings(config["md"], atoms, k))
            moving_cell = (config["task"] == "md" and config["md"]["ensemble"] == "npt") or \
                (config["task"] == "relax" and config["relax"]["cell"])
            if moving_cell and not (atoms.pbc.all() and atoms.cell.rank == 3):
                raise ConfigError(f"{'md.ensemble npt' if config['task'] == 'md' else 'relax.cell'} moves the cell, "
                                  f"which needs a structure periodic in every direction (pbc {atoms.pbc.tolist()})")
        except (MLIPError, ValueError) as exc:
            raise ConfigError(f"structures: {self.source.where(k)}: {exc}") from None

    def too_large_for_one_rank(self, above: int | None):
        """``too_large(atoms)``: whether a structure runs decomposed over all ranks: more than ``above`` atoms, or
        (None) the memory pre-flight's estimate of one rank holding it, at the chunk budget it would run with, beyond
        what a rank has (collective: the smallest memory over the ranks)."""
        if above is not None:
            return lambda atoms: len(atoms) > above
        have = memory_everywhere(self.backend, self.model.device)
        budget = memory_budget_bytes(self.config["memory_budget_gb"], self.model.device)
        budget = None if budget is None or math.isinf(budget) else budget

        def too_large(atoms) -> bool:
            domain = Domain.from_positions(atoms.positions, atoms.cell, atoms.pbc)
            return rank_load(self.model, len(atoms), domain, (1, 1, 1), 0.0, 0.0, True, budget).bytes > have

        return too_large

    def prepare_outputs(self) -> set:
        """The output directory made (rank 0, then every rank), and the indices already finished. A fresh run first
        removes an earlier run's files (its records first, its config last), then writes its config, then makes
        parts/: a kill at any point leaves a directory the same command starts or resumes from."""
        if self.backend.rank == 0:
            with naming_errors(self.out):
                if self.fresh:
                    old = [*self.parts.glob("rank*.done"), *self.parts.glob("rank*"), self.out / RESULTS,
                           self.out / TRAJECTORY, self.out / RECORD]
                    for path in old:
                        path.unlink(missing_ok=True)
                    if self.parts.is_dir():
                        self.parts.rmdir()
                    self.out.mkdir(parents=True, exist_ok=True)
                    with atomic_write(self.out / RECORD, "w") as f:
                        json.dump(self.kept, f, indent=1)
                self.parts.mkdir(exist_ok=True)
        self.backend.barrier()
        return {index for records in self.parts.glob("rank*.done") for index, _ in read_records(records)}

    def task(self, index: int):
        """The task of structure ``index``, read now."""
        relax, md, atoms = self.config["relax"], self.config["md"], self.source[index]
        if self.config["task"] == "relax":
            return Relaxation(index, atoms, relax["fmax"], relax["max_steps"], relax["cell"])
        if self.config["task"] == "md":
            settings = md_settings(md, atoms, index)
            if settings["temperature_K"] > 0:
                thermalize(atoms, settings["temperature_K"], settings["seed"])
            self.trajectories[index] = []
            return MDRun(index, atoms, build_integrator(settings), md["steps"], md["trajectory_every"],
                         self.keep_frame, self.model.device)
        return SinglePoint(index, atoms)

    def decomposed(self, index: int):
        """Structure ``index`` run by every rank together, spatially decomposed (``md.batch.run_decomposed``)."""
        atoms, config, md = self.source[index], self.config, None
        if config["task"] == "md":
            settings = md_settings(config["md"], atoms, index)
            if settings["temperature_K"] > 0:
                thermalize(atoms, settings["temperature_K"], settings["seed"])
            self.trajectories[index] = []
            md = {"integrator": build_integrator(settings), "steps": config["md"]["steps"],
                  "frame_every": config["md"]["trajectory_every"], "frame": self.keep_frame}
        return run_decomposed(self.model, index, atoms, config["task"], self.backend, config["relax"], md,
                              config["memory_budget_gb"], config["min_distance"])

    def keep_frame(self, task, step: int) -> None:
        """An MD frame of ``task``'s structure, kept until the structure finishes (then written with its result)."""
        task.atoms.info.update(index=task.index)
        self.trajectories[task.index].append(extxyz_text(task.atoms))

    def run(self) -> int:
        """Run every structure not yet finished: those too large for one rank first, every rank together, then the
        queue; return how many this rank wrote."""
        done = self.prepare_outputs()
        remaining = [k for k in range(len(self.sizes)) if k not in done]
        large = sorted(k for k in remaining if k in self.large)
        order = sorted((k for k in remaining if k not in self.large), key=lambda k: -self.sizes[k])  # the largest
        # first: the ranks end together
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
            parts.append(task.index, (result_frame(task), "".join(self.trajectories.pop(task.index, []))))
            ran.append(task.index)
            total = len(done) + finished.add(1) + 1
            if progress is not None:
                progress.update(total)

        try:
            for index in large:  # all ranks together, one structure after another
                task = self.decomposed(index)
                if root:
                    finish(task)
                self.trajectories.pop(index, None)
            queue = SharedQueue(order, self.sizes, counter, self.task, self.backend.size)
            run_tasks(self.model, queue, finish, self.config["max_atoms"], self.config["memory_budget_gb"],
                      self.config["min_distance"])
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
        return len(ran)

    def write_results(self) -> None:
        """results.extxyz: every structure's frame in input order; for MD, trajectory.extxyz: every structure's frames
        in input order (rank 0)."""
        parts = finished_parts(self.parts)
        missing = [k for k in range(len(self.sizes)) if k not in parts]
        if missing:
            raise OutputError(f"{self.parts}: no result for {len(missing)} structure(s), first {missing[:5]}")
        for k, name in enumerate((RESULTS, TRAJECTORY)):
            if k == 0 or self.config["task"] == "md":
                with atomic_write(self.out / name, "w") as f:
                    f.writelines(parts[index][k] for index in range(len(self.sizes)))
