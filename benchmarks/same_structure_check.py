"""What the check that every rank passes the same structure costs each ``evaluate`` call (``MLIPCalculator``):
its CRC-32s of the structure and its one all-reduce of 12 numbers (``mlip_parallel.evaluate.check_same_structure``),
against the whole call with the check (SchNet F=64, 3 layers, 5 Å, float32, rattled fcc Cu), on 2 ranks, medians
of repeated calls measured side by side in one run.

    python benchmarks/same_structure_check.py [--cells 2 4 8] [--ranks 2] [--repeat 20]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch, schnet_worker_setup  # noqa: E402


def worker(args):
    import json

    import mlip_parallel
    from mlip_parallel.evaluate import check_same_structure

    backend, atoms, model = schnet_worker_setup(args.cells)
    mlip_parallel.evaluate(model, atoms, comm=backend)  # warm-up (allocations)
    checks, calls = [], []
    for _ in range(args.repeat):
        backend.barrier()
        start = time.perf_counter()
        check_same_structure(backend, atoms)
        checks.append(time.perf_counter() - start)
        backend.barrier()
        start = time.perf_counter()
        mlip_parallel.evaluate(model, atoms, comm=backend)
        calls.append(time.perf_counter() - start)
    if backend.rank == 0:
        print(json.dumps({"atoms": len(atoms), "check": statistics.median(checks),
                          "call": statistics.median(calls)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[2, 4, 8], help="fcc cubic cells per direction")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.worker:
        args.cells = args.cells[0]
        return worker(args)
    print(f"{'atoms':>7s} {'check (ms)':>11s} {'call (ms)':>10s} {'check / call':>13s}   ({args.ranks} ranks)")
    for cells in args.cells:
        r = launch(args.ranks, __file__, ["--cells", cells, "--repeat", args.repeat])
        print(f"{r['atoms']:7d} {1e3 * r['check']:11.3f} {1e3 * r['call']:10.1f} {r['check'] / r['call']:13.2e}")


if __name__ == "__main__":
    main()
