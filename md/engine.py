"""Native distributed MD (docs/architecture.md §4): each rank holds only its own atoms.

One step, written once (``run``):

    integrator.first_half(system)       thermostat/barostat, half-kick, drift (+ O-step, new cell)
    system.maybe_rebuild()              any atom (or ghost, through a cell change) moved > skin/2
                                        (allreduce MAX)? [every balance_every steps: new cut planes]
                                          wrap → exchange() → borders() → pairs within cutoff + skin
                                        else ghosts follow their owners (forward_comm in the force call)
    system.compute_forces()             model + reverse exchange of ghost gradients (autograd)
    integrator.second_half(system)      half-kick, thermostat/barostat
    thermo (allreduced)

Where the data live: per-atom arrays (positions, velocities, forces, ...) are torch tensors on the
model's device (``cuda:<local rank>`` on GPUs) from one rebuild to the next; integrator sub-steps,
the skin check and the model run there. A step copies to the host only a few global numbers (the
skin check's three distances, the energy and virial, the kinetic tensor). A rebuild (every few
tens of steps) stages the owned atoms through the host for migration and the ghost plan; thermo
output and restarts gather what they write.

Units are ASE's: Å, eV, amu, time in ASE units (``dt_fs * ase.units.fs``).
"""
from __future__ import annotations

import json
import time

import numpy as np
import torch
from ase import units

from mlip_parallel import (MODES, DecompositionError, Domain, Grid, LostAtomsError, Subdomain, forward_decomposed,
                           get_backend)
from mlip_parallel.errors import SimulationError
from mlip_parallel.evaluate import committee_step, deviation_summary, ghost_reach, global_sums
from mlip_parallel.preflight import check_rank_memory
from potentials.committee import Committee
from potentials.errors import InvalidStructureError
from potentials.files import atomic_write
from potentials.messages import memory_budget_bytes

PER_ATOM = ("positions", "velocities", "masses", "numbers", "ids", "image")
PHASES = ("force", "halo", "neighbour", "integrate", "output")  # where a step's time goes (``MDSystem.timers``)


