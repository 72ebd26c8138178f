"""Integrators of the native MD engine (docs/architecture.md §4): small objects over the explicit state of an
``MDSystem`` — its rank-local ``atoms`` (positions, velocities, masses, ids: torch tensors on the model's
device), ``forces`` (there too), the global ``virial`` and ``cell`` (host numpy, 3 × 3). Per-atom
arithmetic runs where the atoms are; only global scalars and 3 × 3 matrices pass through the host.

Each integrator splits a step around the force call: ``first_half(system, step)`` (kicks, drift,
thermostat and barostat sub-steps, a new cell) and ``second_half(system, step)``. Its own global
variables (thermostat chains, cell momenta) are ``state_dict()`` / ``load_state_dict()`` for restarts.
Global sums go through ``system.kinetic_tensor()`` (one allreduce). Random numbers are functions of
(seed, step, global atom id), so a trajectory does not depend on the number of ranks.

Units are ASE's: Å, eV, amu; time steps and damping times are given in fs.
"""
from __future__ import annotations

import numpy as np
import torch
from ase import units
from scipy.special import exprel


def _signed(constant: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 tensors read as uint64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser over int64 tensors holding uint64 bits (two's-complement wrap-around)."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def uniforms(seed: int, step: int, ids: torch.Tensor) -> torch.Tensor:
    """[n, 6] float64 uniforms in [0, 1) (53 bits), on ``ids``' device, a function of (seed, step, global
    atom id, column) only: splitmix64 hashes of counters, computed where the atoms are."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    base = _mix(_mix(torch.tensor(int(seed), dtype=torch.int64, device=ids.device)) ^ int(step))
    keys = _mix(base ^ ids)[:, None] * 8 + torch.arange(6, device=ids.device)
    return _shift_right(_mix(keys), 11).to(torch.float64) * 2.0**-53


def gaussian(seed: int, step: int, ids: torch.Tensor) -> torch.Tensor:
    """[n, 3] float64 standard normal numbers (Box–Muller of ``uniforms``) that depend only on (seed,
    step, global atom id): the same trajectory whatever the number of ranks."""
    u = uniforms(seed, step, ids)
    u1, u2 = 1.0 - u[:, :3], u[:, 3:]  # u1 in (0, 1]
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * torch.pi * u2)


class VelocityVerlet:
    """NVE: half-kick, drift | forces | half-kick. The base of the others: ``kick`` and ``drift``."""

    def __init__(self, dt_fs: float):
        if not dt_fs > 0:
            raise ValueError(f"time step must be > 0 fs, got {dt_fs}")
        self.dt = dt_fs * units.fs

    def kick(self, system, delta: float) -> None:
        a = system.atoms
        a["velocities"] = a["velocities"] + delta * system.forces / a["masses"][:, None]

    def drift(self, system, delta: float) -> None:
        a = system.atoms
        a["positions"] = a["positions"] + delta * a["velocities"]

    def first_half(self, system, step: int) -> None:
        self.kick(system, 0.5 * self.dt)
        self.drift(system, self.dt)

    def second_half(self, system, step: int) -> None:
        self.kick(system, 0.5 * self.dt)

    def state_dict(self) -> dict:
        """The integrator's global variables (numpy arrays), for restarts."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        expected = set(self.state_dict())
        if set(state) != expected:
            raise ValueError(f"{type(self).__name__} state needs keys {sorted(expected)}, got {sorted(state)}")
        for key, value in state.items():
            self._set(key, np.array(value, dtype=np.float64))

    def _set(self, key, value):
        raise NotImplementedError


class Langevin(VelocityVerlet):
    """NVT Langevin, BAOAB splitting (Leimkuhler–Matthews): B A O A | forces | B. ``friction`` in 1/fs;
    noise from ``gaussian(seed, step, id)``."""

    def __init__(self, dt_fs: float, temperature_K: float, friction: float, seed: int = 0):
        super().__init__(dt_fs)
        self.kT = units.kB * temperature_K
        self.c1 = np.exp(-friction / units.fs * self.dt)
        self.c2 = np.sqrt(1.0 - self.c1**2)
        self.seed = int(seed)

    def first_half(self, system, step: int) -> None:
        a = system.atoms
        self.kick(system, 0.5 * self.dt)
        self.drift(system, 0.5 * self.dt)
        noise = gaussian(self.seed, step, a["ids"]) * torch.sqrt(self.kT / a["masses"])[:, None]
        a["velocities"] = self.c1 * a["velocities"] + self.c2 * noise
        self.drift(system, 0.5 * self.dt)


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

    def second_half(self, system, step: int) -> None:
        super().second_half(system, step)
        kinetic = system.kinetic_energy()
        dof = 3 * system.n_atoms
        target = 0.5 * dof * units.kB * self.temperature
        rng = np.random.default_rng([self.seed, step])
        r1 = rng.standard_normal()
        rest = 2.0 * rng.standard_gamma(0.5 * (dof - 1)) if dof > 1 else 0.0
        c, ratio = self.c, target / (dof * kinetic)
        alpha2 = c + (1 - c) * ratio * (r1 * r1 + rest) + 2.0 * r1 * np.sqrt(c * (1 - c) * ratio)
        sign = np.sign(r1 + np.sqrt(c / ((1 - c) * ratio)))
        system.atoms["velocities"] = system.atoms["velocities"] * float(sign * np.sqrt(alpha2))


# Fourth-order Suzuki–Yoshida weights for the chain sub-steps.
_W1 = 1.0 / (2.0 - 2.0 ** (1.0 / 3.0))
SUZUKI_YOSHIDA = (_W1, 1.0 - 2.0 * _W1, _W1)


class NoseHooverChain:
    """A Nosé–Hoover chain of ``length`` variables (Martyna, Klein, Tuckerman 1992) acting on momenta
    whose global Σ p²/m is given, integrated as ASE's ``NoseHooverChainThermostat`` (Suzuki–Yoshida,
    ``loops`` sub-steps). ``tau``: damping time (ASE units). Masses: Q_0 = mass_dof·kT·tau² (mass_dof
    defaults to the coupled degrees of freedom), Q_j = kT·tau²."""

    def __init__(self, temperature_K: float, tau: float, length: int = 3, loops: int = 1):
        if length < 1 or loops < 1 or not tau > 0 or not temperature_K > 0:
            raise ValueError(f"a Nose-Hoover chain needs length >= 1, loops >= 1, a damping time > 0 and a "
                             f"temperature > 0, got {length}, {loops}, {tau}, {temperature_K}")
        self.kT, self.tau, self.loops = units.kB * temperature_K, tau, loops
        self.eta, self.p_eta = np.zeros(length), np.zeros(length)

    def masses(self, dof: int, mass_dof=None) -> np.ndarray:
        q = np.full(len(self.eta), self.kT * self.tau**2)
        q[0] *= dof if mass_dof is None else mass_dof
        return q

    def propagate(self, twice_kinetic: float, dof: int, delta: float, mass_dof=None) -> float:
        """Advance the chain by ``delta``, coupled to momenta with Σ p²/m = ``twice_kinetic`` over ``dof``
        degrees of freedom; return the factor those momenta are scaled by."""
        q, m, scale = self.masses(dof, mass_dof), len(self.eta), 1.0
        for _ in range(self.loops):
            for weight in SUZUKI_YOSHIDA:
                d = weight * delta / self.loops
                for j in reversed(range(m)):
                    self._kick(j, twice_kinetic * scale**2, dof, q, d)
                self.eta += d * self.p_eta / q
                scale *= float(np.exp(-d * self.p_eta[0] / q[0]))
                for j in range(m):
                    self._kick(j, twice_kinetic * scale**2, dof, q, d)
        return scale

    def _kick(self, j, twice_kinetic, dof, q, d):
        p = self.p_eta
        last = j == len(p) - 1
        if not last:
            p[j] *= np.exp(-0.25 * d * p[j + 1] / q[j + 1])
        force = twice_kinetic - dof * self.kT if j == 0 else p[j - 1] ** 2 / q[j - 1] - self.kT
        p[j] += 0.5 * d * force
        if not last:
            p[j] *= np.exp(-0.25 * d * p[j + 1] / q[j + 1])

    def energy(self, dof: int, mass_dof=None) -> float:
        """The chain's contribution to the conserved energy (eV)."""
        q = self.masses(dof, mass_dof)
        return float(dof * self.kT * self.eta[0] + self.kT * self.eta[1:].sum() + (0.5 * self.p_eta**2 / q).sum())


class NoseHoover(VelocityVerlet):
    """NVT with a Nosé–Hoover chain on all 3N momenta: chain(dt/2), velocity Verlet, chain(dt/2) — the
    splitting of ASE's ``NoseHooverChainNVT``. ``tdamp_fs``: damping time (≈ 100 time steps)."""

    def __init__(self, dt_fs: float, temperature_K: float, tdamp_fs: float, chain: int = 3, loops: int = 1):
        super().__init__(dt_fs)
        self.thermostat = NoseHooverChain(temperature_K, tdamp_fs * units.fs, chain, loops)

    def thermostat_half(self, system) -> None:
        twice_kinetic = float(np.trace(system.kinetic_tensor()))
        scale = self.thermostat.propagate(twice_kinetic, 3 * system.n_atoms, 0.5 * self.dt)
        system.atoms["velocities"] = system.atoms["velocities"] * scale

    def first_half(self, system, step: int) -> None:
        self.thermostat_half(system)
        super().first_half(system, step)

    def second_half(self, system, step: int) -> None:
        super().second_half(system, step)
        self.thermostat_half(system)

    def conserved_energy(self, system) -> float:
        kinetic = 0.5 * float(np.trace(system.kinetic_tensor()))
        return system.energy + kinetic + self.thermostat.energy(3 * system.n_atoms)

    def state_dict(self) -> dict:
        return {"thermostat.eta": self.thermostat.eta, "thermostat.p_eta": self.thermostat.p_eta}

    def _set(self, key, value):
        name, field = key.split(".")
        setattr(getattr(self, name), field, value)


class MTK(NoseHoover):
    """NPT: Martyna–Tobias–Klein (1994) barostat with Nosé–Hoover chains on the particles and on the
    cell momenta, the Trotter splitting of ASE's ``IsotropicMTKNPT`` (``isotropic=True``: the cell
    scales uniformly) and ``MTKNPT`` (otherwise: all cell components fluctuate). ``pressure_GPa``:
    the target (hydrostatic) pressure; ``pdamp_fs``: barostat damping time (≈ 1000 time steps). The
    cell changes every step; ``MDSystem`` re-decomposes when ghosts may have moved past the skin.
    Fully periodic systems only."""

    def __init__(self, dt_fs: float, temperature_K: float, pressure_GPa: float, tdamp_fs: float,
                 pdamp_fs: float, isotropic: bool = True, chain: int = 3, loops: int = 1):
        super().__init__(dt_fs, temperature_K, tdamp_fs, chain, loops)
        self.pressure = pressure_GPa * units.GPa
        self.isotropic = bool(isotropic)
        self.barostat = NoseHooverChain(temperature_K, pdamp_fs * units.fs, chain, loops)
        self.p_cell = np.zeros(()) if self.isotropic else np.zeros((3, 3))  # p_eps, or the cell momenta p_g

    # the cell's mass and its chain's degrees of freedom (ASE's conventions)
    def _cell_mass(self, n: int) -> float:
        return (3 * n + 3 if self.isotropic else n + 1) * self.barostat.kT * self.barostat.tau**2

    def _cell_chain(self):
        return (1, 9) if self.isotropic else (9, 9)  # (dof, mass_dof)

    def _eig(self):
        """Eigenvalues [3] and eigenvectors [3, 3] (columns) of the cell momenta (numpy)."""
        if self.isotropic:
            return np.full(3, float(self.p_cell)), np.eye(3)
        return np.linalg.eigh(self.p_cell)

    @staticmethod
    def _on(like: torch.Tensor, *arrays):
        """Small host arrays (eigenvectors, factors) as float64 tensors on ``like``'s device."""
        return [torch.as_tensor(x, dtype=torch.float64, device=like.device) for x in arrays]

    def _barostat_half(self, system) -> None:
        dof, mass_dof = self._cell_chain()
        twice_kinetic = float(np.sum(self.p_cell**2)) / self._cell_mass(system.n_atoms)
        self.p_cell = self.p_cell * self.barostat.propagate(twice_kinetic, dof, 0.5 * self.dt, mass_dof)

    def _kick_cell(self, system, kinetic_tensor: np.ndarray, delta: float) -> None:
        """p_cell += delta · (V (P_internal − P_target) + Σp²/m / N_f terms); ``kinetic_tensor`` = Σ m v⊗v."""
        n, volume = system.n_atoms, abs(np.linalg.det(system.cell))
        if self.isotropic:
            trace = float(np.trace(kinetic_tensor))
            force = trace - float(np.trace(system.virial)) - 3 * volume * self.pressure + trace / n
        else:
            force = (kinetic_tensor - system.virial - self.pressure * volume * np.eye(3)
                     + np.trace(kinetic_tensor) / (3 * n) * np.eye(3))
        self.p_cell = self.p_cell + delta * force

    def kick(self, system, delta: float) -> None:
        a, mass = system.atoms, self._cell_mass(system.n_atoms)
        eigvals, u = self._eig()
        kappa = (eigvals + eigvals.sum() / (3 * system.n_atoms)) * delta / mass
        u, decay, growth = self._on(a["velocities"], u, np.exp(-kappa), delta * exprel(-kappa))
        v = (a["velocities"] @ u) * decay + ((system.forces / a["masses"][:, None]) @ u) * growth
        a["velocities"] = v @ u.T

    def drift(self, system, delta: float) -> None:
        a = system.atoms
        eigvals, u = self._eig()
        x = eigvals * delta / self._cell_mass(system.n_atoms)
        system.set_cell(((system.cell @ u) * np.exp(x)) @ u.T)
        u, scale, growth = self._on(a["positions"], u, np.exp(x), delta * exprel(x))
        a["positions"] = ((a["positions"] @ u) * scale + (a["velocities"] @ u) * growth) @ u.T

    def first_half(self, system, step: int) -> None:
        self._barostat_half(system)
        self.thermostat_half(system)
        self._kick_cell(system, system.kinetic_tensor(), 0.5 * self.dt)
        self.kick(system, 0.5 * self.dt)
        self.drift(system, self.dt)

    def second_half(self, system, step: int) -> None:
        self.kick(system, 0.5 * self.dt)
        self._kick_cell(system, system.kinetic_tensor(), 0.5 * self.dt)
        self.thermostat_half(system)
        self._barostat_half(system)

    def conserved_energy(self, system) -> float:
        dof, mass_dof = self._cell_chain()
        cell_kinetic = float(np.sum(self.p_cell**2)) / (2 * self._cell_mass(system.n_atoms))
        return (super().conserved_energy(system) + self.barostat.energy(dof, mass_dof) + cell_kinetic
                + self.pressure * abs(np.linalg.det(system.cell)))

    def state_dict(self) -> dict:
        return dict(super().state_dict(), **{"barostat.eta": self.barostat.eta, "barostat.p_eta": self.barostat.p_eta,
                                             "p_cell": self.p_cell})

    def _set(self, key, value):
        if key == "p_cell":
            if value.shape != self.p_cell.shape:
                raise ValueError(f"p_cell has shape {value.shape}, this barostat needs {self.p_cell.shape} "
                                 f"(isotropic={self.isotropic})")
            self.p_cell = value
        else:
            super()._set(key, value)


INTEGRATORS = {cls.__name__: cls for cls in (VelocityVerlet, Langevin, Bussi, NoseHoover, MTK)}
