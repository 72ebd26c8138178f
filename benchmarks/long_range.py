"""The long-range Coulomb term: its share of a force call, its scaling with atoms and ranks, its memory per atom, and
energy conservation in mlip-md.

The born_coulomb family (NaCl's Fumi–Tosi parameters, cutoff 9 Å, pairs shifted to zero at the cutoff) on rattled
rocksalt NaCl boxes, energy + forces + stress through ``mlip_parallel.evaluate``, one thread per rank. Per size and
solver: seconds per call on 1 and 2 ranks (each a fresh ``mpiexec`` job, glibc's malloc keeping freed memory as the
tools set it), the long-range share (1 − the call's time
with the Coulomb term replaced by zeros / the full call's, measured side by side in the same job), and the peak
resident memory per atom above the job's start. The meshes (PME, P3M) on more than one rank run both ways, side by side:
replicated (every rank sums and transforms the whole mesh) and distributed (each rank a slab: potentials.slab_mesh),
which is the crossover ``long_range.mesh: auto`` picks by. Ewald is run only up to ``--ewald-max`` atoms (its cost
grows as N^1.5 and more).

``--errors`` prints the force error each method reaches against the accuracy asked for (64 ions, against Ewald at
1e-12). ``--nve`` runs mlip-md: a molten NaCl box (216 ions, velocities of 2,800 K: about 1,400 K once shared with
the potential energy) for 1,000 NVE steps of 1 fs with Ewald at accuracy 1e-6, and prints the total energy's drift
and fluctuation.

    python benchmarks/long_range.py [--atoms 1000,8000,27000,64000] [--methods ewald,pme,p3m] [--ranks 1,2]
                                    [--meshes replicated,distributed]
    python benchmarks/long_range.py --nve
    python benchmarks/long_range.py --errors
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import launcher_command  # noqa: E402

FUMI_TOSI = {"Na-Na": [0.2637, 0.317, 2.340, 1.0486, -0.4993], "Na-Cl": [0.2110, 0.317, 2.755, 6.99055, -8.6758],
             "Cl-Cl": [0.1582, 0.317, 3.170, 72.40215, -145.4284]}
SPEC = {"charges": {"Na": 1.0, "Cl": -1.0}, "pairs": FUMI_TOSI, "cutoff": 9.0, "shift": True}


def box(atoms: int, seed: int = 0):
    """A rattled rocksalt NaCl box of ``atoms`` ions (8 n³)."""
    import numpy as np
    from ase.build import bulk

    n = round((atoms / 8) ** (1 / 3))
    if 8 * n**3 != atoms:
        raise SystemExit(f"--atoms: {atoms} is not 8 n³ (1000, 8000, 27000, 64000, 125000, ...)")
    structure = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(n)
    structure.positions += np.random.default_rng(seed).normal(0.0, 0.1, structure.positions.shape)
    return structure


def worker(args) -> None:
    """One mpiexec job: a warm-up, then ``--calls`` full calls and as many without the Coulomb term, alternating."""
    import torch

    import mlip_parallel
    import potentials
    from mlip_parallel.allocator import keep_freed_memory
    from mlip_parallel.backend import get_backend
    from potentials.coulomb import Coulomb

    torch.set_num_threads(1)
    keep_freed_memory()  # as mlip-md, mlip-lammps and the calculator do (mlip_parallel.allocator)
    backend = get_backend()
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = potentials.load_model(("born_coulomb", SPEC), long_range={"method": args.method, "accuracy": args.accuracy,
                                                                     "mesh": args.mesh})
    atoms = box(args.atoms)
    mlip_parallel.evaluate(model, atoms)  # warm-up (and the split, kept)
    real_forward, times = Coulomb.forward, {"full": [], "short": []}
    for _ in range(args.calls):
        for kind in ("full", "short"):
            if kind == "short":  # the same graph and pairs, the Coulomb term zero
                Coulomb.forward = lambda self, charges, graph, cutoff: torch.zeros(
                    graph.n_local, dtype=torch.float64, device=charges.device) * charges[: graph.n_local]
            backend.barrier()
            begin = time.perf_counter()
            mlip_parallel.evaluate(model, atoms)
            times[kind].append(time.perf_counter() - begin)
            Coulomb.forward = real_forward
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peaks = backend.allgather((peak - start_rss) * 1024)
    smearing, resolution = next(iter(model.long_range._splits.values()))
    if backend.rank == 0:
        from torchpme.lib import get_ns_mesh

        full, short = min(times["full"]), min(times["short"])
        mesh = [int(n) for n in get_ns_mesh(torch.tensor(atoms.cell[:]), resolution)] if args.method != "ewald" else []
        print(json.dumps({"full": full, "short": short, "share": 1 - short / full, "peak_bytes": max(peaks),
                          "smearing": smearing, "resolution": resolution, "mesh": mesh}))


def run_job(ranks: int, method: str, atoms: int, calls: int, accuracy: float, mesh: str = "auto") -> dict:
    command = launcher_command(ranks) + [__file__, "--worker", "--method", method, "--atoms", str(atoms), "--calls",
                                         str(calls), "--accuracy", str(accuracy), "--mesh", mesh]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def scaling(args) -> None:
    print(f"{'method':6s} {'atoms':>7s} {'ranks':>5s} {'mesh':>11s} {'s/call':>8s} {'LR share':>8s} {'speed-up':>8s} "
          f"{'KB/atom':>8s}  split (smearing Å, resolution Å), mesh points", flush=True)
    for method in args.methods.split(","):
        for atoms in (int(a) for a in args.atoms.split(",")):
            if method == "ewald" and atoms > args.ewald_max:
                continue
            one = None
            for ranks in (int(r) for r in args.ranks.split(",")):
                meshes = args.meshes.split(",") if method != "ewald" and ranks > 1 else ["auto"]
                for mesh in meshes:
                    got = run_job(ranks, method, atoms, args.calls, args.accuracy, mesh)
                    if "error" in got:
                        print(f"{method:6s} {atoms:7d} {ranks:5d} {mesh:>11s} error: {got['error']}", flush=True)
                        continue
                    one = got["full"] if one is None else one
                    print(f"{method:6s} {atoms:7d} {ranks:5d} {mesh:>11s} {got['full']:8.3f} {got['share']:8.2f} "
                          f"{one / got['full']:8.2f} {got['peak_bytes'] / atoms / 1e3:8.2f}  "
                          f"({got['smearing']:.3f}, {got['resolution']:.3f}) {'x'.join(map(str, got['mesh']))}",
                          flush=True)


def nve(args) -> None:
    """mlip-md, NVE, 1,000 steps: the total energy's drift (slope) and its standard deviation per atom."""
    import numpy as np
    import yaml
    from ase.io import write

    with tempfile.TemporaryDirectory() as tmp:
        structure = box(216, seed=1)
        write(f"{tmp}/nacl.extxyz", structure)
        config = {"model": {"born_coulomb": SPEC, "long_range": {"method": "ewald", "accuracy": 1e-6}},
                  "structure": {"file": f"{tmp}/nacl.extxyz"}, "ensemble": "nve", "temperature_K": 2800,
                  "timestep_fs": 1.0, "steps": args.steps, "seed": 1,
                  "output": {"directory": f"{tmp}/out", "thermo_every": 10}}
        Path(f"{tmp}/job.yaml").write_text(yaml.safe_dump(config))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        begin = time.perf_counter()
        subprocess.run(launcher_command(args.nve_ranks) + ["-m", "md.cli", f"{tmp}/job.yaml", "--no-progress"],
                       check=True, env=env, capture_output=True)
        wall = time.perf_counter() - begin
        table = np.genfromtxt(f"{tmp}/out/thermo.csv", delimiter=",", names=True)
    etot, n = table["etot_eV"] / len(structure), len(structure)
    slope = np.polyfit(table["time_fs"], etot, 1)[0] * 1e6  # eV/atom/ns
    print(f"mlip-md NVE, {n} NaCl ions, Ewald 1e-6, {args.steps} steps of 1 fs on {args.nve_ranks} ranks "
          f"({wall:.0f} s): T {table['temperature_K'][0]:.0f} -> {table['temperature_K'][-1]:.0f} K (mean "
          f"{table['temperature_K'].mean():.0f}); etot per atom: drift {slope:.3g} eV/ns, std {etot.std():.2e} eV, "
          f"largest change {np.ptp(etot):.2e} eV")


