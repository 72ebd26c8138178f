"""Tasks on many structures at once: single points, FIRE relaxations (of the positions, or with the cell through
ASE's ``FrechetCellFilter``) and MD with mlip-md's integrators, the structures in flight evaluated together as one
graph (``potentials.predict_many``).

Each structure runs ASE's own optimizer, stepped exactly as ``Optimizer.run(fmax, steps)`` steps it (``Relaxation``),
with the forces and stress of its batch; nothing one structure does changes another's path, so each ends as ASE's
FIRE with ``MLIPCalculator`` ends it (the same steps; positions equal up to floating-point summation order). MD runs
the integrator objects of ``mlip-md`` (``md.integrators``) on each structure's own state (``StructureState``: the
state they read of an ``MDSystem``, in one process), so each trajectory is the one ``mlip-md`` runs on the structure
alone with the same seed (``MDRun``). When a structure finishes it leaves the batch and the next one enters
(``run_tasks``). ``single_points``, ``relax_many`` and ``md_many`` are the Python API; ``mlip-batch``
(``batch_cli``, ``batch_job``) runs them from a config over ranks.

Loop order of ``run_tasks``, once per round:
    fill the batch from the queue while the sizer has room (BatchSizer.has_room: its graph size, at least 256 atoms)
    evaluate every structure in the batch (graphs of the sizer's size, split further only where memory requires)
    for each structure: give it its results; it is converged or out of steps -> done (reported, leaves);
                        else it takes one optimizer step
"""
from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import torch
from ase import units
from ase.calculators.singlepoint import SinglePointCalculator
from ase.filters import FrechetCellFilter
from ase.optimize import FIRE

import mlip_parallel
from potentials.batch import BatchSizer, predict_many
from potentials.graph import MIN_DISTANCE, system_of
from potentials.predict import voigt_stress

from .calculator import ExactStateCheck, MLIPCalculator
from .engine import MDSystem, checked_new_cell, run

TASKS = ("single_point", "relax", "md")
DEVIATION_INFO = ("max_devi_f", "min_devi_f", "avg_devi_f", "devi_e")  # a committee's model deviation, per structure
# what a structure read from a file may carry of an earlier calculation: removed before its new results are attached
STALE_INFO = ("energy", "free_energy", "stress", "virial", "step", "time_fs", "converged", "steps", *DEVIATION_INFO)
STALE_ARRAYS = ("forces", "energies", "devi_f")


class BatchResults(ExactStateCheck, SinglePointCalculator):
    """ASE's single-point calculator, its check of the atoms first exact (``ExactStateCheck``)."""


def attach_results(atoms, result: dict) -> None:
    """``result`` (``predict_many``'s, of ``atoms`` as they are now) as ``atoms``' calculator: ASE's single-point
    calculator (energy, free energy, forces, stress), which refuses to answer for other positions or another cell.
    A committee's deviation goes to ``atoms.info`` (its summary) and ``atoms.arrays["devi_f"]`` (σ_F per atom).
    Results an earlier calculation left in ``info`` and ``arrays`` (labels of a data file) are removed first."""
    for key in STALE_INFO:
        atoms.info.pop(key, None)
    for key in STALE_ARRAYS:
        atoms.arrays.pop(key, None)
    keep = {key: result[key] for key in ("energy", "forces", "stress") if key in result}
    atoms.calc = BatchResults(atoms, free_energy=result["energy"], **keep)
    if "devi_f" in result:
        atoms.info.update({key: result[key] for key in DEVIATION_INFO})
        atoms.arrays["devi_f"] = np.asarray(result["devi_f"])


class SinglePoint:
    """One evaluation of structure ``index``."""

    def __init__(self, index: int, atoms):
        self.index, self.atoms, self.steps, self.converged = index, atoms, 0, True

    def advance(self, result: dict) -> bool:
        attach_results(self.atoms, result)
        return True


