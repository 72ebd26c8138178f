"""The long-range Coulomb term distributed == one process (run under mpiexec -n P, P > 1).

The born_coulomb family (NaCl's Fumi–Tosi parameters) on a sheared, rattled NaCl box of 96 ions, each solver (Ewald,
PME and P3M, each mesh replicated and distributed): ``mlip_parallel.evaluate`` on the automatic grid, P × 1 × 1 and
1 × 1 × P equals ``potentials.predict`` in one process (energy, per-atom energies, forces and stress to 1e-11
relative to their largest entry), on P ranks and, for the meshes, on every rank count from P − 1 down to 2 in the same
launch (sub-communicators); the same with a net charge of +1 e (one Cl removed: the neutralising background's total
charge is a sum over ranks), and for that box as a cluster (periodic in no direction: every pair summed, the atoms
gathered from every rank); a PaiNN with a charge head (P3M) on the charged box (both meshes) and cluster (its charges
shifted to the total over the ranks), and the parameter gradient of a force loss through the distributed mesh against
one process (a second derivative); 40 NVE steps of mlip-md's engine on P ranks equal the engine on one rank (thermo
to 1e-9 relative). With the sums over ranks left as each rank's own part (the structure factors or replicated mesh,
the total charge; the cluster's gathered atoms), or the distributed mesh's halo broken (tests/faults.py), the
comparison fails by orders of magnitude. Prints one line per case and "long range P=<ranks>: N failures".
"""
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ase.build import bulk  # noqa: E402
from ase.md.velocitydistribution import thermalize_momenta  # noqa: E402
from ase.parallel import DummyMPI  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
import mlip_parallel.comm as comm  # noqa: E402
from mlip_parallel.evaluate import Decomposition, forward_decomposed, ghost_reach  # noqa: E402
from potentials.graph import system_of  # noqa: E402
import potentials  # noqa: E402
import faults  # noqa: E402
from comparison import compare  # noqa: E402
from faults import MESH_FAULTS  # noqa: E402
from md.engine import MDSystem, run  # noqa: E402
from md.integrators import VelocityVerlet  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
FUMI_TOSI = {"Na-Na": [0.2637, 0.317, 2.340, 1.0486, -0.4993], "Na-Cl": [0.2110, 0.317, 2.755, 6.99055, -8.6758],
             "Cl-Cl": [0.1582, 0.317, 3.170, 72.40215, -145.4284]}
ACCURACY = {"ewald": 1e-7, "pme": 1e-5, "p3m": 1e-5}


def model(method, mesh="auto"):
    return potentials.load_model(("born_coulomb", {"charges": {"Na": 1.0, "Cl": -1.0}, "pairs": FUMI_TOSI,
                                                   "cutoff": 6.0}),
                                 long_range={"method": method, "accuracy": ACCURACY[method], "mesh": mesh})


def box(charged=False, cluster=False):
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat((3, 2, 2))
    atoms.set_cell(atoms.cell[:] + np.array([[0, 0, 0], [1.3, 0, 0], [0.6, -0.8, 0]]), scale_atoms=True)
    atoms.positions += np.random.default_rng(11).normal(0.0, 0.15, atoms.positions.shape)
    if charged:
        del atoms[int(np.flatnonzero(atoms.numbers == 17)[5])]
    atoms.pbc = not cluster
    return atoms


def results(result):
    return {k: result[k] for k in ("energy", "energies", "forces", "stress")}


def without_rank_sums(function, *args, **kwargs):
    """``function(*args, **kwargs)`` with each rank's sums over ranks left as its own part, and its gathers of every
    rank's atoms as its own atoms."""
    summed, gathered = comm.RankSum.__call__, comm.RankGather.__call__
    comm.RankSum.__call__, comm.RankGather.__call__ = (lambda self, x: x), (lambda self, x: (x, 0))
    try:
        return function(*args, **kwargs)
    finally:
        comm.RankSum.__call__, comm.RankGather.__call__ = summed, gathered


def mesh_fault(fault, function, *args, **kwargs):
    """``function(*args, **kwargs)`` with ``fault`` (one of ``MESH_FAULTS``) in the distributed mesh's halo."""
    with faults.mesh_fault(fault):
        return function(*args, **kwargs)


failures = []


def check(name, got, want, tolerance):
    c = compare(got, want, tolerance)
    if world.rank == 0:
        print(f"{'OK ' if c.ok else 'FAIL'} {name}: {c.error:.2e} (bound {tolerance:g})", flush=True)
    if not c.ok:
        failures.append(c.message(name))


def fault_caught(name, result, reference):
    c = compare(result, reference)
    if world.rank == 0:
        print(f"{'OK ' if c.error > 1e-3 else 'FAIL'} {name} differs: {c.error:.2e}", flush=True)
    if not c.error > 1e-3:
        failures.append(f"{name}: the fault went unnoticed ({c.error:.2e})")


