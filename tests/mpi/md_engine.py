"""Native distributed MD (run under mpiexec -n P):

* NVE, Langevin and Bussi, Lennard-Jones argon, float64, 200 steps: the thermo columns on P ranks equal the
  serial run (computed on rank 0 with the serial backend) to 1e-8 relative;
* restart: 100 + 100 steps == 200 steps;
* a hot, dilute Lennard-Jones gas (atoms cross subdomains many times): atom count and the set of ids
  conserved at every rebuild and at the end.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ase.build import bulk  # noqa: E402
from ase.parallel import DummyMPI  # noqa: E402
from ase.md.velocitydistribution import thermalize_momenta  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
import potentials  # noqa: E402
from md.engine import Bussi, Langevin, MDSystem, VelocityVerlet, run  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
GAS_STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
model = potentials.LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.0)
COLUMNS = ("temperature_K", "epot_eV", "ekin_eV", "etot_eV", "pressure_GPa")


def argon(temperature):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((4, 3, 3))
    atoms.rattle(0.02, seed=3)
    thermalize_momenta(atoms, temperature_K=temperature, rng=np.random.default_rng(4), comm=DummyMPI())
    return atoms


def simulate(integrator, comm):
    system = MDSystem.from_atoms(model, argon(120), skin=1.0, comm=comm)
    rows = run(system, integrator, 200, thermo_every=20)
    return np.array([[row[c] for c in COLUMNS] for row in rows]), system.rebuilds


failures = []
for name, make in (("NVE", lambda: VelocityVerlet(4.0)), ("Langevin", lambda: Langevin(4.0, 150.0, 0.01, seed=7)),
                   ("Bussi", lambda: Bussi(4.0, 150.0, 100.0, seed=8))):
    table, rebuilds = simulate(make(), None)
    reference = world.bcast(simulate(make(), mlip_parallel.SerialBackend())[0] if world.rank == 0 else None)
    err = float(np.max(np.abs(table - reference) / np.maximum(np.abs(reference), 1e-12)))
    if world.rank == 0:
        print(f"{name:9s}: {rebuilds} rebuilds, max rel diff of thermo vs serial {err:.2e}, "
              f"T {table[0, 0]:.1f} -> {table[-1, 0]:.1f} K, etot drift {table[-1, 3] - table[0, 3]:+.2e} eV", flush=True)
    if err > 1e-8:
        failures.append(name)

# restart: 100 steps + save + load + 100 steps == 200 steps (Langevin: the noise must continue too)
straight = MDSystem.from_atoms(model, argon(120), skin=1.0)
run(straight, Langevin(4.0, 150.0, 0.01, seed=9), 200, thermo_every=200)
first = MDSystem.from_atoms(model, argon(120), skin=1.0)
run(first, Langevin(4.0, 150.0, 0.01, seed=9), 100, thermo_every=100)
path = world.bcast(os.path.join(tempfile.mkdtemp(), "restart.npz") if world.rank == 0 else None)
first.save_restart(path, 100)
resumed, step = MDSystem.from_restart(model, path, skin=1.0)
rows = run(resumed, Langevin(4.0, 150.0, 0.01, seed=9), 100, thermo_every=100, start_step=step)


def unwrapped(system):
    return system.gather("positions") + system.gather("image") @ system.cell


diff = max(float(np.abs(unwrapped(resumed) - unwrapped(straight)).max()),
           float(np.abs(resumed.gather("velocities") - straight.gather("velocities")).max()))
if world.rank == 0:
    print(f"restart: 100 + 100 steps vs 200 steps, max |diff| of positions/velocities {diff:.2e}", flush=True)
if diff > 1e-10 or rows[-1]["step"] != 200:
    failures.append("restart")

# hot dilute gas: many crossings of subdomain boundaries
gas = bulk("Ar", "fcc", a=9.0, cubic=True).repeat(3)
thermalize_momenta(gas, temperature_K=3000, rng=np.random.default_rng(5), comm=DummyMPI())
system = MDSystem.from_atoms(model, gas, skin=1.5)
run(system, VelocityVerlet(4.0), GAS_STEPS, thermo_every=GAS_STEPS)
ids = np.sort(np.concatenate(world.allgather(system.atoms["ids"])))
unwrapped = system.gather("positions") + system.gather("image") @ gas.cell[:]
travelled = float(np.abs(unwrapped - gas.positions).max())
if world.rank == 0:
    print(f"gas: {GAS_STEPS} steps, {system.rebuilds} rebuilds, farthest travel {travelled:.1f} A "
          f"(cell {gas.cell[0, 0]:.0f} A), ids conserved: {np.array_equal(ids, np.arange(len(gas)))}", flush=True)
if not np.array_equal(ids, np.arange(len(gas))):
    failures.append("gas ids")
failures = world.allgather(failures)[0]
if world.rank == 0:
    print(f"P={world.Get_size()}: MD engine {len(failures)} failures")
sys.exit(1 if failures else 0)