class Relaxation:
    """ASE's FIRE on structure ``index`` (``cell``: on ``FrechetCellFilter(atoms)``'s degrees of freedom, the cell's
    included), stepped as ``FIRE(...).run(fmax, max_steps)`` steps it: after each evaluation it is done when converged
    (largest force, or filter gradient, below ``fmax`` eV/Å) or after ``max_steps`` steps, else it takes one step.
    ``optimizer``: FIRE's own keywords (``maxstep``, ``dt``, ...)."""

    def __init__(self, index: int, atoms, fmax: float = 0.05, max_steps: int = 1000, cell: bool = False,
                 **optimizer):
        self.index, self.atoms, self.max_steps = index, atoms, max_steps
        self.optimizer = FIRE(FrechetCellFilter(atoms) if cell else atoms, logfile=None, **optimizer)
        self.optimizer.fmax = fmax
        self.converged = False

    @property
    def steps(self) -> int:
        return self.optimizer.nsteps

    def advance(self, result: dict) -> bool:
        attach_results(self.atoms, result)
        with warnings.catch_warnings():  # FrechetCellFilter's scipy.linalg.logm: "may be inaccurate" at ~4e-13
            warnings.filterwarnings("ignore", "logm result may be inaccurate", RuntimeWarning)
            self.converged = bool(self.optimizer.converged())
            if self.converged or self.optimizer.nsteps >= self.max_steps:
                return True
            self.optimizer.step()
        self.optimizer.nsteps += 1
        return False


class StructureState:
    """One structure's MD state as ``md.integrators`` read it (what they read of an ``engine.MDSystem``, for a
    whole structure in one process): ``atoms`` {positions [n, 3] Å, velocities [n, 3] Å/ASE time, masses [n] amu,
    ids [n]} float64 torch tensors on ``device``, ``forces`` [n, 3] eV/Å there, ``energy`` (eV), ``virial`` [3, 3]
    dE/dε (numpy), ``cell`` [3, 3] and ``pbc`` (numpy), ``n_atoms``. Ids are 0..n-1, as mlip-md numbers the atoms of
    its structure, so the integrators draw the same noise."""

    def __init__(self, atoms, device):
        as_tensor = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64), device=device)  # noqa: E731
        self.device, self.n_atoms = device, len(atoms)
        self.atoms = {"positions": as_tensor(atoms.positions), "velocities": as_tensor(atoms.get_velocities()),
                      "masses": as_tensor(atoms.get_masses()), "ids": torch.arange(len(atoms), device=device)}
        self.cell, self.pbc = np.array(atoms.cell[:], dtype=np.float64), np.array(atoms.pbc, dtype=bool)

    def take(self, result: dict) -> None:
        """The forces, energy and dE/dε of a ``predict_many`` result (``strain_derivative``) at the current state."""
        self.forces = torch.as_tensor(result["forces"], dtype=torch.float64, device=self.device)
        self.energy, self.virial = result["energy"], np.asarray(result["dE_dstrain"], dtype=np.float64)

    def kinetic_tensor(self) -> np.ndarray:
        """[3, 3] Σ m v⊗v (eV)."""
        v, m = self.atoms["velocities"], self.atoms["masses"]
        return ((m[:, None] * v).T @ v).cpu().numpy()

    def kinetic_energy(self) -> float:
        return 0.5 * float(np.trace(self.kinetic_tensor()))

    def set_cell(self, cell) -> None:
        """A new periodic cell (barostats), checked as ``MDSystem.set_cell`` checks it."""
        self.cell = checked_new_cell(cell, self.pbc)


class MDRun:
    """``steps`` steps of MD of structure ``index`` with ``integrator`` (an ``md.integrators`` object of its own:
    its temperature, pressure and seed), in the order of ``engine.run``: after each evaluation, the second half of
    the step (from step 1), the frame (``frame(task, step)`` every ``frame_every`` steps, step 0 and the last
    included; 0: none), then, unless it was the last, the first half of the next step. ``atoms`` (ASE, with the
    start velocities) follow the state: positions, cell, velocities, and the results of the last evaluation."""

    def __init__(self, index: int, atoms, integrator, steps: int, frame_every: int = 0, frame=None, device="cpu"):
        self.index, self.atoms, self.integrator, self.max_steps = index, atoms, integrator, steps
        self.frame_every, self.frame = frame_every, frame
        self.state, self.step, self.converged = StructureState(atoms, device), 0, False

    @property
    def steps(self) -> int:
        return self.step

    def advance(self, result: dict) -> bool:
        state, integrator = self.state, self.integrator
        state.take(result)
        if self.step > 0:
            integrator.second_half(state, self.step)
        self.atoms.set_velocities(state.atoms["velocities"].cpu().numpy())
        attach_results(self.atoms, result)
        self.atoms.info.update(step=self.step, time_fs=self.step * integrator.dt / units.fs)
        last = self.step == self.max_steps
        if self.frame is not None and self.frame_every and (self.step % self.frame_every == 0 or last):
            self.frame(self, self.step)
        if last:
            self.converged = True  # (ran its steps)
            return True
        self.step += 1
        integrator.first_half(state, self.step)
        self.atoms.set_cell(state.cell)
        self.atoms.positions = state.atoms["positions"].cpu().numpy()
        return False


