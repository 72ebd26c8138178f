"""Memory per rank: peak RSS above the after-import baseline for one layerwise SchNet evaluation of a
~100,000-atom crystal, on 1 rank and on 2 ranks (target: 2-rank peak ≤ 0.55 × 1-rank peak).

    python benchmarks/memory.py [--cells 29] [--features 32] [--cutoff 4.0]
"""
import argparse
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cu_crystal, launch  # noqa: E402


def rss_mib(peak=False):
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def worker(args):
    import torch

    import mlip_parallel
    import potentials

    torch.set_num_threads(1)
    backend = mlip_parallel.get_backend()
    baseline = rss_mib()
    atoms = cu_crystal(args.cells)
    torch.manual_seed(0)
    model = potentials.SchNet(["Cu"], cutoff=args.cutoff, features=args.features, layers=3)
    mlip_parallel.evaluate(model, atoms)
    peaks = backend.allgather(rss_mib(peak=True) - baseline)
    if backend.rank == 0:
        print(json.dumps({"n_atoms": len(atoms), "peak_above_baseline_mib": max(peaks)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=29, help="cubic fcc cells per direction (29 → 97,556 atoms)")
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--cutoff", type=float, default=4.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    flags = ["--cells", args.cells, "--features", args.features, "--cutoff", args.cutoff]
    one, two = launch(1, __file__, flags), launch(2, __file__, flags)
    print(f"SchNet F={args.features} L=3 rc={args.cutoff} layerwise, {one['n_atoms']} atoms: "
          "peak RSS above the after-import baseline, largest rank")
    print(f"  1 rank : {one['peak_above_baseline_mib']:8.0f} MiB")
    print(f"  2 ranks: {two['peak_above_baseline_mib']:8.0f} MiB per rank")
    print(f"ratio 2 ranks / 1 rank = {two['peak_above_baseline_mib'] / one['peak_above_baseline_mib']:.3f} "
          "(target <= 0.55)")


if __name__ == "__main__":
    main()