def errors(args) -> None:
    """The force error reached against the one asked for: each method and accuracy on a rattled 64-ion NaCl box (one
    with a net charge too) against Ewald at 1e-12, in the accuracy's units (eV/Å over e²/(4πε0 Å²))."""
    import numpy as np

    import potentials
    from potentials.coulomb import COULOMB_EV_A

    zero = {name: [0.0, 1.0, 0.0, 0.0, 0.0] for name in FUMI_TOSI}  # the Coulomb energy alone
    spec = {"charges": SPEC["charges"], "pairs": zero, "cutoff": 6.0}
    print(f"{'box':8s} {'method':6s} {'accuracy':>9s} {'max |dF| / accuracy':>20s}")
    for charged in (False, True):
        atoms = box(64, seed=1)
        if charged:
            del atoms[3]
        exact = potentials.predict(potentials.load_model(("born_coulomb", spec), long_range={
            "method": "ewald", "accuracy": 1e-12}), atoms)["forces"]
        for method in ("ewald", "pme", "p3m"):
            for accuracy in (1e-4, 1e-6, 1e-8):
                model = potentials.load_model(("born_coulomb", spec), long_range={"method": method,
                                                                                   "accuracy": accuracy})
                error = np.abs(potentials.predict(model, atoms)["forces"] - exact).max() / COULOMB_EV_A
                print(f"{'charged' if charged else 'neutral':8s} {method:6s} {accuracy:9.0e} {error / accuracy:20.3g}",
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--atoms", default="1000,8000,27000,64000")
    parser.add_argument("--methods", default="ewald,pme,p3m")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--accuracy", type=float, default=1e-5)
    parser.add_argument("--ewald-max", type=int, default=8000)
    parser.add_argument("--meshes", default="replicated,distributed")
    parser.add_argument("--mesh", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--nve", action="store_true")
    parser.add_argument("--errors", action="store_true")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--nve-ranks", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.atoms = int(args.atoms)
        worker(args)
    elif args.nve:
        nve(args)
    elif args.errors:
        errors(args)
    else:
        scaling(args)


if __name__ == "__main__":
    main()