class TaskQueue:
    """Tasks in the order they are to be taken: ``next_size()`` the atoms of the next (None: none left), ``take()``
    the next (None: none left), ``plenty(n)`` whether at least ``n`` are left for each taker (here one).
    ``run_tasks`` reads any object with these three methods (mlip-batch's queue is shared by the ranks, its tasks made
    as they are taken)."""

    def __init__(self, tasks):
        self.tasks, self.k = list(tasks), 0

    def next_size(self) -> int | None:
        return len(self.tasks[self.k].atoms) if self.k < len(self.tasks) else None

    def take(self):
        if self.k >= len(self.tasks):
            return None
        self.k += 1
        return self.tasks[self.k - 1]

    def plenty(self, n: int) -> bool:
        return len(self.tasks) - self.k >= n


def run_tasks(model, queue, done: Callable, max_atoms: float | None = None,
              memory_budget_gb: float | None = None, min_distance: float = MIN_DISTANCE) -> BatchSizer:
    """Run the tasks of ``queue`` (``TaskQueue``'s methods; ``SinglePoint``, ``Relaxation`` or ``MDRun``) to the end
    with ``model``, calling ``done(task)`` for each as it finishes (its ``atoms`` carry the final results). A task is
    taken while the sizer has room (``BatchSizer.has_room``: at least 256 atoms in flight while the queue has plenty
    for every rank; near its end, what one graph holds: the ranks end together), and the tasks in flight
    are evaluated as graphs of at most ``max_atoms`` atoms (None: the size found fastest while running,
    ``BatchSizer``; a structure larger than that is a graph of its own). ``memory_budget_gb`` and ``min_distance`` as in
    ``predict_many``; a structure that cannot be evaluated is a BatchError naming its ``index``. Returns the sizer
    (its choice)."""
    sizer, flight = BatchSizer(model, max_atoms), []
    while True:
        held = sum(len(task.atoms) for task in flight)
        while (size := queue.next_size()) is not None and \
                sizer.has_room(held, len(flight), size, queue.plenty(sizer.trial_structures)):
            task = queue.take()
            if task is None:  # (the queue's last went elsewhere)
                break
            flight.append(task)
            held += len(task.atoms)
        if not flight:
            return sizer
        results = predict_many(model, [t.atoms for t in flight], memory_budget_gb=memory_budget_gb,
                               min_distance=min_distance, names=[t.index for t in flight], sizer=sizer,
                               strain_derivative=True)
        still = []
        for task, result in zip(flight, results):
            if task.advance(result):
                done(task)
            else:
                still.append(task)
        flight = still


def _collect(model, tasks, **options) -> list:
    """The tasks run (``run_tasks``), their atoms in input order, each with info "converged" and "steps"."""
    finished = []
    run_tasks(model, TaskQueue(tasks), finished.append, **options)
    for task in finished:
        task.atoms.info.update(converged=task.converged, steps=task.steps)
    return [task.atoms for task in sorted(finished, key=lambda task: task.index)]


def single_points(model, structures, max_atoms: float | None = None, **options) -> list:
    """Copies of ``structures`` (ASE Atoms) with their results as a single-point calculator (``attach_results``;
    a committee's deviation in ``info`` and ``arrays``), evaluated in batches (``run_tasks``)."""
    return _collect(model, [SinglePoint(k, atoms.copy()) for k, atoms in enumerate(structures)],
                    max_atoms=max_atoms, **options)


def relax_many(model, structures, fmax: float = 0.05, max_steps: int = 1000, cell: bool = False,
               max_atoms: float | None = None, **options) -> list:
    """Relaxed copies of ``structures`` (ASE Atoms): each as ``FIRE(atoms or FrechetCellFilter(atoms)).run(fmax,
    max_steps)`` with this package's calculator leaves it, in batches (``run_tasks``). Each copy's ``info`` holds
    "converged" and "steps"; its calculator the final energy, forces and stress."""
    tasks = [Relaxation(k, atoms.copy(), fmax, max_steps, cell) for k, atoms in enumerate(structures)]
    return _collect(model, tasks, max_atoms=max_atoms, **options)



