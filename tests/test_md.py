"""Native MD engine on one process against independent oracles: ASE's VelocityVerlet with ASE's
LennardJones, energy conservation, and the counter-based random numbers."""
import numpy as np
import pytest
import torch
from ase import units
from ase.build import bulk
from ase.calculators.lj import LennardJones as AseLJ
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet

import potentials
from md.engine import Bussi, Langevin, MDSystem, VelocityVerlet, gaussian, run

torch.set_num_threads(1)
LJ = dict(epsilon=0.0104, sigma=3.4, cutoff=8.0)


def argon(temperature=300, seed=0):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(3)
    thermalize_momenta(atoms, temperature_K=temperature, rng=np.random.default_rng(seed))
    return atoms


def test_velocity_verlet_matches_ase():
    atoms = argon()
    reference = atoms.copy()
    reference.calc = AseLJ(epsilon=LJ["epsilon"], sigma=LJ["sigma"], rc=LJ["cutoff"], smooth=False)
    AseVelocityVerlet(reference, timestep=5 * units.fs).run(100)
    system = MDSystem.from_atoms(potentials.LennardJones(**LJ), atoms, skin=1.0)
    rows = run(system, VelocityVerlet(5.0), 100, thermo_every=100)
    unwrapped = system.gather("positions") + system.gather("image") @ atoms.cell[:]
    assert system.rebuilds > 2  # atoms moved past the skin: migration and rebuilds were exercised
    assert np.abs(unwrapped - reference.positions).max() < 1e-8
    assert np.abs(system.gather("velocities") - reference.get_velocities()).max() < 1e-8
    assert abs(rows[-1]["epot_eV"] - reference.get_potential_energy()) < 1e-9
    assert abs(rows[-1]["temperature_K"] - reference.get_temperature()) < 1e-6


def test_nve_energy_drift_is_bounded():
    system = MDSystem.from_atoms(potentials.LennardJones(**LJ), argon(120, seed=1), skin=1.0)
    rows = run(system, VelocityVerlet(4.0), 2000, thermo_every=50)
    etot = np.array([r["etot_eV"] for r in rows])
    ekin = np.array([r["ekin_eV"] for r in rows])
    assert np.abs(etot - etot[0]).max() < 0.01 * ekin.mean(), (np.abs(etot - etot[0]).max(), ekin.mean())


def test_gaussian_depends_only_on_seed_step_and_id():
    ids = np.arange(20000)
    z = gaussian(3, 17, ids)
    perm = np.random.default_rng(0).permutation(ids)
    assert np.array_equal(gaussian(3, 17, perm), z[perm])  # not on which rank, or in which order
    assert not np.array_equal(gaussian(3, 18, ids), z) and not np.array_equal(gaussian(4, 17, ids), z)
    assert abs(z.mean()) < 0.02 and abs(z.var() - 1) < 0.02


def test_langevin_holds_temperature():
    system = MDSystem.from_atoms(potentials.LennardJones(**LJ), argon(50, seed=2), skin=1.0)
    rows = run(system, Langevin(4.0, temperature_K=90.0, friction=0.02, seed=1), 600, thermo_every=5)
    temperatures = np.array([r["temperature_K"] for r in rows[len(rows) // 2:]])
    assert abs(temperatures.mean() - 90.0) < 0.08 * 90.0, temperatures.mean()


def test_bussi_holds_temperature():
    system = MDSystem.from_atoms(potentials.LennardJones(**LJ), argon(50, seed=3), skin=1.0)
    rows = run(system, Bussi(4.0, temperature_K=90.0, tau_fs=100.0, seed=2), 600, thermo_every=5)
    temperatures = np.array([r["temperature_K"] for r in rows[len(rows) // 2:]])
    assert abs(temperatures.mean() - 90.0) < 0.08 * 90.0, temperatures.mean()


def test_bad_md_input():
    with pytest.raises(ValueError, match="skin"):
        MDSystem.from_atoms(potentials.LennardJones(**LJ), argon(), skin=-1.0)


def test_exploding_dynamics_ends_the_run_with_a_message():
    atoms = argon(300)
    atoms.set_velocities(atoms.get_velocities() * 1e4)  # ~ 0.5 Å/fs × 1e4: crosses the box in one step
    system = MDSystem.from_atoms(potentials.LennardJones(**LJ), atoms, skin=1.0)
    with pytest.raises(potentials.InvalidStructureError, match="in one step"):
        run(system, VelocityVerlet(5.0), 10)
