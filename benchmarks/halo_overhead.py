"""Halo overhead: layerwise ``mlip_parallel.evaluate`` on one rank vs ``potentials.predict``.

Same SchNet, same structure (Cu fcc, ~4,000 atoms), one thread, timings interleaved so machine noise
hits both alike. Prints the median time of each and their ratio (target ≤ 1.05×).

    python benchmarks/halo_overhead.py [--repeat 10] [--cells 10]
"""
import argparse
import statistics
import time

import torch
from ase.build import bulk

import mlip_parallel
import potentials


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=10, help="cubic fcc cells per direction (10 → 4,000 atoms)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--cutoff", type=float, default=5.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(args.cells)
    atoms.rattle(0.05, seed=0)
    torch.manual_seed(0)
    model = potentials.SchNet(["Cu"], cutoff=args.cutoff, features=args.features, layers=3)
    serial = mlip_parallel.SerialBackend()
    runs = {"predict": lambda: potentials.predict(model, atoms),
            "evaluate (1 rank, layerwise)": lambda: mlip_parallel.evaluate(model, atoms, comm=serial)}
    times = {name: [] for name in runs}
    for name, run in runs.items():  # warm-up
        run()
    for _ in range(args.repeat):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"SchNet F={args.features} L=3 rc={args.cutoff} on {len(atoms)} atoms, 1 thread, "
          f"median of {args.repeat} energy+forces+stress evaluations:")
    for name, t in medians.items():
        print(f"  {name:30s} {t * 1e3:8.1f} ms")
    ratio = medians["evaluate (1 rank, layerwise)"] / medians["predict"]
    print(f"halo overhead ratio evaluate/predict = {ratio:.3f}x (target <= 1.05x)")


if __name__ == "__main__":
    main()
