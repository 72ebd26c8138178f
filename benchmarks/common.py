"""Helpers shared by the benchmark scripts: the test crystal and launching a worker under mpiexec."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cu_crystal(cells):
    """Rattled fcc Cu, ``cells`` cubic cells per direction (4·cells³ atoms), or (nx, ny, nz) of them."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(cells)
    atoms.rattle(0.05, seed=0)
    return atoms


def cu_emt_frames(count, atoms_per_structure):
    """``count`` rattled fcc Cu cells of 4, 32, 108 or 256 atoms (ASE Atoms), each holding ASE EMT's energy,
    forces and stress (a SinglePointCalculator: ready to write as labelled extxyz)."""
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    cells = {4: 1, 32: 2, 108: 3, 256: 4}[atoms_per_structure]
    frames = []
    for k in range(count):
        atoms = cu_crystal(cells)
        atoms.rattle(0.1, seed=k)
        atoms.calc = EMT()
        energy, forces, stress = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces, stress=stress)
        frames.append(atoms)
    return frames


def cu_structures(count, atoms_per_structure):
    """``cu_emt_frames`` as ``training.Structure``s."""
    from mlip_parallel.train.structures import Structure

    return [Structure(atoms.numbers, atoms.positions, atoms.cell[:], atoms.pbc, atoms.get_potential_energy(),
                      atoms.get_forces(), atoms.get_stress(voigt=False), f"emt:{k}")
            for k, atoms in enumerate(cu_emt_frames(count, atoms_per_structure))]


def status_mb(key) -> float:
    """VmRSS (now) or VmHWM (high-water mark since the last reset) of this process, MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_hwm():
    """Restart this process's VmHWM from its current resident size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def launcher_command(ranks, launcher="mpiexec"):
    """The command that starts ``ranks`` Python processes: ``mpiexec -n ranks python`` or ``torchrun
    --standalone --nproc-per-node ranks`` (no MPI: the torch.distributed backend)."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    mpiexec = Path(sys.executable).parent / "mpiexec"
    return [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(ranks), sys.executable]


def train_command(ranks, job):
    """``mlip-train job`` on ``ranks`` processes: plain Python for one, ``launcher_command`` for more."""
    return ([sys.executable] if ranks == 1 else launcher_command(ranks)) + ["-m", "mlip_parallel.train.cli", str(job)]


def launch(ranks, script, worker_args, launcher="mpiexec", backend=None):
    """Run ``script --worker ARGS`` on ``ranks`` processes (one thread each) started by ``launcher``
    ("mpiexec" or "torchrun"), with ``MLIP_PARALLEL_BACKEND=backend`` if given; return the JSON object
    the worker printed last."""
    cmd = launcher_command(ranks, launcher) + [str(script), "--worker", *[str(a) for a in worker_args]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MLIP_PARALLEL_BACKEND", None)
    if backend is not None:
        env["MLIP_PARALLEL_BACKEND"] = backend
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def schnet_worker_setup(cells, features=64, cutoff=5.0, layers=3):
    """In a worker: one torch thread, the backend, the Cu crystal (``cu_crystal(cells)``) and a seeded
    SchNet (same on all ranks). Returns (backend, atoms, model)."""
    import torch

    import mlip_parallel
    import potentials

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = potentials.SchNet(["Cu"], cutoff=cutoff, features=features, layers=layers)
    return mlip_parallel.get_backend(), cu_crystal(cells), model


def alternate(script, worker_args, rounds, ranks=(1, 2)):
    """Launch the worker on each rank count in turn, ``rounds`` times: {ranks: [results]}."""
    runs = {r: [] for r in ranks}
    for _ in range(rounds):
        for r in ranks:
            runs[r].append(launch(r, script, worker_args))
    return runs


def adapter_worker(args, build_model, reference_calculator, before_reference=None) -> None:
    """The worker of an adapter-scaling benchmark: one torch thread, ``cu_crystal(args.cells)``, our model
    ``build_model(args.model)`` through ``mlip_parallel.evaluate``, and with ``--which pair`` also the
    package's own ASE calculator ``reference_calculator(args)`` ("theirs", ``before_reference()`` before
    each of its calls); each called once as a warm-up, then ``args.repeat`` times, alternating. Rank 0
    prints {"n_atoms", "ours"[, "theirs"]}: median seconds per call."""
    import statistics
    import time

    import torch

    import mlip_parallel

    torch.set_num_threads(1)
    atoms = cu_crystal(args.cells)
    model, backend = build_model(args.model), mlip_parallel.get_backend()
    calls = {"ours": lambda: mlip_parallel.evaluate(model, atoms)}
    if args.which == "pair":
        theirs = atoms.copy()
        theirs.calc = reference_calculator(args)

        def theirs_call():
            if before_reference is not None:
                before_reference()
            theirs.calc.reset()
            return theirs.get_potential_energy(), theirs.get_forces(), theirs.get_stress()
        calls["theirs"] = theirs_call
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(args.repeat):
        for name, call in calls.items():
            backend.barrier()
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    if backend.rank == 0:
        print(json.dumps({"n_atoms": len(atoms), **{name: statistics.median(t) for name, t in times.items()}}))


def ours_against_theirs(script, flags, rounds: int, theirs: str, title: str) -> None:
    """Alternate ``rounds`` times a one-process launch of ``script --worker --which pair FLAGS`` (the
    package's own calculator, "theirs", and ours, calls alternating) and a 2-rank launch with ``--which
    ours``; print per-round times and the ratios: ours on 1 rank / ``theirs`` (target ≤ 1.05) and 2 ranks
    over 1 (target ≥ 1.8×)."""
    import statistics

    runs = [(launch(1, script, flags + ["--which", "pair"]), launch(2, script, flags + ["--which", "ours"]))
            for _ in range(rounds)]
    reference = statistics.median(p["theirs"] for p, _ in runs)
    one = statistics.median(p["ours"] for p, _ in runs)
    two = statistics.median(t["ours"] for _, t in runs)
    print(f"{title}, {runs[0][0]['n_atoms']} atoms rattled fcc Cu, one thread per process; seconds per "
          f"energy+forces+stress, medians per launch, {rounds} rounds:")
    for k, (p, t) in enumerate(runs):
        print(f"  round {k + 1}: {theirs} {p['theirs']:.3f}, ours 1 rank {p['ours']:.3f} (ratio "
              f"{p['ours'] / p['theirs']:.3f}), ours 2 ranks {t['ours']:.3f} (speed-up {p['ours'] / t['ours']:.2f}x)")
    print(f"  1 rank / {theirs} = {one / reference:.3f} (target <= 1.05, goal <= 1.0); 2 ranks speed-up over 1 rank "
          f"= {one / two:.2f}x (target >= 1.8x), over {theirs} {reference / two:.2f}x", flush=True)


def adapter_scaling_parser(doc: str, repeat: int):
    """The command line of the adapter-scaling benchmarks: --cells, --repeat, --rounds, and the worker's
    hidden --which / --model / --worker."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--cells", type=int, default=8, help="cubic fcc cells per direction (8 → 2,048 atoms)")
    parser.add_argument("--repeat", type=int, default=repeat)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--which", choices=["pair", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser
