"""Contracts of the four comm verbs (run under mpiexec -n P):

* wrapping: x = -1e-17 in a periodic cell is owned by the first subdomain along x, not lost between two;

* exchange: atoms scattered at random over ranks, some far outside the cell, end on the rank whose
  subdomain holds them, each exactly once, with their per-atom data;
* borders: the ghosts are exactly the atom images within r_ghost of the subdomain (brute force);
* reverse_comm is the adjoint of forward_comm: sum over ranks of <F x, y> == <x, R y>;
* the shared counter (``backend.counter()``): each value taken once over the ranks, and a busy rank 0 does not hold
  the others up;
* bind_to_cores: ranks × threads filling the CPUs pins each rank (every thread of it) to CPUs of its own;
  a job leaving CPUs free or oversubscribing them, one its launcher bound, and one that opted out stay as
  they are.
"""
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
from comparison import compare  # noqa: E402
from systems import GEOMETRIES  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
rank, P = world.Get_rank(), world.Get_size()
backend = mlip_parallel.get_backend()
failures = []


def check(condition, message):
    if not condition:
        failures.append(message)


# ---- exchange: random scatter → every atom on its owner, ids conserved, data moved along
for name in ("fcc_bulk", "sheared", "slab", "clusters"):
    atoms = GEOMETRIES[name]()
    n = len(atoms)
    rng = np.random.default_rng(42)
    shifts = rng.integers(-2, 3, size=(n, 3)) * atoms.pbc  # whole-cell moves along periodic dims only
    unwrapped = atoms.positions + shifts @ atoms.cell[:]
    start_rank = rng.integers(0, P, size=n)
    mine = np.flatnonzero(start_rank == rank)
    domain = mlip_parallel.Domain.from_positions(atoms.positions[mine], atoms.cell, atoms.pbc, backend)
    grid = mlip_parallel.Grid.for_ranks(P, domain)
    comm = mlip_parallel.Comm(backend, grid, domain)
    moved = comm.exchange({"positions": unwrapped[mine], "ids": mine, "image": np.zeros((len(mine), 3), int),
                           "tag": np.sin(mine.astype(float))[:, None] * [1.0, 2.0]})
    owner = grid.owner(domain.wrapped_fractional(moved["positions"]))
    check(np.all(owner == rank), f"exchange {name}: {np.sum(owner != rank)} atoms on the wrong rank")
    all_ids = np.concatenate(world.allgather(moved["ids"]))
    check(np.array_equal(np.sort(all_ids), np.arange(n)), f"exchange {name}: ids not conserved")
    # over every rank's atoms (a rank may hold none): the data moved along bit for bit, the image flags to 1e-9 A
    tags = np.concatenate(world.allgather(moved["tag"].reshape(-1, 2)))
    c = compare(tags, np.sin(all_ids.astype(float))[:, None] * [1.0, 2.0], 0.0, scale="absolute")
    check(c.ok, c.message(f"exchange {name}: per-atom data did not move with the atoms"))
    back = np.concatenate(world.allgather((moved["positions"] + moved["image"] @ domain.cell).reshape(-1, 3)))
    c = compare(back, unwrapped[all_ids], 1e-9, scale="absolute")
    check(c.ok, c.message(f"exchange {name}: image flags wrong"))

# ---- an atom a rounding error below a periodic face (x = -1e-17) belongs to the first subdomain (LAMMPS's
# remap: 0 <= s < 1), once; one just below the upper face to the last
cell = np.diag([10.0, 10.0, 10.0])
positions = np.array([[-1e-17, 5.0, 5.0], [3.3, 5.0, 5.0], [9.999999999999998, 1.0, 1.0], [6.5, 2.0, 2.0]])
mine = np.arange(len(positions)) if rank == 0 else np.arange(0)
domain = mlip_parallel.Domain.from_positions(positions[mine], cell, True, backend)
grid = mlip_parallel.Grid.for_ranks(P, domain, (P, 1, 1))
moved = mlip_parallel.Comm(backend, grid, domain).exchange({"positions": positions[mine], "ids": mine})
frac = domain.wrapped_fractional(moved["positions"])
check(np.all((frac >= grid.bounds(rank)[0]) & (frac < grid.bounds(rank)[1])),
      f"wrap: rank {rank} holds atoms {moved['ids'].tolist()} at fractional {frac[:, 0].tolist()}, outside "
      f"its subdomain {grid.bounds(rank)[0][0]:.3f}..{grid.bounds(rank)[1][0]:.3f}")
check(sorted(np.concatenate(world.allgather(moved["ids"])).tolist()) == [0, 1, 2, 3], "wrap: ids not conserved")

