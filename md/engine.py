"""Native distributed MD (DESIGN.md §4): each rank holds only its own atoms.

One step, written once (``run``):

    integrator.first_half(state)        half-kick, drift (+ O-step), owned atoms only
    system.maybe_rebuild()              any atom moved > skin/2 (allreduce MAX)?
                                          wrap → exchange() → borders() → pairs within cutoff + skin
                                        else ghosts follow their owners (forward_comm in the force call)
    system.compute_forces()             model + reverse exchange of ghost gradients (autograd)
    integrator.second_half(state)       half-kick
    thermo (allreduced)

Units are ASE's: Å, eV, amu, time in ASE units (``dt_fs * ase.units.fs``).
"""
from __future__ import annotations

import numpy as np
import torch
from ase import units

from mlip_parallel import MODES, Comm, Domain, Grid, LostAtomsError, forward_decomposed, get_backend
from potentials.errors import InvalidStructureError
from potentials.graph import neighbour_list

PER_ATOM = ("positions", "velocities", "masses", "numbers", "ids", "image")


class MDSystem:
    """Rank-local atoms, their decomposition and the neighbour skin; computes forces.

    ``atoms``: dict of this rank's per-atom arrays (PER_ATOM keys: positions [n, 3] Å, velocities
    [n, 3] Å/ASE-time, masses [n] amu, numbers [n], ids [n] global ids, image [n, 3]). After
    ``compute_forces``: ``forces`` [n, 3] eV/Å, ``energy`` (eV, global), ``virial`` [3, 3] = dE/dε
    (global).
    """

    def __init__(self, model, atoms: dict, cell, pbc, *, skin: float = 1.0, mode: str = "layerwise",
                 grid=None, comm=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if skin < 0:
            raise ValueError(f"skin must be >= 0, got {skin}")
        self.model, self.mode, self.skin, self.grid_dims = model, mode, float(skin), grid
        self.backend = get_backend(comm)
        self.cell, self.pbc = np.asarray(cell, dtype=np.float64), np.asarray(pbc, dtype=bool)
        self.atoms = {k: np.asarray(atoms[k]) for k in PER_ATOM}
        self.n_atoms = int(self.backend.allreduce(len(self.atoms["ids"])))
        self.rebuilds = 0
        self.rebuild()

    @classmethod
    def from_atoms(cls, model, atoms, **kwargs):
        """Start from an ASE Atoms that every rank holds: each rank keeps only its own atoms."""
        n = len(atoms)
        local = {"positions": atoms.positions, "velocities": atoms.get_velocities(), "masses": atoms.get_masses(),
                 "numbers": atoms.numbers, "ids": np.arange(n), "image": np.zeros((n, 3), dtype=np.int64)}
        backend = get_backend(kwargs.get("comm"))
        mine = np.arange(n) % backend.size == backend.rank  # any split: the first rebuild migrates them
        return cls(model, {k: np.asarray(v)[mine] for k, v in local.items()}, atoms.cell[:], atoms.pbc, **kwargs)

    def save_restart(self, path, step: int) -> None:
        """Write the full state (all atoms in global id order, cell, pbc, step) to ``path`` (.npz) from
        rank 0 (collective). Random numbers are counter-based, so nothing else is needed to continue."""
        state = {key: self.gather(key) for key in PER_ATOM}
        if self.backend.rank == 0:
            np.savez(path, step=step, cell=self.cell, pbc=self.pbc, **state)
        self.backend.barrier()

    @classmethod
    def from_restart(cls, model, path, **kwargs):
        """(system, step) continuing the run saved by ``save_restart``; every rank reads the file."""
        with np.load(path) as data:
            state = {key: data[key] for key in PER_ATOM}
            cell, pbc, step = data["cell"], data["pbc"], int(data["step"])
        backend = get_backend(kwargs.get("comm"))
        mine = state["ids"] % backend.size == backend.rank
        return cls(model, {k: v[mine] for k, v in state.items()}, cell, pbc, **kwargs), step

    # --------------------------------------------------------------- decomposition
    @property
    def positions(self) -> np.ndarray:
        return self.atoms["positions"]

    def rebuild(self) -> None:
        """Wrap, migrate atoms to their owners, rebuild ghosts and the pair candidates (collective)."""
        positions = self.atoms["positions"]
        if not np.all(np.isfinite(positions)):
            raise InvalidStructureError(f"rank {self.backend.rank}: non-finite positions at rebuild")
        self.domain = Domain.from_positions(positions, self.cell, self.pbc, self.backend)
        self.grid = Grid.for_ranks(self.backend.size, self.domain, self.grid_dims)
        self.comm = Comm(self.backend, self.grid, self.domain)
        self.thinnest = min(np.diff(self.grid.planes[d]).min() / np.linalg.norm(self.domain.inverse[:, d])
                            for d in range(3))  # Å: the smallest subdomain width, for the blow-up check
        self.atoms = self.comm.exchange(self.atoms)
        count = int(self.backend.allreduce(len(self.atoms["ids"])))
        if count != self.n_atoms:
            raise LostAtomsError(f"{self.n_atoms} atoms before migration, {count} after")
        reach = self.model.cutoff * (self.model.layers if self.mode == "wide" else 1)
        self.comm.borders(self.atoms["positions"], self.atoms["ids"], reach + self.skin)
        ghost_numbers = self.comm.forward_comm(torch.as_tensor(self.atoms["numbers"], dtype=torch.float64))
        self.numbers = np.concatenate([self.atoms["numbers"], ghost_numbers.numpy().round().astype(np.int64)])
        local = np.concatenate([self.atoms["positions"], self._ghost_positions()])
        i, j, _ = neighbour_list(local, self.domain.cell, False, self.model.cutoff + self.skin)
        if self.mode == "layerwise":  # only owned atoms receive: drop ghost-ghost pairs once, here
            keep = i < len(self.atoms["ids"])
            i, j = i[keep], j[keep]
        self.candidates = (i, j)
        self.reference = self.atoms["positions"].copy()
        self.rebuilds += 1

    def maybe_rebuild(self, previous: np.ndarray | None = None) -> bool:
        """Rebuild when any atom moved more than skin/2 since the last rebuild (decided collectively).
        With ``previous`` positions (before this step), an atom that moved farther than the thinnest
        subdomain in one step ends the run: the dynamics has blown up."""
        positions = self.atoms["positions"]
        moved = np.sqrt(((positions - self.reference) ** 2).sum(axis=1))
        step = np.sqrt(((positions - previous) ** 2).sum(axis=1)) if previous is not None else moved[:0]
        farthest, jump = self.backend.allreduce(
            np.array([moved.max() if len(moved) else 0.0, step.max() if len(step) else 0.0]), op="max")
        if not (np.isfinite(farthest) and np.isfinite(jump)):
            raise InvalidStructureError("non-finite positions during MD")
        if jump > self.thinnest:
            raise InvalidStructureError(f"an atom moved {jump:.3g} A in one step, farther than the thinnest "
                                        f"subdomain ({self.thinnest:.3g} A): unstable dynamics (time step too large?)")
        if farthest > 0.5 * self.skin:
            self.rebuild()
            return True
        return False

    def _ghost_positions(self) -> np.ndarray:
        owned = torch.as_tensor(self.atoms["positions"], dtype=torch.float64)
        return self.comm.ghost_positions(owned, torch.as_tensor(self.domain.cell)).numpy()

    # ---------------------------------------------------------------------- forces
    def compute_forces(self) -> None:
        """Forces on owned atoms, the global energy and virial (collective)."""
        energies, forces, dE_dstrain = forward_decomposed(self.model, self, self.mode, candidates=self.candidates)
        self.forces = forces.detach().cpu().numpy()
        if not np.all(np.isfinite(self.forces)):
            raise InvalidStructureError(f"rank {self.backend.rank}: non-finite forces")
        self.energy = float(self.backend.allreduce(np.array([energies.detach().sum().item()]))[0])
        self.virial = self.backend.allreduce(dE_dstrain.cpu().numpy())

    # -------------------------------------------------------------------- thermo
    def kinetic_energy(self) -> float:
        """Σ ½ m v² over all atoms (eV, collective)."""
        v, m = self.atoms["velocities"], self.atoms["masses"]
        return float(self.backend.allreduce(np.array([0.5 * np.sum(m[:, None] * v * v)]))[0])

    def thermo(self, step: int, dt: float) -> dict:
        """Global thermodynamic quantities (collective): ASE's conventions (3N degrees of freedom)."""
        kinetic = self.kinetic_energy()
        volume = abs(np.linalg.det(self.domain.cell))
        temperature = 2.0 * kinetic / (3.0 * self.n_atoms * units.kB)
        pressure = (2.0 * kinetic - np.trace(self.virial)) / (3.0 * volume)
        return {"step": step, "time_fs": step * dt / units.fs, "temperature_K": temperature,
                "epot_eV": self.energy, "ekin_eV": kinetic, "etot_eV": self.energy + kinetic,
                "pressure_GPa": pressure / units.GPa, "volume_A3": volume}

    def gather(self, key: str) -> np.ndarray:
        """A per-atom array of every rank, in global id order (collective; for output and tests)."""
        parts = self.backend.allgather((self.atoms["ids"], self.atoms[key] if key in self.atoms else getattr(self, key)))
        ids = np.concatenate([p[0] for p in parts])
        values = np.concatenate([p[1] for p in parts])
        out = np.empty_like(values)
        out[ids] = values
        return out


# ------------------------------------------------------------------ integrators
def gaussian(seed: int, step: int, ids: np.ndarray) -> np.ndarray:
    """[n, 3] standard normal numbers that depend only on (seed, step, global atom id): the same
    trajectory whatever the number of ranks. Counter-based (splitmix64 hash + Box–Muller)."""
    def mix(x):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    with np.errstate(over="ignore"):
        base = mix(mix(np.uint64(seed)) ^ np.uint64(step))
        keys = mix(base ^ np.asarray(ids, dtype=np.uint64))[:, None] * np.uint64(8) + np.arange(6, dtype=np.uint64)
        u = (mix(keys) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    u1, u2 = 1.0 - u[:, :3], u[:, 3:]  # u1 in (0, 1]
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


class VelocityVerlet:
    """NVE: half-kick, drift | forces | half-kick."""

    def __init__(self, dt_fs: float):
        self.dt = dt_fs * units.fs

    def first_half(self, system: MDSystem, step: int) -> None:
        a = system.atoms
        a["velocities"] = a["velocities"] + 0.5 * self.dt * system.forces / a["masses"][:, None]
        a["positions"] = a["positions"] + self.dt * a["velocities"]

    def second_half(self, system: MDSystem, step: int) -> None:
        a = system.atoms
        a["velocities"] = a["velocities"] + 0.5 * self.dt * system.forces / a["masses"][:, None]


class Langevin(VelocityVerlet):
    """NVT Langevin, BAOAB splitting (Leimkuhler–Matthews): B A O A | forces | B. ``friction`` in 1/fs;
    noise from ``gaussian(seed, step, id)``."""

    def __init__(self, dt_fs: float, temperature_K: float, friction: float, seed: int = 0):
        super().__init__(dt_fs)
        self.kT = units.kB * temperature_K
        self.c1 = np.exp(-friction / units.fs * self.dt)
        self.c2 = np.sqrt(1.0 - self.c1**2)
        self.seed = int(seed)

    def first_half(self, system: MDSystem, step: int) -> None:
        a = system.atoms
        a["velocities"] = a["velocities"] + 0.5 * self.dt * system.forces / a["masses"][:, None]
        a["positions"] = a["positions"] + 0.5 * self.dt * a["velocities"]
        noise = gaussian(self.seed, step, a["ids"]) * np.sqrt(self.kT / a["masses"])[:, None]
        a["velocities"] = self.c1 * a["velocities"] + self.c2 * noise
        a["positions"] = a["positions"] + 0.5 * self.dt * a["velocities"]


class Bussi(VelocityVerlet):
    """NVT by stochastic velocity rescaling (Bussi, Donadio, Parrinello 2007, CSVR) after each velocity
    Verlet step. ``tau_fs``: relaxation time. The rescaling draws are global, from (seed, step): the
    same on every rank and for any number of ranks."""

    def __init__(self, dt_fs: float, temperature_K: float, tau_fs: float, seed: int = 0):
        super().__init__(dt_fs)
        if tau_fs <= 0 or temperature_K <= 0:
            raise ValueError(f"Bussi needs tau_fs > 0 and temperature_K > 0, got {tau_fs}, {temperature_K}")
        self.temperature, self.c = temperature_K, float(np.exp(-dt_fs / tau_fs))
        self.seed = int(seed)

    def second_half(self, system: MDSystem, step: int) -> None:
        super().second_half(system, step)
        a = system.atoms
        kinetic = system.kinetic_energy()
        dof = 3 * system.n_atoms
        target = 0.5 * dof * units.kB * self.temperature
        rng = np.random.default_rng([self.seed, step])
        r1 = rng.standard_normal()
        rest = 2.0 * rng.standard_gamma(0.5 * (dof - 1)) if dof > 1 else 0.0
        c, ratio = self.c, target / (dof * kinetic)
        alpha2 = c + (1 - c) * ratio * (r1 * r1 + rest) + 2.0 * r1 * np.sqrt(c * (1 - c) * ratio)
        sign = np.sign(r1 + np.sqrt(c / ((1 - c) * ratio)))
        a["velocities"] = a["velocities"] * (sign * np.sqrt(alpha2))


def run(system: MDSystem, integrator, steps: int, thermo_every: int = 1, start_step: int = 0) -> list:
    """Advance ``steps`` steps; return the thermo rows (identical on every rank) every ``thermo_every``
    steps, step ``start_step`` included."""
    if not hasattr(system, "forces"):
        system.compute_forces()
    rows = [system.thermo(start_step, integrator.dt)]
    for step in range(start_step + 1, start_step + steps + 1):
        previous = system.atoms["positions"]
        integrator.first_half(system, step)
        system.maybe_rebuild(previous)
        system.compute_forces()
        integrator.second_half(system, step)
        if step % thermo_every == 0:
            rows.append(system.thermo(step, integrator.dt))
    return rows
