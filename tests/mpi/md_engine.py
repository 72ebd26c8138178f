"""Native distributed MD (run under mpiexec -n P):

* NVE, Langevin, Bussi, Nosé–Hoover chain and MTK NPT (isotropic and anisotropic), Lennard-Jones argon,
  float64, 100 steps of 4 fs: the thermo columns on P ranks equal the serial run (computed on rank 0 with the
  serial backend) to 1e-8 relative;
* load balance: a droplet in a large periodic box, cut planes rebalanced every 20 steps: ranks own
  similar atom counts, and the thermo columns still equal serial;
* restart: 50 + 50 steps == 100 steps (Langevin; and MTK with balanced planes, whose barostat and
  thermostat variables and cut planes go through the restart file);
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
from comparison import compare  # noqa: E402
from md.engine import MDSystem, run  # noqa: E402
from md.integrators import MTK, Bussi, Langevin, NoseHoover, VelocityVerlet  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
ARGS = dict(zip(sys.argv[1::2], sys.argv[2::2]))  # --gas-steps N (0: skip), --restarts 0/1, --ensembles all/short
GAS_STEPS, RESTARTS = int(ARGS.get("--gas-steps", 2000)), ARGS.get("--restarts", "1") == "1"
model = potentials.LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.0)
COLUMNS = ("temperature_K", "epot_eV", "ekin_eV", "etot_eV", "pressure_GPa")


def argon(temperature):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((4, 3, 3))
    atoms.rattle(0.02, seed=3)
    thermalize_momenta(atoms, temperature_K=temperature, rng=np.random.default_rng(4), comm=DummyMPI())
    return atoms


COLUMNS += ("volume_A3",)


def simulate(integrator, comm, atoms=None, steps=100, **balance):
    system = MDSystem.from_atoms(model, argon(120) if atoms is None else atoms, skin=1.0, comm=comm,
                                 balance=bool(balance))
    rows = run(system, integrator, steps, thermo_every=10, **balance)
    return np.array([[row[c] for c in COLUMNS] for row in rows]), system


failures = []
CASES = [("NVE", lambda: VelocityVerlet(4.0), {}),
         ("Langevin", lambda: Langevin(4.0, 150.0, 0.01, seed=7), {}),
         ("Bussi", lambda: Bussi(4.0, 150.0, 100.0, seed=8), {}),
         ("Nose-Hoover", lambda: NoseHoover(4.0, 150.0, 100.0), {}),
         ("MTK isotropic", lambda: MTK(4.0, 150.0, 0.1, 100.0, 300.0), {}),
         ("MTK anisotropic", lambda: MTK(4.0, 150.0, 0.1, 100.0, 300.0, isotropic=False), {})]
if ARGS.get("--ensembles") == "short":  # NVE, Langevin (per-atom noise) and full-cell NPT only
    CASES = [CASES[0], CASES[1], CASES[5]]
# load balance: a droplet off-centre in a periodic box, cut planes rebalanced every 20 steps
droplet = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(4)
droplet = droplet[np.linalg.norm(droplet.positions - droplet.positions.mean(axis=0), axis=1) < 9.0]
droplet.set_cell([40.0, 36.0, 34.0])
droplet.pbc = True
droplet.positions += [4.0, 3.0, 2.0]
thermalize_momenta(droplet, temperature_K=60, rng=np.random.default_rng(6), comm=DummyMPI())
CASES.append(("balanced drop", lambda: Langevin(4.0, 60.0, 0.01, seed=3),
              dict(atoms=droplet, steps=100, balance_every=20)))

# serial references, spread over the ranks (no rank idles while another works), then the P-rank runs
serial = mlip_parallel.SerialBackend()
mine = {k: simulate(make(), serial, **kw)[0] for k, (_, make, kw) in enumerate(CASES) if k % world.size == world.rank}
references = {k: t for part in world.allgather(mine) for k, t in part.items()}
for k, (name, make, kwargs) in enumerate(CASES):
    table, system = simulate(make(), None, **kwargs)
    c = compare(table, references[k], 1e-8, scale="each")
    err = c.error
    if world.rank == 0:
        print(f"{name:15s}: {system.rebuilds} rebuilds, max rel diff of thermo vs serial {err:.2e}, "
              f"T {table[0, 0]:.1f} -> {table[-1, 0]:.1f} K, V {table[0, -1]:.0f} -> {table[-1, -1]:.0f} A^3",
              flush=True)
    if not c.ok:
        failures.append(c.message(f"{name} thermo vs serial"))

balanced = np.array(world.allgather(len(system.atoms["ids"])))  # the last case: the droplet
plain = np.array(world.allgather(len(MDSystem.from_atoms(model, droplet, skin=1.0).atoms["ids"])))
if world.rank == 0:
    print(f"droplet of {len(droplet)} atoms, atoms per rank: uniform planes {plain.tolist()}, "
          f"balanced {balanced.tolist()}", flush=True)
if balanced.max() > 1.25 * len(droplet) / world.size or balanced.max() >= plain.max():
    failures.append("balance")


def unwrapped(system):
    return system.gather("positions") + system.gather("image") @ system.cell


def check_restarts():
    """Exact continuation through restart files."""
    # 50 steps + save + load + 50 steps == 100 steps (Langevin: the noise must continue too)
    straight = MDSystem.from_atoms(model, argon(120), skin=1.0)
    run(straight, Langevin(4.0, 150.0, 0.01, seed=9), 100, thermo_every=100)
    first = MDSystem.from_atoms(model, argon(120), skin=1.0)
    run(first, Langevin(4.0, 150.0, 0.01, seed=9), 50, thermo_every=50)
    path = world.bcast(os.path.join(tempfile.mkdtemp(), "restart.npz") if world.rank == 0 else None)
    first.save_restart(path, 50)
    resumed, step = MDSystem.from_restart(model, path, skin=1.0)
    rows = run(resumed, Langevin(4.0, 150.0, 0.01, seed=9), 50, thermo_every=50, start_step=step)
    c = compare({"positions": unwrapped(resumed), "velocities": resumed.gather("velocities")},
                {"positions": unwrapped(straight), "velocities": straight.gather("velocities")},
                1e-10, scale="absolute")
    if world.rank == 0:
        print(f"restart: 50 + 50 steps vs 100 steps, max |diff| of positions/velocities {c.error:.2e}", flush=True)
    if not c.ok:
        failures.append(c.message("restart"))
    if rows[-1]["step"] != 100:
        failures.append(f"restart: ended at step {rows[-1]['step']}, not 100")

    # restart with barostat state and balanced cut planes
    def npt():
        return MTK(4.0, 150.0, 0.1, 100.0, 300.0, isotropic=False)

    straight = MDSystem.from_atoms(model, argon(120), skin=1.0, balance=True)
    run(straight, npt(), 100, thermo_every=100, balance_every=25)
    first = MDSystem.from_atoms(model, argon(120), skin=1.0, balance=True)
    integrator = npt()
    run(first, integrator, 50, thermo_every=50, balance_every=25)
    first.save_restart(path, 50, integrator)
    integrator = npt()
    resumed, step = MDSystem.from_restart(model, path, integrator=integrator, skin=1.0)
    run(resumed, integrator, 50, thermo_every=50, start_step=step, balance_every=25)
    c = compare({"positions": unwrapped(resumed), "velocities": resumed.gather("velocities"), "cell": resumed.cell},
                {"positions": unwrapped(straight), "velocities": straight.gather("velocities"), "cell": straight.cell},
                1e-10, scale="absolute")
    if world.rank == 0:
        print(f"NPT restart: 50 + 50 steps vs 100 steps, max |diff| of positions/velocities/cell {c.error:.2e}",
              flush=True)
    if not c.ok:
        failures.append(c.message("NPT restart"))


def check_gas(steps):
    """A hot dilute gas: atoms cross subdomains many times (the count is checked at every rebuild)."""
    gas = bulk("Ar", "fcc", a=9.0, cubic=True).repeat(3)
    thermalize_momenta(gas, temperature_K=3000, rng=np.random.default_rng(5), comm=DummyMPI())
    system = MDSystem.from_atoms(model, gas, skin=1.5)
    run(system, VelocityVerlet(4.0), steps, thermo_every=steps)
    ids = np.sort(np.concatenate(world.allgather(system.atoms["ids"])))
    unwrapped = system.gather("positions") + system.gather("image") @ gas.cell[:]
    travelled = float(np.abs(unwrapped - gas.positions).max())
    if world.rank == 0:
        print(f"gas: {steps} steps, {system.rebuilds} rebuilds, farthest travel {travelled:.1f} A "
              f"(cell {gas.cell[0, 0]:.0f} A), ids conserved: {np.array_equal(ids, np.arange(len(gas)))}", flush=True)
    if not np.array_equal(ids, np.arange(len(gas))):
        failures.append("gas ids")


if RESTARTS:
    check_restarts()
if GAS_STEPS:
    check_gas(GAS_STEPS)
failures = sorted({f for mine in world.allgather(failures) for f in mine})  # every rank's verdict
if world.rank == 0:
    print(f"P={world.Get_size()}: MD engine {len(failures)} failures")
sys.exit(1 if failures else 0)
