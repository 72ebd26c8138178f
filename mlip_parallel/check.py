"""Self-check of an installation: ``mpiexec -n P python -m mlip_parallel.check``.

Also ``torchrun --nproc-per-node P -m mlip_parallel.check`` (the torch.distributed backend). Prints the
ranks, the grid, each rank's host and device, the communication library and, where a rank has a GPU,
whether CUDA tensors travel device to device (NCCL, or a CUDA-aware MPI); then evaluates Lennard-Jones
and random small models of this package's architectures, SchNet, PaiNN and NequIP (float64; ``--models`` chooses) on a rattled Cu–Ag crystal
distributed, in both halo modes (layerwise and wide), and in one process, and prints the largest force
difference. Exits 1 if it exceeds 1e-8.
"""
from __future__ import annotations

import argparse
import socket
import sys

import numpy as np
import torch
from ase.build import bulk

import potentials
from potentials.families.checkpoint import ARCHITECTURES, SMALL, architecture

from . import evaluate, get_backend, rank_device
from .evaluate import Decomposition


MODELS = {  # name -> a small model with random weights (seeded: the same on every rank), of each of our architectures
    "LennardJones": lambda: potentials.LennardJones(epsilon=0.4, sigma=2.3, cutoff=5.0),
    **{name: lambda name=name: architecture(name)(["Ag", "Cu"], cutoff=4.0, seed=0, **SMALL[name])
       for name in ARCHITECTURES},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlip_parallel.check", description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=4, help="fcc cubic cell repeats per direction (4 → 256 atoms)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="the models to check (default: all), each in both halo modes")
    args = parser.parse_args(argv)

    backend = get_backend()
    device = rank_device(backend)
    rows = backend.allgather((backend.rank, socket.gethostname(), str(device),
                              torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"))
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(args.repeat)
    atoms.rattle(0.05, seed=0)
    atoms.numbers[::3] = 47
    part = Decomposition(atoms, 4.0, backend)
    owned = backend.allgather(len(part.owned))
    if backend.rank == 0:
        print(f"mlip-parallel self-check: {backend.size} rank(s), communication: {backend.library}")
        if any(dev.startswith("cuda") for _, _, dev, _ in rows):
            print(f"device-direct messages: {'yes' if backend.cuda_aware else 'no (CUDA tensors are host-staged)'}")
        print(f"grid {part.grid.dims} over {len(atoms)} atoms; owned atoms per rank {owned}")
        for rank, host, dev, name in rows:
            print(f"  rank {rank}: host {host}, device {dev} ({name})")

    worst = 0.0
    for name in args.models:
        model = MODELS[name]().double().to(device)
        reference = potentials.predict(model, atoms)
        for mode in ("layerwise", "wide"):
            result = evaluate(model, atoms, mode=mode)
            diff = float(np.abs(result["forces"] - reference["forces"]).max())
            worst = max(worst, diff)
            if backend.rank == 0:
                print(f"{name:12s} {mode:9s}: max |F_distributed - F_serial| = {diff:.3e} eV/A, "
                      f"|dE| = {abs(result['energy'] - reference['energy']):.3e} eV")
    ok = worst <= 1e-8
    if backend.rank == 0:
        print(f"largest force difference {worst:.3e} eV/A: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
