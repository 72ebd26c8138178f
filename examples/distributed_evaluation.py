"""Evaluate a potential spatially decomposed over MPI ranks and compare with one process.

    mpiexec -n 2 python examples/distributed_evaluation.py            # 2 ranks
    python examples/distributed_evaluation.py --model lj --cells 6     # serial

Every rank builds the same structure and calls ``mlip_parallel.evaluate``; each rank computes only
its own subdomain (plus a halo of ghost atoms) and every rank receives the full result.
"""
import argparse
import time

import numpy as np
import torch
from ase.build import bulk

import mlip_parallel
import potentials


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["schnet", "lj"], default="schnet")
    parser.add_argument("--cells", type=int, default=5, help="fcc cubic cells per direction")
    parser.add_argument("--mode", choices=["layerwise", "wide"], default="layerwise")
    args = parser.parse_args()
    torch.set_num_threads(1)

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(args.cells)
    atoms.rattle(0.05, seed=0)
    atoms.numbers[::4] = 47  # a Cu–Ag alloy
    if args.model == "lj":
        model = potentials.LennardJones(epsilon=0.4, sigma=2.3, cutoff=5.0)
    else:
        torch.manual_seed(0)  # the same random weights on every rank
        model = potentials.SchNet(["Ag", "Cu"], cutoff=4.5, features=32, layers=3).double()

    backend = mlip_parallel.get_backend()
    t0 = time.perf_counter()
    result = mlip_parallel.evaluate(model, atoms, mode=args.mode)
    elapsed = time.perf_counter() - t0
    reference = potentials.predict(model, atoms)  # one process, for comparison
    if backend.rank == 0:
        print(f"{len(atoms)} atoms on {backend.size} rank(s), {args.mode} mode: {elapsed:.2f} s")
        print(f"energy {result['energy']:.6f} eV, stress (eV/A^3) {np.round(result['stress'], 6)}")
        print(f"max |F - F_serial| = {np.abs(result['forces'] - reference['forces']).max():.2e} eV/A")


if __name__ == "__main__":
    main()
