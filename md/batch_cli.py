"""mlip-batch CONFIG.yaml: single points, relaxations or MD of many structures, batched, over ranks (mpiexec -n P).

Every rank reads the same config and the same structure files (extxyz, ASE db, ASE-LMDB: read one structure at a
time, as mlip-train reads them). Structures too large for one rank (or above ``decompose_above`` atoms) are run
first, one after another, by all ranks together, spatially decomposed (``md.batch.run_decomposed``). The rest,
largest first, form one queue shared by the ranks (an atomic counter: a rank that finishes early takes more; none
is done twice); each rank evaluates the structures it took in batches (``md.batch.run_tasks``). Each finished structure is appended to the rank's OUTPUT/parts/rankR.extxyz and
recorded in OUTPUT/parts/rankR.done (its input index and the file's length after it, synced), so a killed job run
again with ``resume: true`` skips what was done and cuts a half-written frame off. At the end rank 0 writes
OUTPUT/results.extxyz: one frame per input structure in input order, with ``info["index"]`` (its position in the
input), "energy", "converged", "steps", forces and stress as ASE's single-point calculator keeps them (a committee's
deviation beside them); for MD, its last frame, and OUTPUT/trajectory.extxyz holds every structure's frames (every
md.trajectory_every steps), grouped by structure in input order. Here: the configuration's keys, the job and the
command.
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
    "task": (str, "single_point", "single_point (energy, forces, stress of each structure), relax (ASE's FIRE, "
                                  "each structure to its own fmax or step limit) or md (mlip-md's integrators, each "
                                  "structure with its own temperature, pressure and seed)"),
    "relax": {
        "fmax": (float, 0.05, "relax: converged when the largest force (with cell: the largest component of "
                              "FrechetCellFilter's gradient, stress × volume included) is below this, eV/Å"),
        "max_steps": (int, 1000, "relax: at most this many FIRE steps per structure (then converged: false)"),
        "cell": (bool, False, "relax: also relax the cell (ASE's FrechetCellFilter, at zero pressure)"),
    },
    "md": {
        "ensemble": (str, "nve", "md: nve, langevin, bussi, nose-hoover or npt, as mlip-md's"),
        "temperature_K": (float, 300.0, "md: the start temperature (Maxwell-Boltzmann velocities drawn from the "
                                        "structure's seed; 0 keeps the file's velocities) and the thermostat's; a "
                                        "structure's own info['temperature_K'] wins"),
        "timestep_fs": (float, 1.0, "md: time step, fs"),
        "steps": (int, 1000, "md: steps per structure"),
        "seed": (int, 0, "md: structure k's seed is this + k (velocities and thermostat noise), unless its "
                         "info['seed'] gives one"),
        "friction_per_fs": (float, 0.01, "md: langevin friction, 1/fs"),
        "tau_fs": (float, 100.0, "md: bussi relaxation time, fs"),
        "tdamp_fs": (float, 100.0, "md: nose-hoover/npt thermostat damping time, fs"),
        "pressure_GPa": (float, 0.0, "md: npt target pressure, GPa; a structure's own info['pressure_GPa'] wins"),
        "pdamp_fs": (float, 1000.0, "md: npt barostat damping time, fs"),
        "isotropic": (bool, True, "md: npt: true scales the cell uniformly, false lets every component move"),
        "trajectory_every": (int, 100, "md: a frame of each structure every N steps (and its last) into "
                                       "OUTPUT/trajectory.extxyz, tagged by info['index'] and info['step'] (0: none)"),
    },
    "decompose_above": (int, None, "structures of more atoms than this run spatially decomposed over all ranks "
                                   "together, one after another, before the rest are batched (default: those the "
                                   "memory pre-flight finds too large for one rank)"),
    "max_atoms": (int, None, "the most atoms evaluated together as one graph on a rank (default: the size found "
                             "fastest while running, from one structure per graph up, within the memory model)"),
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
RULES = {"task": ("single_point", "relax", "md"), "device": ("auto", "cpu", "cuda"), "relax.fmax": "> 0",
         "md.ensemble": ("nve", "langevin", "bussi", "nose-hoover", "npt"), "md.timestep_fs": "> 0",
         "md.tau_fs": "> 0", "md.tdamp_fs": "> 0", "md.pdamp_fs": "> 0", "md.pressure_GPa": "finite",
         "max_atoms": "> 0", "memory_budget_gb": "> 0", "decompose_above": "> 0"}
TABLE = ConfigTable(SECTIONS, RULES, model_keys)
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
    import io

    from .outputs import write_extxyz

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
    """The structures ``order`` (input indices, the largest first) shared by the ranks through ``counter`` (an atomic
    fetch-and-add, ``backend.counter()``), as ``md.batch.run_tasks`` reads a queue: ``next_size()`` the atoms of the
    next not yet taken by any rank, ``take()`` takes the next (``make(index)``: its task) — no larger than the one
    seen, the order being by size. None where none is left."""

    def __init__(self, order, sizes, counter, make):
        self.order, self.sizes, self.counter, self.make = order, sizes, counter, make

    def next_size(self) -> int | None:
        k = self.counter.add(0)
        return self.sizes[self.order[k]] if k < len(self.order) else None

    def take(self):
        k = self.counter.add(1)
        return self.make(int(self.order[k])) if k < len(self.order) else None


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

        from .start import build_integrator, build_model

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
        sizes = []
        for k in range(len(self.source)):
            atoms = self.source[k]  # (checked as mlip-train checks its data: a DataError names the file and frame)
            try:
                self.model.species_index(atoms.numbers)
                if config["task"] == "md":
                    build_integrator(md_settings(config["md"], atoms, k))
                moving_cell = (config["task"] == "md" and config["md"]["ensemble"] == "npt") or \
                    (config["task"] == "relax" and config["relax"]["cell"])
                if moving_cell and not (atoms.pbc.all() and atoms.cell.rank == 3):
                    raise ConfigError(f"{'md.ensemble npt' if config['task'] == 'md' else 'relax.cell'} moves the "
                                      f"cell, which needs a structure periodic in every direction (pbc "
                                      f"{atoms.pbc.tolist()})")
            except (MLIPError, ValueError) as exc:
                raise ConfigError(f"structures: {self.source.where(k)}: {exc}") from None
            sizes.append(len(atoms))
        self.sizes = sizes
        self.large = self.too_large(config["decompose_above"])
        self.kept = kept
        self.trajectories = {}  # input index -> the MD frames of a structure in flight (extxyz text)

    def too_large(self, above: int | None) -> set:
        """The structures run decomposed over all ranks: more than ``above`` atoms, or (None) those the memory
        pre-flight predicts one rank cannot evaluate, at the chunk budget it would run with. Decided on rank 0 and
        broadcast (collective)."""
        import math

        from mlip_parallel.domain import Domain
        from mlip_parallel.preflight import memory_everywhere, rank_load
        from potentials.messages import memory_budget_bytes

        have = memory_everywhere(self.backend, self.model.device)
        large = None
        if self.backend.rank == 0:
            if above is not None:
                large = {k for k, n in enumerate(self.sizes) if n > above}
            else:
                budget = memory_budget_bytes(self.config["memory_budget_gb"], self.model.device)
                budget = None if budget is None or math.isinf(budget) else budget
                large = set()
                for k in range(len(self.sizes)):
                    atoms = self.source[k]
                    domain = Domain.from_positions(atoms.positions, atoms.cell, atoms.pbc)
                    if rank_load(self.model, len(atoms), domain, (1, 1, 1), 0.0, 0.0, True, budget).bytes > have:
                        large.add(k)
        return self.backend.bcast(large)

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
        from .batch import MDRun, Relaxation, SinglePoint
        from .start import build_integrator, thermalize

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
        from .batch import run_decomposed
        from .start import build_integrator, thermalize

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
        from mlip_parallel.progress import Progress

        from .batch import run_tasks

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
            queue = SharedQueue(order, self.sizes, counter, self.task)
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
        print(f"mlip-batch: {len(job.sizes)} structures in {job.out / RESULTS} ({job.seconds:.2f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
