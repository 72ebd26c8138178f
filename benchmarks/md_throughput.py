"""MD with SchNet on ~4,000 Cu atoms: step overhead (integration, communication, neighbour lists,
migration: everything but the force evaluation) as a fraction of the force evaluation (target ≤ 5 %),
and throughput in atom-steps/s on 2 ranks vs 1 rank (target ≥ 1.8×). One thread per rank; the
1-rank and 2-rank launches alternate.

    python benchmarks/md_throughput.py [--cells 10] [--steps 6] [--rounds 1]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, schnet_worker_setup  # noqa: E402


def worker(args):
    import numpy as np
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.parallel import DummyMPI

    from md.engine import MDSystem, run
    from md.integrators import Langevin

    backend, atoms, model = schnet_worker_setup(args.cells)
    thermalize_momenta(atoms, temperature_K=600, rng=np.random.default_rng(0), comm=DummyMPI())
    system = MDSystem.from_atoms(model, atoms, skin=0.5)
    force_seconds = [0.0]
    compute = system.compute_forces

    def timed_compute():
        t0 = time.perf_counter()
        compute()
        force_seconds[0] += time.perf_counter() - t0
    system.compute_forces = timed_compute
    system.compute_forces()
    force_seconds[0] = 0.0
    backend.barrier()
    t0 = time.perf_counter()
    run(system, Langevin(5.0, 600.0, 0.01, seed=1), args.steps, thermo_every=1)
    total = time.perf_counter() - t0
    overheads = backend.allgather((total - force_seconds[0]) / force_seconds[0])
    if backend.rank == 0:
        print(json.dumps({"n_atoms": len(atoms), "seconds_per_step": total / args.steps,
                          "overhead": max(overheads), "rebuilds": system.rebuilds}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=10, help="cubic fcc cells per direction (10 → 4,000 atoms)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    runs = alternate(__file__, ["--cells", args.cells, "--steps", args.steps], args.rounds)
    n = runs[1][0]["n_atoms"]
    t1 = statistics.median(r["seconds_per_step"] for r in runs[1])
    t2 = statistics.median(r["seconds_per_step"] for r in runs[2])
    print(f"Langevin MD, SchNet F=64 L=3 rc=5 A, {n} Cu atoms, skin 0.5 A, thermo every step, one thread per rank")
    for ranks, t in ((1, t1), (2, t2)):
        overhead = statistics.median(r["overhead"] for r in runs[ranks])
        rebuilds = runs[ranks][0]["rebuilds"]
        print(f"  {ranks} rank(s): {n / t:8.0f} atom-steps/s, step overhead {100 * overhead:.1f} % of the force time "
              f"({rebuilds} neighbour builds incl. the first)")
    print(f"throughput 2 vs 1 rank = {t1 / t2:.2f}x (target >= 1.8x); overhead target <= 5 %")


if __name__ == "__main__":
    main()
