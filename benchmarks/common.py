"""Helpers shared by the benchmark scripts: the test crystal and launching a worker under mpiexec."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cu_crystal(cells):
    """Rattled fcc Cu, ``cells`` cubic cells per direction (4·cells³ atoms)."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(cells)
    atoms.rattle(0.05, seed=0)
    return atoms


def launch(ranks, script, worker_args):
    """Run ``mpiexec -n ranks python script --worker ARGS`` (one thread per rank); return the JSON
    object the worker printed last."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(ranks), sys.executable, str(script),
           "--worker", *[str(a) for a in worker_args]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def schnet_worker_setup(cells, features=64, cutoff=5.0):
    """In a worker: one torch thread, the backend, the Cu crystal and a seeded SchNet (same on all ranks).
    Returns (backend, atoms, model)."""
    import torch

    import mlip_parallel
    import potentials

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = potentials.SchNet(["Cu"], cutoff=cutoff, features=features, layers=3)
    return mlip_parallel.get_backend(), cu_crystal(cells), model


def alternate(script, worker_args, rounds, ranks=(1, 2)):
    """Launch the worker on each rank count in turn, ``rounds`` times: {ranks: [results]}."""
    runs = {r: [] for r in ranks}
    for _ in range(rounds):
        for r in ranks:
            runs[r].append(launch(r, script, worker_args))
    return runs