# ---- borders: ghost images == brute-force images within the ghost shell
for name, r_ghost in itertools.product(("fcc_bulk", "hcp_triclinic", "slab", "clusters", "small_cell"), (4.0, 9.0)):
    atoms = GEOMETRIES[name]()
    part = mlip_parallel.Decomposition(atoms, r_ghost, backend)
    domain, comm = part.domain, part.comm
    lo, hi = part.grid.bounds(rank)
    cut = domain.fractional_distance(r_ghost)
    wrapped, _ = domain.wrap(atoms.positions)
    frac = domain.fractional(wrapped)
    reach = [int(np.ceil(cut[d])) + 1 if domain.pbc[d] else 0 for d in range(3)]
    expected, allowed = set(), set()
    for image in itertools.product(*[range(-k, k + 1) for k in reach]):
        s = frac + np.array(image)
        inside = np.all((s >= lo - cut + 1e-9) & (s < hi + cut - 1e-9), axis=1)
        owned_here = np.all(np.array(image) == 0) & np.all((s >= lo) & (s < hi), axis=1)
        expected |= {(int(i),) + image for i in np.flatnonzero(inside & ~owned_here)}
        near = np.all((s >= lo - cut - 1e-6) & (s < hi + cut + 1e-6), axis=1)
        allowed |= {(int(i),) + image for i in np.flatnonzero(near & ~owned_here)}
    got = {(int(i),) + tuple(int(v) for v in im) for i, im in zip(comm.ghost_ids, comm.ghost_image, strict=True)}
    check(len(got) == comm.n_ghost, f"borders {name} r={r_ghost}: duplicate ghosts")
    missing = expected - got
    check(got <= allowed, f"borders {name} r={r_ghost}: {len(got - allowed)} ghosts outside the shell")
    check(not missing, f"borders {name} r={r_ghost}: {len(missing)} ghost images missing, e.g. {sorted(missing)[:3]}")

    # ---- adjoint: <forward(x), y> summed over ranks == <x, reverse(y)> summed over ranks
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(comm.n_local, 5, generator=g, dtype=torch.float64)
    y = torch.randn(comm.n_ghost, 5, generator=g, dtype=torch.float64)
    lhs = backend.allreduce(float((comm.forward_comm(x) * y).sum()))
    rhs = backend.allreduce(float((x * comm.reverse_comm(y)).sum()))
    c = compare(rhs, lhs, 1e-12 * np.maximum(1.0, abs(lhs)), scale="absolute")  # relative to |lhs|, at least 1
    check(c.ok, c.message(f"adjoint {name}: {lhs} != {rhs}"))

# ---- core binding (all ranks on this host; affinity restored between cases)
from mlip_parallel.backend import bind_to_cores  # noqa: E402

cpus = sorted(os.sched_getaffinity(0))


def masks():
    """The CPU set of each thread of this process."""
    return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}


fits = len(cpus) // P if len(cpus) % P == 0 else None  # threads per rank that fill the CPUs exactly
for threads in sorted({1, 2, len(cpus)} - {fits}):
    check(bind_to_cores(backend, threads) is None and sorted(os.sched_getaffinity(0)) == cpus,
          f"bind: {P} ranks x {threads} threads on {len(cpus)} CPUs were pinned")
if len(cpus) > 1:
    os.sched_setaffinity(0, [cpus[rank % len(cpus)]])  # as a launcher binding each rank would
    check(bind_to_cores(backend, fits or 1) is None and sorted(os.sched_getaffinity(0)) == [cpus[rank % len(cpus)]],
          "bind: a rank the launcher had bound was re-pinned")
    os.sched_setaffinity(0, cpus)
if fits:
    os.environ["MLIP_PARALLEL_BIND_CORES"] = "0"
    check(bind_to_cores(backend, fits) is None and sorted(os.sched_getaffinity(0)) == cpus,
          "bind: pinned under MLIP_PARALLEL_BIND_CORES=0")
    del os.environ["MLIP_PARALLEL_BIND_CORES"]
    mine = bind_to_cores(backend, fits)
    check(mine is not None and len(mine) == fits and all(m == mine for m in masks().values()),
          f"bind: {P} ranks x {fits} threads on {len(cpus)} CPUs: this rank's threads on {masks()}, returned {mine}")
    every = world.allgather(mine or [])
    check(sorted(c for m in every for c in m) == cpus, f"bind: the ranks' CPUs {every} are not a partition of {cpus}")

# ---- the shared counter: every value taken exactly once over the ranks, rank 0 slowed (it serves the counter from a
# thread of its own: the others are not held up while it computes)
counter = backend.counter()
taken = []
while (k := counter.add(1)) < 60:
    taken.append(k)
    if rank == 0:
        time.sleep(0.02)
every = world.allgather(taken)
check(sorted(k for t in every for k in t) == list(range(60)), f"counter: values taken {every}")
check(P == 1 or len(every[0]) < 60 // P, f"counter: rank 0, slowed, took {len(every[0])} of 60 over {P} ranks")
counter.free()

failures = world.allgather(failures)
if rank == 0:
    flat = [f for fs in failures for f in fs]
    print(f"P={P}: comm contracts, {len(flat)} failures")
    for f in flat:
        print("FAIL", f)
sys.exit(1 if any(failures) else 0)
