"""AIMNet2 (potentials.adapters.aimnet, random weights from aimnet's own config, float64) distributed == one process
(run under mpiexec -n P, P > 1).

A periodic box of 8 water molecules (sheared cell) with Ewald and P3M (its mesh split over the ranks), and a molecule
pair (benzene and ethanol, no cell: every Coulomb pair), each neutral and with a total charge of +1 e:
``mlip_parallel.evaluate`` on P ranks (the automatic grid and P × 1 × 1), and on ranks 0 and 1 alone (2 ranks),
equals ``potentials.predict`` in one process (energy, per-atom energies, forces and stress to 1e-11 of their largest
entry). The halo's faults (tests/faults.py: stale or zeroed ghost features and charges, ghost gradients not sent
home), the charge equilibration's and Coulomb's sums left as each rank's own part, and the mesh's halo broken must
each fail that comparison by orders of magnitude. Prints one line per case and "aimnet P=<ranks>: N failures".

    aimnet_models.py [JOBS.json]      JOBS.json: mlip-train configs to run after (one launch pays aimnet's import once)
"""
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(os.path.dirname(__file__), "..")]
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
import mlip_parallel.comm as comm  # noqa: E402
import potentials  # noqa: E402
from comparison import compare  # noqa: E402
from faults import MESH_FAULTS, caught, mesh_fault, tally  # noqa: E402
from systems import benzene_and_ethanol as molecules, water_box  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD


class WithoutRankSums:
    """Each rank's sums and gathers over ranks left as its own part (the NSE's totals, the Coulomb's sums)."""

    def __enter__(self):
        self.saved = comm.RankSum.__call__, comm.RankGather.__call__
        comm.RankSum.__call__, comm.RankGather.__call__ = (lambda self, x: x), (lambda self, x: (x, 0))

    def __exit__(self, *exc):
        comm.RankSum.__call__, comm.RankGather.__call__ = self.saved


KEYS = ("energy", "energies", "forces", "stress")
pairs = world.Split(world.rank // 2)  # ranks 0 and 1 together (P = 2), the others in pairs or alone
failures = []
for name, atoms, method in (("water box", water_box(), "ewald"), ("water box", water_box(), "p3m"),
                            ("molecules", molecules(), "ewald")):
    mesh = "distributed" if method == "p3m" else "auto"  # (the replicated mesh: tests/mpi/long_range.py)
    model = potentials.load_model("aimnet:aimnet2", dtype="float64", weights_seed=3,
                                  long_range={"method": method, "accuracy": 1e-6, "mesh": mesh})
    for charge in (0, 1):
        atoms.info["charge"] = charge
        reference = potentials.predict(model, atoms)
        reference = {k: reference[k] for k in KEYS if k in reference}
        label = f"{name}, {method if atoms.pbc.any() else 'every pair'}, charge {charge}"
        for ranks, group, grid in ((world.size, world, None), (world.size, world, (world.size, 1, 1)),
                                   (min(world.size, 2), pairs, None)):
            got = mlip_parallel.evaluate(model, atoms, grid=grid, comm=group)
            c = compare({k: got[k] for k in reference}, reference, 1e-11)
            if world.rank == 0:
                print(f"{'OK ' if c.ok else 'FAIL'} {label}, {ranks} ranks, grid {grid or 'auto'}: {c.error:.2e}",
                      flush=True)
            if not c.ok:
                failures.append(c.message(f"{label} {ranks} ranks grid {grid}"))
        if charge == 1 and method != "p3m":
            def run():
                return mlip_parallel.evaluate(model, atoms)
            failures += caught(world, label, run, reference, 1e-11)
            with WithoutRankSums():
                faulty = run()
            c = compare({k: faulty[k] for k in reference}, reference)
            ok = c.beyond(1e-8)
            if world.rank == 0:
                print(f"fault {'caught' if ok else 'MISSED'}: {label}, sums over ranks left out: {c.error:.1e}",
                      flush=True)
            if not ok:
                failures.append(f"{label}: the sums over ranks left out went unnoticed")
        if charge == 1 and method == "p3m":  # the mesh split over the ranks, its halo broken
            for fault in MESH_FAULTS:
                with mesh_fault(fault):
                    faulty = mlip_parallel.evaluate(model, atoms)
                c = compare({k: faulty[k] for k in reference}, reference)
                ok = c.beyond(1e-8)
                if world.rank == 0:
                    print(f"fault {'caught' if ok else 'MISSED'}: {label}, the {fault}: {c.error:.1e}", flush=True)
                if not ok:
                    failures.append(f"{label}: the {fault} went unnoticed")
if world.rank == 0:
    print(f"aimnet P={world.size}: {len(failures)} failures {failures}; {tally()}", flush=True)
if len(sys.argv) > 1:  # mlip-train configs to run in this launch too (tests/test_aimnet.py: data and graph parallel)
    import json

    from mlip_parallel.config import read_config
    from mlip_parallel.train.cli import RULES, SCHEMA, train, validate

    with open(sys.argv[1]) as f:
        configs = json.load(f)
    for path in configs:
        train(validate(read_config(path), SCHEMA, RULES))
    if world.rank == 0:
        print(f"aimnet training runs done {len(configs)}", flush=True)
sys.exit(1 if failures else 0)
