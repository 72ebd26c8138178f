"""Many small structures: ours batched (``md.batch``: single points and FIRE relaxations, the graph size found by
measured throughput) against the ASE loop with each family's own calculator, TorchSim's batched ``static`` and
``optimize`` (run by ``--torchsim PYTHON``: a Python >= 3.12 with torch-sim-atomistic installed), and ``mlip-batch``
on ``--ranks`` ranks. Structures: ``--structures`` rattled, strained fcc Cu cells of ``--atoms LO,HI`` atoms (seeded),
one extxyz file every method reads. Each method runs in a process of its own, one thread per process, timed after a
warm-up evaluation (mlip-batch: the job's own seconds, its first evaluation included); the methods of one model and
task run one after another, ``--rounds`` times in turn (this host is noisy: only side-by-side ratios count). Prints
structures per second per method and its ratio to the ASE loop, and the largest energy difference of each method
from the ASE loop (the same model: float32 rounding). "ASE loop ×P at once": P loops at the same time, each on
every P-th structure — what this host gives P processes (its ceiling for mlip-batch on P ranks: shared memory
bandwidth and caches).

Models (the family's own calculator, and TorchSim's wrapper):
  sevennet     SevenNet-0 as sevenn ships it, float32 (SevenNetCalculator; torch_sim.models.sevennet)
  mace-medium  a random MACE of MACE-MP-0-medium's shape, float32 (MACECalculator; torch_sim.models.mace)
  mace-small   a random MACE of MACE-MP-0-small's shape, float32 (likewise)
  cu-emt       this package's bundled PaiNN, float32 (our MLIPCalculator in the ASE loop; no TorchSim wrapper)

    python benchmarks/batch.py [--models sevennet,mace-medium,mace-small,cu-emt] [--tasks single_point,relax]
        [--structures 100] [--relax-structures 12] [--atoms 8,64] [--fmax 0.05] [--random-fmax 1e-6] [--steps 30]
        [--rounds 1]
        [--ranks 2] [--torchsim /work/torchsim-venv/bin/python]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = ("sevennet", "mace-medium", "mace-small", "cu-emt")
MACE_HIDDEN = {"mace-medium": "128x0e+128x1o", "mace-small": "128x0e"}


def write_structures(path, count: int, low: int, high: int, seed: int = 0) -> None:
    """``count`` fcc Cu cells of ``low``..``high`` atoms (cubic 4-atom cells repeated), rattled by 0.05 Å and strained
    by 1 %, to the extxyz file ``path``."""
    import numpy as np
    from ase.build import bulk
    from ase.io import write

    rng = np.random.default_rng(seed)
    shapes = [(a, b, c) for a in range(1, 9) for b in range(1, 9) for c in range(1, 9)
              if low <= 4 * a * b * c <= high and a >= b >= c]
    structures = []
    for k in range(count):
        a, b, c = shapes[rng.integers(len(shapes))]
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(tuple(rng.permutation([a, b, c])))
        atoms.rattle(0.05, seed=seed + k)
        atoms.set_cell(atoms.cell[:] @ (np.eye(3) + 0.01 * rng.standard_normal((3, 3))), scale_atoms=True)
        structures.append(atoms)
    write(path, structures)


def model_file(name: str, directory: Path) -> str:
    """The model's file (or name) every method loads: SevenNet-0's name, a random MACE written once, cu-emt."""
    if name in MACE_HIDDEN:
        path = directory / f"{name}.model"
        if not path.exists():
            sys.path.insert(0, str(HERE))
            from mace_scaling import make_model

            make_model(str(path), "float32", hidden=MACE_HIDDEN[name])
        return str(path)
    return {"sevennet": "7net-0", "cu-emt": "cu-emt"}[name]


# ---------------------------------------------------------------------------------------------------- workers
def worker_ours(args) -> dict:
    import torch

    torch.set_num_threads(1)
    from ase.io import read

    import potentials
    from md.batch import relax_many, single_points

    model = {"sevennet": lambda: potentials.SevenNet("7net-0"), "cu-emt": lambda: potentials.load_model("cu-emt")}.get(
        args.model, lambda: potentials.MACE(args.file))()
    structures = read(args.structures, ":")
    single_points(model, structures[:1])  # warm-up
    start = time.perf_counter()
    if args.task == "relax":
        done = relax_many(model, structures, fmax=args.fmax, max_steps=args.steps)
    else:
        done = single_points(model, structures)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "energies": [a.get_potential_energy() for a in done],
            "steps": [int(a.info.get("steps", 0)) for a in done]}


def family_calculator(args):
    if args.model == "sevennet":
        from sevenn.calculator import SevenNetCalculator

        return SevenNetCalculator("7net-0")
    if args.model == "cu-emt":  # (as ours loads it, float32: the spec string would load it in float64)
        import potentials
        from md.calculator import MLIPCalculator

        return MLIPCalculator(potentials.load_model("cu-emt"))
    from mace.calculators import MACECalculator

    return MACECalculator(model_paths=args.file, device="cpu", default_dtype="float32")


def worker_ase(args) -> dict:
    import torch

    torch.set_num_threads(1)
    from ase.io import read
    from ase.optimize import FIRE

    calculator = family_calculator(args)
    structures = read(args.structures, ":")
    warm = structures[0].copy()
    warm.calc = calculator
    warm.get_forces()
    energies, steps = [], []
    start = time.perf_counter()
    for atoms in structures:
        atoms.calc = calculator
        if args.task == "relax":
            optimizer = FIRE(atoms, logfile=None)
            optimizer.run(fmax=args.fmax, steps=args.steps)
            steps.append(optimizer.nsteps)
        else:
            atoms.get_stress()
            steps.append(0)
        energies.append(atoms.get_potential_energy())
    return {"seconds": time.perf_counter() - start, "energies": energies, "steps": steps}


def worker_torchsim(args) -> dict:
    """TorchSim's static / FIRE (ASE's flavour) over all structures as it batches them by default (autobatcher off:
    one batch, converged systems dropped), float32, CPU, one thread."""
    import torch

    torch.set_num_threads(1)
    import torch_sim as ts
    from ase.io import read

    device, dtype = torch.device("cpu"), torch.float32
    if args.model == "sevennet":
        from sevenn.util import load_checkpoint
        from torch_sim.models.sevennet import SevenNetModel

        model = SevenNetModel(model=load_checkpoint("7net-0").build_model(), device=device, dtype=dtype)
    else:
        from torch_sim.models.mace import MaceModel

        model = MaceModel(model=args.file, device=device, dtype=dtype, compute_forces=True, compute_stress=True)
    structures = read(args.structures, ":")
    ts.static(structures[:1], model)  # warm-up
    start = time.perf_counter()
    if args.task == "relax":
        final = ts.optimize(system=structures, model=model, optimizer=ts.Optimizer.fire, max_steps=args.steps,
                            convergence_fn=ts.generate_force_convergence_fn(force_tol=args.fmax,
                                                                            include_cell_forces=False),
                            init_kwargs=dict(fire_flavor="ase_fire"), fire_flavor="ase_fire")
        energies = [float(e) for e in final.energy]
    else:
        energies = [float(r["potential_energy"][0]) for r in ts.static(structures, model)]
    return {"seconds": time.perf_counter() - start, "energies": energies, "steps": []}


def worker(args) -> None:
    if args.part:
        from ase.io import read, write

        index, count = (int(x) for x in args.part.split(","))
        part = Path(args.structures).with_suffix(f".part{index}.extxyz")
        write(part, read(args.structures, ":")[index::count])
        args.structures = str(part)
    result = {"ours": worker_ours, "ase": worker_ase, "torchsim": worker_torchsim}[args.worker](args)
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------- driver
def run_worker(python: str, which: str, args, model: str, task: str, structures: str, file: str,
               processes: int = 1) -> dict | None:
    """One worker process; with ``processes`` > 1 that many at once, each on its share of the structures (every
    ``processes``-th): the host's ceiling for that many ranks, the slowest's seconds and the energies in order."""
    commands = [[python, __file__, "--worker", which, "--model", model, "--task", task, "--file", file,
                 "--structures-file", structures, "--fmax", str(args.fmax), "--steps", str(args.steps)]
                + (["--part", f"{k},{processes}"] if processes > 1 else []) for k in range(processes)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for c in commands]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate()
        found = re.search(r"^RESULT (.*)$", stdout, re.M)
        if not found:
            print(f"  {which}: failed\n{stdout[-2000:]}\n{stderr[-2000:]}")
            return None
        results.append(json.loads(found[1]))
    energies = [None] * sum(len(r["energies"]) for r in results)
    for k, result in enumerate(results):
        energies[k::processes] = result["energies"]
    return {"seconds": max(r["seconds"] for r in results), "energies": energies}


def run_ranks(args, model: str, task: str, structures: str, file: str, directory: Path) -> dict | None:
    """mlip-batch on ``args.ranks`` ranks: its own seconds (from its last line), its results' energies."""
    import yaml
    from ase.io import read

    spec = {"sevennet": {"sevennet": "7net-0"}, "cu-emt": {"checkpoint": "cu-emt", "dtype": "float32"}}.get(
        model, {"mace": file})
    out = directory / f"ranks-{model}-{task}"
    job = {"model": spec, "structures": structures, "task": task, "relax": {"fmax": args.fmax, "max_steps": args.steps},
           "output": {"directory": str(out), "overwrite": True, "progress": False}}
    (directory / "job.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    proc = subprocess.run([mpiexec, "-n", str(args.ranks), sys.executable, "-m", "md.batch_cli",
                           str(directory / "job.yaml")], capture_output=True, text=True, env=env, cwd=ROOT)
    found = re.search(r"mlip-batch: \d+ structures in .* \(([\d.]+) s\)", proc.stdout)
    if proc.returncode != 0 or not found:
        print(f"  mlip-batch on {args.ranks} ranks: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return None
    return {"seconds": float(found[1]), "energies": [a.get_potential_energy() for a in read(out / "results.extxyz", ":")]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tasks", default="single_point,relax")
    parser.add_argument("--structures", type=int, default=100)
    parser.add_argument("--relax-structures", type=int, default=12)
    parser.add_argument("--atoms", default="8,64")
    parser.add_argument("--fmax", type=float, default=0.05)
    parser.add_argument("--random-fmax", type=float, default=1e-6, help="fmax for the random MACE models, whose "
                        "forces are small: 1e-6 runs --steps steps per structure (the relaxations' throughput)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--torchsim", default="/work/torchsim-venv/bin/python")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    parser.add_argument("--structures-file", dest="structures_file", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.structures = args.structures_file
        return worker(args)
    low, high = (int(x) for x in args.atoms.split(","))
    torchsim = args.torchsim if Path(args.torchsim).exists() else None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"{args.structures} structures (relax: {args.relax_structures}) of {low}-{high} atoms, fmax {args.fmax} "
              f"(random MACE models: {args.random_fmax}), at most {args.steps} steps; one thread per process; "
              f"TorchSim: {torchsim or 'not found'}")
        print(f"{'model':12} {'task':12} {'method':20} {'structures/s':>12} {'vs ASE loop':>11} {'max |dE| eV':>11}")
        fmax = args.fmax
        for model in args.models.split(","):
            file = model_file(model, tmp)
            args.fmax = args.random_fmax if model in MACE_HIDDEN else fmax
            for task in args.tasks.split(","):
                count = args.structures if task == "single_point" else args.relax_structures
                structures = str(tmp / f"structures-{task}.extxyz")
                write_structures(structures, count, low, high)
                methods = {"ASE loop": lambda: run_worker(sys.executable, "ase", args, model, task, structures, file),
                           "ours batched": lambda: run_worker(sys.executable, "ours", args, model, task, structures,
                                                              file)}
                if torchsim and model != "cu-emt":
                    methods["TorchSim"] = lambda: run_worker(torchsim, "torchsim", args, model, task, structures,
                                                             file)
                if args.ranks > 1:
                    methods[f"ours {args.ranks} ranks"] = lambda: run_ranks(args, model, task, structures, file, tmp)
                    methods[f"ASE loop ×{args.ranks} at once"] = lambda: run_worker(
                        sys.executable, "ase", args, model, task, structures, file, processes=args.ranks)
                seconds = {name: [] for name in methods}
                energies = {}
                for _ in range(args.rounds):
                    for name, run in methods.items():
                        result = run()
                        if result is not None:
                            seconds[name].append(result["seconds"])
                            energies[name] = result["energies"]
                reference = energies.get("ASE loop")
                base = min(seconds["ASE loop"]) if seconds["ASE loop"] else None
                for name, times in seconds.items():
                    if not times:
                        continue
                    rate = count / max(min(times), 1e-9)
                    ratio = f"{base / max(min(times), 1e-9):.2f}" if base else "-"
                    diff = max(abs(a - b) for a, b in zip(energies[name], reference)) if reference else float("nan")
                    print(f"{model:12} {task:12} {name:20} {rate:12.3g} {ratio:>11} {diff:11.2e}", flush=True)


if __name__ == "__main__":
    main()