def md_many(model, structures, integrators, steps: int, frame_every: int = 0, max_atoms: float | None = None,
            **options) -> tuple:
    """MD of each of ``structures`` (ASE Atoms with their start velocities) for ``steps`` steps, structure k with
    ``integrators[k]`` (its own ``md.integrators`` object: ensemble, temperature, pressure, seed), in batches
    (``run_tasks``). Returns (the last frames, in order: positions, cell, velocities, results, info "step" and
    "steps"; the frames every ``frame_every`` steps: {k: [Atoms, ...]}, empty for 0)."""
    structures, integrators = list(structures), list(integrators)
    if len(integrators) != len(structures) or len({id(i) for i in integrators}) != len(integrators):
        raise ValueError(f"md_many needs one integrator object of its own per structure (its thermostat and barostat "
                         f"state is the structure's): {len(structures)} structures, {len(integrators)} integrators, "
                         f"{len({id(i) for i in integrators})} distinct")
    frames = {}

    def keep(task, step):
        frame = task.atoms.copy()
        frame.calc = SinglePointCalculator(frame, **task.atoms.calc.results)
        frames.setdefault(task.index, []).append(frame)

    device = model.device
    tasks = [MDRun(k, atoms.copy(), integrator, steps, frame_every, keep, device)
             for k, (atoms, integrator) in enumerate(zip(structures, integrators))]
    return _collect(model, tasks, max_atoms=max_atoms, **options), frames


class Finished:
    """A structure run by other means than a batch (``run_decomposed``), as ``run_tasks``' tasks report one."""

    def __init__(self, index: int, atoms, converged: bool = True, steps: int = 0):
        self.index, self.atoms, self.converged, self.steps = index, atoms, converged, steps


def run_decomposed(model, index: int, atoms, task: str, comm, relax: dict | None = None, md: dict | None = None,
                   memory_budget_gb: float | None = None, min_distance: float = MIN_DISTANCE) -> Finished:
    """Structure ``index`` (``atoms``, the same on every rank of ``comm``), too large for one rank, run by all of them
    together, spatially decomposed (collective): a single point (``mlip_parallel.evaluate``); ASE's FIRE with
    ``MLIPCalculator(model, comm)`` (``relax``: fmax, max_steps, cell); or mlip-md's engine (``md``: integrator,
    steps, frame_every, frame(task, step)). The same result on every rank, and the same as the batch tasks give
    (up to summation order)."""
    if task == "single_point":
        attach_results(atoms, mlip_parallel.evaluate(model, atoms, comm=comm, memory_budget_gb=memory_budget_gb,
                                                     min_distance=min_distance))
        return Finished(index, atoms)
    if task == "relax":
        calculator = MLIPCalculator(model, comm=comm, memory_budget_gb=memory_budget_gb, min_distance=min_distance)
        atoms.calc = calculator
        optimizer = FIRE(FrechetCellFilter(atoms) if relax["cell"] else atoms, logfile=None)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "logm result may be inaccurate", RuntimeWarning)
            converged = bool(optimizer.run(fmax=relax["fmax"], steps=relax["max_steps"]))
        attach_results(atoms, dict(calculator.results))
        return Finished(index, atoms, converged, optimizer.nsteps)
    system = MDSystem.from_atoms(model, atoms, comm=comm, memory_budget_gb=memory_budget_gb,
                                 system=system_of(atoms.info))  # (the charge and spin the batch gives the model)
    system.compute_forces()
    integrator, steps, every = md["integrator"], md["steps"], md["frame_every"]
    finished, step = Finished(index, atoms, True, 0), 0
    for stop in sorted({steps} | (set(range(0, steps + 1, every)) if every else set())):
        run(system, integrator, stop - step, start_step=step)
        step = finished.steps = stop
        positions, velocities, forces = (system.gather(key) for key in ("positions", "velocities", "forces"))
        atoms.set_cell(system.cell)
        atoms.positions = positions
        atoms.set_velocities(velocities)
        result = {"energy": system.energy, "forces": forces, "dE_dstrain": system.virial}
        if atoms.cell.rank == 3:
            result["stress"] = voigt_stress(system.virial, atoms.cell.volume)
        attach_results(atoms, result)
        atoms.info.update(step=stop, time_fs=stop * integrator.dt / units.fs)
        if md.get("frame") is not None and every:
            md["frame"](finished, stop)
    return finished
