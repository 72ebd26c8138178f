"""ASE dynamics with MLIPCalculator under mpiexec == the same dynamics on one process.

Every rank runs VelocityVerlet, Langevin and a BFGS relaxation with the distributed calculator, then
again with the serial backend (every rank, so that ASE's own collectives on its world stay matched);
final positions and velocities must agree to 1e-9 (float64: only summation order differs).
Run under mpiexec -n P.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ase import units  # noqa: E402
from ase.md.langevin import Langevin  # noqa: E402
from ase.md.velocitydistribution import thermalize_momenta  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402
from ase.optimize import BFGS  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
from md import MLIPCalculator  # noqa: E402
from comparison import compare  # noqa: E402
from systems import GEOMETRIES, schnet  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
model = schnet(torch.float64)


def run(kind, comm):
    atoms = GEOMETRIES["sheared"]()
    atoms.calc = MLIPCalculator(model, comm=comm)
    if kind == "bfgs":
        BFGS(atoms, logfile=None).run(fmax=1e-3, steps=15)
        return atoms.positions.copy(), atoms.get_potential_energy()
    thermalize_momenta(atoms, temperature_K=600, rng=np.random.default_rng(1))
    if kind == "verlet":
        dyn = VelocityVerlet(atoms, timestep=2 * units.fs)
    else:
        dyn = Langevin(atoms, timestep=2 * units.fs, temperature_K=600, friction=0.02,
                       rng=np.random.default_rng(2))
    dyn.run(25)
    return np.concatenate([atoms.positions, atoms.get_velocities()]), atoms.get_potential_energy()


failures = []
for kind in ("verlet", "langevin", "bfgs"):
    distributed, energy = run(kind, None)
    reference = run(kind, mlip_parallel.SerialBackend())
    c = compare(distributed, reference[0], 1e-9, scale="absolute")
    ce = compare(energy, reference[1], 1e-9 * abs(energy), scale="absolute")  # relative to the distributed energy
    if world.rank == 0:
        print(f"{kind:9s}: max |x_P - x_serial| = {c.error:.2e}, energy {energy:.8f} vs {reference[1]:.8f}", flush=True)
    if not c.ok:
        failures.append(c.message(f"{kind} positions and velocities"))
    if not ce.ok:
        failures.append(ce.message(f"{kind} energy"))
failures = sorted({f for mine in world.allgather(failures) for f in mine})  # every rank's verdict
if world.rank == 0:
    print(f"P={world.Get_size()}: ASE dynamics {len(failures)} failures")
sys.exit(1 if failures else 0)