size = world.size
# (ranks in this rank's group, the group): every rank count k from P down to 2 in this one launch, ranks 0..k−1
# together (the others in a group of their own, evaluating alike; rank 0 reports k)
GROUPS = [(group.Get_size(), group) for group in (world.Split(0 if world.rank < k else 1) for k in range(size, 1, -1))]
for method in ("ewald", "pme", "p3m"):
    for charged, cluster in ((False, False), (True, False)) + (((True, True),) if method == "ewald" else ()):
        atoms = box(charged, cluster)
        for mesh in ("replicated", "distributed") if method != "ewald" else ("auto",):
            m = model(method, mesh)
            reference = results(potentials.predict(m, atoms))
            what = (" charged cluster" if cluster else " charged" if charged else "") + \
                (f" {mesh} mesh" if mesh != "auto" else "")
            for ranks, group in GROUPS if method != "ewald" and not charged else GROUPS[:1]:
                for grid in (None, (ranks, 1, 1), (1, 1, ranks)) if not charged else (None,):
                    got = results(mlip_parallel.evaluate(m, atoms, grid=grid, comm=group))
                    check(f"{method}{what} {ranks} ranks grid {grid or 'auto'}", got, reference, 1e-11)
            if charged and not cluster:
                continue
            planted_faults = (("without the sums over ranks", without_rank_sums),) if mesh != "distributed" else \
                tuple((f"with the {fault}", functools.partial(mesh_fault, fault)) for fault in MESH_FAULTS)
            for fault, planted in planted_faults:
                fault_caught(f"{method}{what} {fault}", results(planted(mlip_parallel.evaluate, m, atoms)), reference)

# a mesh with fewer planes than ranks (a split given: 4 × 2 × 2 points), split over the ranks: some own no planes
coarse = potentials.load_model(("born_coulomb", {"charges": {"Na": 1.0, "Cl": -1.0}, "pairs": FUMI_TOSI,
                                                 "cutoff": 6.0}),
                               long_range={"method": "pme", "smearing": 2.0, "resolution": 30.0, "mesh": "distributed"})
reference = results(potentials.predict(coarse, box()))
for ranks, group in GROUPS:
    check(f"pme distributed 4 x 2 x 2 mesh {ranks} ranks", results(mlip_parallel.evaluate(coarse, box(), comm=group)),
          reference, 1e-11)
# the box's ions in half a cell twice as long: on a P × 1 × 1 grid the upper ranks own no atoms and their slabs no
# brick (the exchanges' backward must still run on every rank)
sparse = box()
sparse.set_cell(sparse.cell[:] * np.array([[2.0], [1.0], [1.0]]), scale_atoms=False)
reference = results(potentials.predict(model("p3m", "distributed"), sparse))
for ranks, group in GROUPS:
    check(f"p3m distributed, ions in half the cell, grid ({ranks}, 1, 1)",
          results(mlip_parallel.evaluate(model("p3m", "distributed"), sparse, grid=(ranks, 1, 1), comm=group)),
          reference, 1e-11)

# a PaiNN with a charge head (its charges shifted to each structure's total: a sum over ranks), charged box (both
# meshes) and cluster; and the parameter gradient of a force loss through the distributed mesh (training's second
# derivative: the slab FFT's transposes and the mesh halo differentiated twice) against one process
def painn(mesh="auto"):
    return potentials.PaiNN(["Na", "Cl"], cutoff=5.0, features=16, layers=2, charges=True, seed=0,
                            long_range={"method": "p3m", "accuracy": 1e-5, "mesh": mesh}).double()


def force_loss_gradient(model, atoms, backend):
    """d(Σ F² + E)/dθ of ``model``'s parameters, the structure decomposed over ``backend``'s ranks (summed over them)."""
    part = Decomposition(atoms, ghost_reach(model, "layerwise"), backend)
    energies, forces, _ = forward_decomposed(model, part, "layerwise", create_graph=True, system=system_of(atoms.info))
    grads = torch.autograd.grad((forces**2).sum() + energies.sum(), list(model.parameters()), allow_unused=True)
    flat = torch.cat([g.reshape(-1) if g is not None else p.new_zeros(p.numel())
                      for g, p in zip(grads, model.parameters())])
    return backend.allreduce(flat.detach().numpy())


for cluster, mesh in ((False, "replicated"), (False, "distributed"), (True, "auto")):
    atoms = box(charged=True, cluster=cluster)
    atoms.info["charge"] = 1
    charged_painn = painn(mesh)
    reference = results(potentials.predict(charged_painn, atoms))
    label = f"PaiNN with charges{' cluster' if cluster else f' {mesh} mesh'}"
    check(f"{label} grid auto", results(mlip_parallel.evaluate(charged_painn, atoms)), reference, 1e-11)
    fault_caught(f"{label} without the sums over ranks",
                 results(without_rank_sums(mlip_parallel.evaluate, charged_painn, atoms)), reference)
    if mesh == "distributed":
        serial = world.bcast(force_loss_gradient(charged_painn, atoms, mlip_parallel.SerialBackend())
                             if world.rank == 0 else None)
        backend = mlip_parallel.get_backend("mpi")
        check(f"{label}: d(force loss)/dθ", force_loss_gradient(charged_painn, atoms, backend), serial, 1e-10)
        fault_caught(f"{label}: d(force loss)/dθ with the {MESH_FAULTS[0]}",
                     mesh_fault(MESH_FAULTS[0], force_loss_gradient, charged_painn, atoms, backend), serial)

# mlip-md's engine, NVE: P ranks == one rank
COLUMNS = ("temperature_K", "epot_eV", "ekin_eV", "etot_eV", "pressure_GPa")


def simulate(start, backend):
    system = MDSystem.from_atoms(model("ewald"), start, skin=1.0, comm=backend)
    rows = run(system, VelocityVerlet(2.0), 40, thermo_every=10)
    return np.array([[row[c] for c in COLUMNS] for row in rows])


start = box()
thermalize_momenta(start, temperature_K=1200, rng=np.random.default_rng(5), comm=DummyMPI())
serial = world.bcast(simulate(start, mlip_parallel.SerialBackend()) if world.rank == 0 else None)
check("NVE 40 steps, thermo vs one rank", simulate(start, None), serial, 1e-9)
if world.rank == 0:
    print(f"long range P={size}: {len(failures)} failures {failures}", flush=True)
sys.exit(1 if failures else 0)