def _host(x) -> np.ndarray:
    """A tensor (any device) or array as a host numpy array."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def checked_new_cell(cell, pbc) -> np.ndarray:
    """A barostat's new cell [3, 3] as float64; InvalidStructureError where the system is not periodic in every
    direction (``pbc``) or the cell became degenerate or non-finite."""
    if not np.all(pbc):
        raise InvalidStructureError(f"the cell can change only in fully periodic systems, pbc={np.asarray(pbc).tolist()}")
    cell = np.asarray(cell, dtype=np.float64)
    if not np.all(np.isfinite(cell)) or abs(np.linalg.det(cell)) < 1e-9:
        raise InvalidStructureError(f"the cell became degenerate or non-finite: {cell.tolist()}")
    return cell


class MDSystem:
    """Rank-local atoms and their ``Subdomain`` (``sub``, rebuilt when they moved skin/2); computes forces.

    ``atoms``: dict of this rank's per-atom tensors on ``device`` (the model's; PER_ATOM keys:
    positions [n, 3] float64 Å, velocities [n, 3] float64 Å/ASE-time, masses [n] float64 amu, numbers
    [n], ids [n] global ids, image [n, 3] int64). After ``compute_forces``: ``forces`` [n, 3] float64
    eV/Å on ``device``, ``energy`` (eV, global, float), ``virial`` [3, 3] = dE/dε (global, numpy).
    ``gather(key)`` collects any of them in global id order on the host.

    ``timers``: this rank's seconds so far per phase (``PHASES``): force (the model, less its halo
    messages), halo (feature and gradient exchanges and the energy/virial sum inside the force call),
    neighbour (rebuild checks,
    migration, ghosts, pair lists), integrate (the integrator's half steps with their reductions),
    output (thermo and whatever the caller adds, e.g. files).

    ``balance``: cut planes shifted per dimension so that ranks own similar atom counts (slabs,
    droplets), set at the start and again at every ``maybe_rebuild(rebalance=True)`` (``run``'s
    ``balance_every``); otherwise uniform planes. ``cuts``:
    given cut planes (three arrays of relative positions 0 … 1; restarts keep the decomposition).
    ``memory_budget_gb``: the most one chunk of a block's per-edge temporaries may take (None: chosen at the start
    by the memory pre-flight and kept for the run: every edge at once where that fits, else a share of the device's
    free memory; ``mlip_parallel.preflight.check_rank_memory``).
    ``system``: the structure's charge and spin as ``AtomGraph.system`` holds them (``potentials.graph.system_of``;
    None: the model's defaults), for a model that reads them.
    """

    def __init__(self, model, atoms: dict, cell, pbc, *, skin: float = 1.0, mode: str = "layerwise",
                 grid=None, comm=None, balance: bool = False, cuts=None, memory_budget_gb: float | None = None,
                 system: dict | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 <= skin < np.inf:
            raise ValueError(f"skin must be a finite number >= 0 (Å), got {skin}")
        self.model, self.mode, self.skin, self.grid_dims, self.system = model, mode, float(skin), grid, system
        self.backend, self.device = get_backend(comm), model.device
        memory_budget_bytes(memory_budget_gb, self.device)  # a bad value raises here
        self.memory_budget_gb = memory_budget_gb  # None: chosen by the first rebuild's pre-flight, then kept
        self.cell, self.pbc = np.asarray(cell, dtype=np.float64), np.asarray(pbc, dtype=bool)
        self.atoms = {k: _host(atoms[k]) for k in PER_ATOM}
        self.n_atoms = int(self.backend.allreduce(len(self.atoms["ids"])))
        if self.n_atoms == 0:
            raise InvalidStructureError("the system has no atoms")
        self.rebuilds, self.cuts, self.dims = 0, cuts, None  # relative cut planes (None: uniform)
        self.timers = dict.fromkeys(PHASES, 0.0)
        if cuts is not None:
            self.dims = tuple(len(c) - 1 for c in cuts)
            if int(np.prod(self.dims)) != self.backend.size:
                raise DecompositionError(f"cut planes for a {self.dims} grid, but the job has {self.backend.size} rank(s)")
        self.rebuild(rebalance=balance)

    @classmethod
    def from_atoms(cls, model, atoms, **kwargs):
        """Start from an ASE Atoms that every rank holds: each rank keeps only its own atoms."""
        n = len(atoms)
        local = {"positions": atoms.positions, "velocities": atoms.get_velocities(), "masses": atoms.get_masses(),
                 "numbers": atoms.numbers, "ids": np.arange(n), "image": np.zeros((n, 3), dtype=np.int64)}
        backend = get_backend(kwargs.get("comm"))
        mine = np.arange(n) % backend.size == backend.rank  # any split: the first rebuild migrates them
        return cls(model, {k: np.asarray(v)[mine] for k, v in local.items()}, atoms.cell[:], atoms.pbc, **kwargs)

    def save_restart(self, path, step: int, integrator=None, outputs: dict | None = None) -> None:
        """Write the full state (all atoms in global id order, cell, pbc, step, the cut planes and the
        ``integrator``'s variables) to ``path`` (.npz) from rank 0 (collective), atomically: the previous
        file stays whole until the new one is complete. Random numbers are counter-based, so nothing else
        is needed to continue exactly. ``outputs``: what the run's output files held at this step
        (``md.outputs.RunFiles.record``), stored as JSON under "outputs"."""
        state = {key: self.gather(key) for key in PER_ATOM}
        if integrator is not None:
            state["integrator"] = np.array(type(integrator).__name__)
            state.update({f"integrator.{k}": v for k, v in integrator.state_dict().items()})
        if self.cuts is not None:
            state.update({f"cuts.{d}": c for d, c in enumerate(self.cuts)})
        if outputs is not None:
            state["outputs"] = np.array(json.dumps(outputs))
        if self.backend.rank == 0:
            with atomic_write(path) as f:
                np.savez(f, step=step, cell=self.cell, pbc=self.pbc, **state)
        self.backend.barrier()

    @classmethod
    def from_restart(cls, model, path, integrator=None, **kwargs):
        """(system, step) continuing the run saved by ``save_restart``; every rank reads the file. The
        saved integrator variables are loaded into ``integrator`` (which must be of the saved type)."""
        with np.load(path) as data:
            state = {key: data[key] for key in PER_ATOM}
            cell, pbc, step = data["cell"], data["pbc"], int(data["step"])
            saved = str(data["integrator"]) if "integrator" in data else None
            variables = {k[len("integrator."):]: data[k] for k in data.files if k.startswith("integrator.")}
            cuts = [data[f"cuts.{d}"] for d in range(3)] if "cuts.0" in data else None
        if integrator is not None:
            if saved not in (None, type(integrator).__name__):
                raise ValueError(f"{path} was written by a {saved} run, not {type(integrator).__name__}")
            integrator.load_state_dict(variables)
        backend = get_backend(kwargs.get("comm"))
        mine = state["ids"] % backend.size == backend.rank
        if cuts is not None and np.prod([len(c) - 1 for c in cuts]) == backend.size:
            kwargs.setdefault("cuts", cuts)  # the saved decomposition: forces summed in the same order
        elif cuts is not None:
            kwargs.setdefault("balance", True)  # another number of ranks: balance anew
        return cls(model, {k: v[mine] for k, v in state.items()}, cell, pbc, **kwargs), step

    # --------------------------------------------------------------- decomposition
    def rebuild(self, rebalance: bool = False) -> None:
        """Wrap, migrate atoms to their owners, rebuild ghosts and the pair candidates (collective).
        ``rebalance``: first move the cut planes so that ranks own similar atom counts."""
        host = {k: _host(v) for k, v in self.atoms.items()}  # migration and the ghost plan work on the host
        positions = host["positions"]
        if not np.all(np.isfinite(positions)):
            raise InvalidStructureError(f"rank {self.backend.rank}: non-finite positions at rebuild")
        domain = Domain.from_positions(positions, self.cell, self.pbc, self.backend)
        if self.dims is None:  # chosen once: the grid keeps its shape when the cell changes
            self.dims = Grid.for_ranks(self.backend.size, domain, self.grid_dims).dims
        if rebalance:
            wrapped, _ = domain.wrap(positions)
            self.cuts = Grid.balanced_cuts(self.dims, domain, wrapped, self.backend)
        grid = Grid.from_cuts(self.dims, domain, self.cuts) if self.cuts is not None else \
            Grid.uniform(self.dims, domain)
        # Å: the smallest subdomain width, for the blow-up check, along the dimensions an atom can leave its rank by
        # (split, or periodic); along a non-periodic one that is not split the width is the atoms' own extent (a flat
        # molecule's: its padding, 2e-6 Å), which an atom leaves without changing rank
        self.thinnest = min((np.diff(grid.planes[d]).min() / np.linalg.norm(domain.inverse[:, d])
                             for d in range(3) if grid.dims[d] > 1 or self.pbc[d]), default=np.inf)
        if self.rebuilds == 0:  # before the first ghosts: stop every rank when the fullest would not fit
            self.memory_budget_gb = check_rank_memory(self.backend, self.model, self.n_atoms, domain, self.dims,
                                                      ghost_reach(self.model, self.mode), self.skin,
                                                      self.mode == "layerwise", self.memory_budget_gb)
        self.sub = Subdomain(self.backend, domain, grid)
        host = self.sub.comm.exchange(host)
        count = int(self.backend.allreduce(len(host["ids"])))
        if count != self.n_atoms:
            raise LostAtomsError(f"{self.n_atoms} atoms before migration, {count} after")
        self.sub.build(host["positions"], host["ids"], host["numbers"], ghost_reach(self.model, self.mode),
                       self.skin, self.model.cutoff + self.skin, layerwise=self.mode == "layerwise", device=self.device)
        self.atoms = {k: torch.as_tensor(v, device=self.device) for k, v in host.items()}
        self.rebuilds += 1

    def set_cell(self, cell) -> None:
        """A new periodic cell [3, 3] (barostats). Ghosts follow it at once (their image shifts use the
        current cell); ``maybe_rebuild`` re-decomposes when they may have moved past the skin."""
        self.cell = checked_new_cell(cell, self.pbc)
        self.sub.set_cell(self.cell)

    def maybe_rebuild(self, previous: torch.Tensor | None = None, rebalance: bool = False) -> bool:
        """Rebuild when any atom moved more than skin/2 since the last rebuild (decided collectively);
        a changed cell moves ghosts further, by their image shift @ Δcell. With ``previous`` positions
        (before this step), an atom that moved farther than the thinnest subdomain in one step ends the
        run: the dynamics has blown up. ``rebalance``: rebuild now, with new cut planes."""
        moved = np.array(self.sub.displacement(self.atoms["positions"], previous))  # owned, ghost, step
        finite = np.isfinite(moved).all()  # sent as a flag: an MPI MAX need not propagate NaN
        farthest, ghost_extra, jump, broken = self.backend.allreduce(
            np.append(np.where(finite, moved, 0.0), float(not finite)), op="max")
        if broken:
            raise SimulationError("non-finite positions: the dynamics blew up (time step too large?)")
        if jump > self.thinnest:
            raise SimulationError(f"an atom moved {jump:.3g} Å in one step, farther than the thinnest subdomain "
                                  f"({self.thinnest:.3g} Å): the dynamics blew up (time step too large?)")
        if rebalance or farthest + ghost_extra > 0.5 * self.skin:
            self.rebuild(rebalance)
            return True
        return False

    # ---------------------------------------------------------------------- forces
    def compute_forces(self) -> None:
        """Forces on owned atoms, the global energy and virial (collective). A committee
        (``potentials.Committee``) runs its members on this one decomposition: the forces, energy and virial are
        their mean (or the first member's), and ``devi_f`` [n] (numpy) holds the owned atoms' force deviation,
        ``member_energies`` [K] the members' global energies (``deviation`` reduces them)."""
        start, messages = time.perf_counter(), self.backend.comm_seconds
        self.sub.positions = self.atoms["positions"]
        if isinstance(self.model, Committee):
            step = committee_step(self.model, self.sub, self.mode, memory_budget_gb=self.memory_budget_gb,
                                  system=self.system)
            self.forces, self.energy, self.virial = step.forces.detach(), step.energy, step.dE_dstrain
            self.devi_f, self.member_energies = _host(step.devi_f), step.member_energies
        else:
            energies, forces, dE_dstrain = forward_decomposed(self.model, self.sub, self.mode,
                                                              memory_budget_gb=self.memory_budget_gb,
                                                              system=self.system)
            self.forces = forces.detach()
            self.energy, self.virial = global_sums(self.backend, energies, dE_dstrain, forces=self.forces)
        halo = self.backend.comm_seconds - messages
        self.timers["halo"] += halo
        self.timers["force"] += time.perf_counter() - start - halo

    def deviation(self) -> dict:
        """The committee's model deviation at the last force call (collective): DeePMD's "max_devi_f",
        "min_devi_f", "avg_devi_f" (σ_F over every atom, eV/Å) and "devi_e" (the members' standard deviation of the
        total energy, per atom, eV)."""
        return deviation_summary(self.backend, self.devi_f, self.member_energies, self.n_atoms)

    # -------------------------------------------------------------------- thermo
    def kinetic_tensor(self) -> np.ndarray:
        """[3, 3] Σ m v⊗v over all atoms (eV, collective)."""
        v, m = self.atoms["velocities"], self.atoms["masses"]
        return self.backend.allreduce(_host((m[:, None] * v).T @ v))

    def kinetic_energy(self) -> float:
        """Σ ½ m v² over all atoms (eV, collective)."""
        return 0.5 * float(np.trace(self.kinetic_tensor()))

    def thermo(self, step: int, dt: float) -> dict:
        """Global thermodynamic quantities (collective): ASE's conventions (3N degrees of freedom)."""
        kinetic = self.kinetic_energy()
        volume = abs(np.linalg.det(self.sub.domain.cell))
        temperature = 2.0 * kinetic / (3.0 * self.n_atoms * units.kB)
        pressure = (2.0 * kinetic - np.trace(self.virial)) / (3.0 * volume)
        return {"step": step, "time_fs": step * dt / units.fs, "temperature_K": temperature,
                "epot_eV": self.energy, "ekin_eV": kinetic, "etot_eV": self.energy + kinetic,
                "pressure_GPa": pressure / units.GPa, "volume_A3": volume}

    def gather(self, key: str) -> np.ndarray:
        """A per-atom array of every rank, in global id order (collective; for output and tests)."""
        value = self.atoms[key] if key in self.atoms else getattr(self, key)
        parts = self.backend.allgather((_host(self.atoms["ids"]), _host(value)))
        ids = np.concatenate([p[0] for p in parts])
        values = np.concatenate([p[1] for p in parts])
        out = np.empty_like(values)
        out[ids] = values
        return out


def run(system: MDSystem, integrator, steps: int, thermo_every: int = 1, start_step: int = 0,
        balance_every: int = 0) -> list:
    """Advance ``steps`` steps; return the thermo rows (identical on every rank) every ``thermo_every``
    steps, step ``start_step`` included. ``balance_every``: new cut planes every N steps (0: never)."""
    if not hasattr(system, "forces"):
        system.compute_forces()
    timers, clock = system.timers, time.perf_counter
    t = clock()
    rows = [system.thermo(start_step, integrator.dt)]
    timers["output"] += clock() - t
    for step in range(start_step + 1, start_step + steps + 1):
        previous = system.atoms["positions"]
        t0 = clock()
        integrator.first_half(system, step)
        t1 = clock()
        system.maybe_rebuild(previous, rebalance=bool(balance_every) and step % balance_every == 0)
        t2 = clock()
        system.compute_forces()  # times itself: force and halo
        t3 = clock()
        integrator.second_half(system, step)
        t4 = clock()
        if step % thermo_every == 0:
            rows.append(system.thermo(step, integrator.dt))
        timers["integrate"] += (t1 - t0) + (t4 - t3)
        timers["neighbour"] += t2 - t1
        timers["output"] += clock() - t4
    return rows
