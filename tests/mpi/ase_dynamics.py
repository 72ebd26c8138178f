"""ASE dynamics with MLIPCalculator under mpiexec == the same dynamics on one process.

Every rank runs VelocityVerlet, Langevin, a BFGS and a FIRE relaxation, and FIRE on ASE's FrechetCellFilter (positions
and cell) with the distributed calculator, then again with the serial backend (every rank, so that ASE's own
collectives on its world stay matched); final positions, velocities and cells must agree to 1e-9 (float64: only
summation order differs). phonopy's frequencies of fcc Cu at X and L (cu-emt, 2×2×2 conventional cells) likewise, to
1e-9 THz.

ASE's NEB(parallel=True) as examples/neb_parallel.py runs it (a vacancy hop in copper, cu-emt; 2 images, each on
P / 2 ranks through its own communicator) == the same band relaxed in one process, every image in turn (1e-9). Ranks
that pass different structures to one evaluation end alike in RanksDisagreeError, naming the way out: the band with
every image's calculator on the whole world, and MD whose velocities each rank drew alone (the second call).
Run under mpiexec -n P, P even.
"""
import os
import sys
import warnings

warnings.filterwarnings("ignore")  # (ASE's and phonopy's deprecation notices: not this script's to read)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ase import units  # noqa: E402
from ase.md.langevin import Langevin  # noqa: E402
from ase.md.velocitydistribution import thermalize_momenta  # noqa: E402
from ase.mep import NEB  # noqa: E402
from ase.parallel import DummyMPI  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402
from ase.filters import FrechetCellFilter  # noqa: E402
from ase.optimize import BFGS, FIRE  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
import potentials  # noqa: E402
from md import MLIPCalculator  # noqa: E402
from mlip_parallel.errors import RanksDisagreeError  # noqa: E402
from comparison import compare  # noqa: E402
from systems import GEOMETRIES, phonon_frequencies, schnet  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from neb_parallel import band, band_energies, vacancy_hop, world_of  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
model = schnet(torch.float64)


def run(kind, comm):
    atoms = GEOMETRIES["sheared"]()
    atoms.calc = MLIPCalculator(model, comm=comm)
    if kind in ("bfgs", "fire", "fire-cell"):
        optimizer = BFGS if kind == "bfgs" else FIRE
        optimizer(FrechetCellFilter(atoms) if kind == "fire-cell" else atoms, logfile=None).run(fmax=1e-3, steps=15)
        return np.concatenate([atoms.positions, atoms.cell[:]]), atoms.get_potential_energy()
    thermalize_momenta(atoms, temperature_K=600, rng=np.random.default_rng(1))
    if kind == "verlet":
        dyn = VelocityVerlet(atoms, timestep=2 * units.fs)
    else:
        dyn = Langevin(atoms, timestep=2 * units.fs, temperature_K=600, friction=0.02,
                       rng=np.random.default_rng(2))
    dyn.run(25)
    return np.concatenate([atoms.positions, atoms.get_velocities()]), atoms.get_potential_energy()


failures = []
for kind in ("verlet", "langevin", "bfgs", "fire", "fire-cell"):
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


def cu_phonons(comm) -> np.ndarray:
    """phonopy on fcc Cu (cu-emt, float64; 2×2×2 conventional cells, one displacement): THz at X and L (Γ holds only
    fcc's three zero modes, which carry the square root of rounding, 1e-7)."""
    from ase.build import bulk

    return phonon_frequencies(bulk("Cu", "fcc", a=3.6, cubic=True), MLIPCalculator(cu_emt, comm=comm), "F")


cu_emt = potentials.load_model("cu-emt", checkpoint_dtype="float64")
distributed = cu_phonons(None)
c = compare(distributed, cu_phonons(mlip_parallel.SerialBackend()), 1e-9, scale="absolute")
if world.rank == 0:
    print(f"phonopy: highest frequency {distributed.max():.6f} THz; max |f_P - f_serial| = {c.error:.2e} THz",
          flush=True)
if not c.ok:
    failures.append(c.message("phonopy frequencies"))
if not distributed.max() > 5:  # THz: copper's highest branch is about 7
    failures.append(f"phonopy: highest frequency {distributed.max()} THz")


def disagreeing(label, call, *words) -> None:
    """``call()`` must raise RanksDisagreeError on this rank, its message holding ``words``."""
    try:
        call()
    except RanksDisagreeError as exc:
        if world.rank == 0:
            print(f"{label}: {exc}", flush=True)
        if not all(word in str(exc) for word in words):
            failures.append(f"{label}: the message names not {words}: {exc}")
    else:
        failures.append(f"{label}: no RanksDisagreeError on rank {world.rank}")


# NEB images in parallel, each image decomposed over its ranks (examples/neb_parallel.py) == one process
initial, final = vacancy_hop(cu_emt, cells=2, comm=world)
parallel = band(cu_emt, initial, final, 2, comm=world, steps=8)
serial = band(cu_emt, initial, final, 2, comm=None, steps=8)
c = compare({"positions": np.array([i.positions for i in parallel.images]), "energies": band_energies(parallel)},
            {"positions": np.array([i.positions for i in serial.images]), "energies": band_energies(serial)},
            1e-9, scale="absolute")
if world.rank == 0:
    print(f"NEB, 2 images x {world.size // 2} rank(s): barrier {max(band_energies(parallel)):.6f} eV, one process "
          f"{max(band_energies(serial)):.6f} eV; max difference (positions, energies) {c.error:.2e}", flush=True)
if not c.ok:
    failures.append(c.message("parallel NEB vs one process"))


def shared_world_band():  # every image's calculator on the whole world: the ranks pass different images
    images = [initial] + [initial.copy() for _ in range(2)] + [final]
    for image in images[1:-1]:
        image.calc = MLIPCalculator(cu_emt, comm=world)
    neb = NEB(images, parallel=True, world=world_of(world))
    neb.interpolate()
    neb.get_forces()


disagreeing("NEB(parallel=True), calculators on the whole world", shared_world_band, "positions",
            "comm=world.Split(image)")


def own_velocities():  # each rank draws its own velocities: the positions part after the first step
    atoms = GEOMETRIES["sheared"]()
    atoms.calc = MLIPCalculator(model)
    thermalize_momenta(atoms, temperature_K=600, rng=np.random.default_rng(world.rank), comm=DummyMPI())
    VelocityVerlet(atoms, timestep=2 * units.fs).run(2)


disagreeing("velocities drawn on each rank alone", own_velocities, "positions differ", "drawn alike")

failures = sorted({f for mine in world.allgather(failures) for f in mine})  # every rank's verdict
if world.rank == 0:
    print(f"P={world.Get_size()}: ASE dynamics {len(failures)} failures")
sys.exit(1 if failures else 0)
