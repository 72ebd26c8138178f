"""Strong scaling: the same SchNet evaluation on 2 ranks vs 1 rank (one thread each).

Launches ``mpiexec -n 1`` and ``mpiexec -n 2`` of this script in worker mode, alternating, and prints
the median wall time per evaluation, the speed-up (target ≥ 1.85×) and the share of the 2-rank time
spent in communication calls (target ≤ 5 %): on the slowest rank (the exchanges themselves) and on the
fastest (waiting for the slower rank included).

    python benchmarks/strong_scaling.py [--cells 10] [--repeat 5] [--rounds 2]
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
    import mlip_parallel

    backend, atoms, model = schnet_worker_setup(args.cells, args.features, args.cutoff)
    mlip_parallel.evaluate(model, atoms, mode=args.mode)  # warm-up
    times, comm = [], []
    for _ in range(args.repeat):
        backend.barrier()
        c0, t0 = backend.comm_seconds, time.perf_counter()
        mlip_parallel.evaluate(model, atoms, mode=args.mode)
        times.append(time.perf_counter() - t0)
        comm.append(backend.comm_seconds - c0)
    # The rank that finishes its compute last never waits: its communication time is the cost of the
    # exchanges themselves; the other ranks' extra is waiting for it (load imbalance, machine noise).
    fractions = backend.allgather(statistics.median(c / t for c, t in zip(comm, times)))
    if backend.rank == 0:
        print(json.dumps({"n_atoms": len(atoms), "time": statistics.median(times),
                          "comm_min": min(fractions), "comm_max": max(fractions)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=10, help="cubic fcc cells per direction (10 → 4,000 atoms)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternating 1-rank/2-rank launches")
    parser.add_argument("--mode", default="layerwise")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--cutoff", type=float, default=5.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    runs = alternate(__file__, ["--cells", args.cells, "--repeat", args.repeat, "--mode", args.mode,
                                "--features", args.features, "--cutoff", args.cutoff], args.rounds)
    t1 = statistics.median(r["time"] for r in runs[1])
    t2 = statistics.median(r["time"] for r in runs[2])
    comm_min = statistics.median(r["comm_min"] for r in runs[2])
    comm_max = statistics.median(r["comm_max"] for r in runs[2])
    print(f"SchNet F={args.features} L=3 rc={args.cutoff} {args.mode}, {runs[1][0]['n_atoms']} atoms, one thread per rank")
    print(f"  1 rank : {t1 * 1e3:8.1f} ms per evaluation")
    print(f"  2 ranks: {t2 * 1e3:8.1f} ms per evaluation")
    print(f"speed-up 2 vs 1 rank = {t1 / t2:.2f}x (target >= 1.85x)")
    print(f"time in communication calls on 2 ranks: {100 * comm_min:.1f} % on the slowest rank (the exchanges "
          f"themselves; target <= 5 %), {100 * comm_max:.1f} % on the fastest (waiting for the other included)")


if __name__ == "__main__":
    main()
