"""One command for a GPU machine (under 8 minutes on one GPU): does mlip-parallel run there, correctly,
and how fast? Prints one table.

    python benchmarks/gpu_check.py           # CUDA: needs torch with CUDA and a GPU
    python benchmarks/gpu_check.py --cpu     # the same checks with the CPU as the device (smaller sizes)

1. the self-check (``mlip_parallel.check``: Lennard-Jones, SchNet, PaiNN and NequIP, layerwise and wide, distributed vs one
   process) on 1, 2 and 4 ranks sharing the GPU(s), with the MPI backend (mpiexec; CUDA tensors
   host-staged unless MLIP_CUDA_AWARE_MPI=1) and the torch backend (torchrun; NCCL on GPUs, gloo on CPUs);
2. SchNet, PaiNN, NequIP (random weights), SevenNet-0 and a MACE file on the device, float64 and float32, against a CPU
   float64 reference: energy and forces;
3. 100 velocity-Verlet steps on the device against the same run on the CPU (float64);
4. ``mlip-train`` on the device (float64 SchNet, energy + force + stress, AdamW + EMA, 3 epochs): one process
   (GPU only), data-parallel on 2 ranks, pipeline S=2 (``auto``) on 2 ranks and 2 replicas × 2 stages on 4 ranks, each
   epoch's metrics against one process on the CPU;
5. MD throughput (atom-steps/s) of a float32 SchNet at two sizes (10 k and 100 k atoms; 4 k and 13.5 k
   with --cpu), 1 vs 2 ranks, torch backend vs MPI backend, with the halo's time per step (messages and
   waiting, inside the force call), one layer's feature exchange timed alone (every rank ready), and the
   peak memory per rank (GPU: ``max_memory_allocated``; CPU: resident high-water mark).

Exits 1 if a correctness check fails. Numbers for the machines it has run on are in docs/benchmarks.md.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cu_crystal, cu_emt_frames, launch, launcher_command, reset_hwm, schnet_worker_setup, status_mb, \
    train_command  # noqa: E402

BACKENDS = {"mpi": "mpiexec", "torch": "torchrun"}  # backend → the launcher that starts its ranks


def alloy(cells=3):
    """Rattled fcc Cu with every third atom Ag (108 atoms for 3 cells)."""
    atoms = cu_crystal(cells)
    atoms.numbers[::3] = 47
    return atoms


# ----------------------------------------------------------------------------- 1. self-check
def self_checks(ranks_list, env):
    rows = []
    for backend, launcher in BACKENDS.items():
        for ranks in ranks_list:
            cmd = launcher_command(ranks, launcher) + ["-m", "mlip_parallel.check", "--repeat", "3"]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, MLIP_PARALLEL_BACKEND=backend))
            lines = [line for line in proc.stdout.splitlines() if "largest force difference" in line]
            ok = proc.returncode == 0 and bool(lines)
            if not ok:  # the whole story, for the log
                print(f"--- {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
            detail = lines[-1].split(":")[0] if lines else (proc.stdout + proc.stderr).strip().splitlines()[-1:]
            rows.append(("self-check", f"{backend} backend ({launcher}), {ranks} rank(s)",
                         f"{detail} ({time.perf_counter() - start:.0f} s)", ok))
    return rows


# ----------------------------------------------------------------------------- 2. models on the device
def models():
    """name → a function building the model: float64, except SevenNet-0 (float32 only; only where sevenn is
    installed); MACE where mace-torch is installed."""
    import torch

    import potentials

    def seeded(cls, **kwargs):
        def build():
            torch.manual_seed(0)
            return cls(["Ag", "Cu"], cutoff=4.5, **kwargs).double()
        return build

    out = {"SchNet": seeded(potentials.SchNet, features=32, layers=3),
           "PaiNN": seeded(potentials.PaiNN, features=32, layers=3),
           "NequIP": seeded(potentials.NequIP, features=16, layers=3)}
    try:
        from potentials.adapters.sevennet import SevenNet
        out["SevenNet-0"] = lambda: SevenNet("7net-0")
    except ImportError:
        pass
    if importlib.util.find_spec("mace") is not None:  # a MACE file saved under e3nn 0.4.4 (the test fixture)
        out["MACE"] = lambda: potentials.MACE(ROOT / "tests" / "data" / "mace" / "mace-zbl-f64.model")
    return out


def model_checks(device, names=None):
    """Each of ``models()`` (``names``: those alone) on ``device`` against the CPU, float64 and float32."""
    import numpy as np

    import potentials

    available = models()
    unknown = set(names or ()) - set(available)
    if unknown:
        raise ValueError(f"--models: {sorted(unknown)} not among {sorted(available)}")
    atoms = alloy()
    rows = []
    for name, build in available.items():
        if names is not None and name not in names:
            continue
        model = build()
        reference, precision = potentials.predict(model, atoms), str(model.dtype).replace("torch.", "")
        scale = float(np.abs(reference["forces"]).max())
        for dtype, tolerance in (("float64", 1e-9), ("float32", 1e-4)):
            if dtype == "float64" and precision == "float32":
                continue  # SevenNet-0 runs in float32 only: its reference is CPU float32
            model = build().to(device)
            model = model.float() if dtype == "float32" else model
            result = potentials.predict(model, atoms)
            force = float(np.abs(result["forces"] - reference["forces"]).max()) / scale
            energy = abs(result["energy"] - reference["energy"]) / abs(reference["energy"])
            rows.append((f"{name} on {device}", f"{dtype} vs CPU {precision}, {len(atoms)} atoms",
                         f"max |dF|/max|F| {force:.1e}, |dE|/|E| {energy:.1e}",
                         force <= tolerance and energy <= tolerance))  # (max() would pass a NaN second)
    return rows


# ----------------------------------------------------------------------------- 3. MD on the device
def md_check(device, steps=100):
    """``steps`` steps on ``device`` and on the CPU from one start, for NVE, Langevin (the counter-based
    noise drawn on the device) and anisotropic MTK NPT; the atoms must stay tensors on ``device``."""
    import numpy as np
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.parallel import DummyMPI

    from md.engine import MDSystem, run
    from md.integrators import MTK, Langevin, VelocityVerlet

    build = models()["SchNet"]
    integrators = {"NVE": lambda: VelocityVerlet(2.0), "Langevin": lambda: Langevin(2.0, 600.0, 0.01, seed=1),
                   "MTK NPT": lambda: MTK(2.0, 600.0, 1.0, tdamp_fs=100.0, pdamp_fs=500.0, isotropic=False)}
    rows = []
    for name, make in integrators.items():
        final, resident = {}, True
        for where in ("cpu", device):
            atoms = alloy(4)
            thermalize_momenta(atoms, temperature_K=600, rng=np.random.default_rng(0), comm=DummyMPI())
            system = MDSystem.from_atoms(build().to(where), atoms, skin=0.5, comm="serial")
            run(system, make(), steps, thermo_every=steps)
            final[where] = system.gather("positions")
            resident &= all(str(t.device) == str(system.device) for t in (*system.atoms.values(), system.forces))
        deviation = float(np.abs(final["cpu"] - final[device]).max())
        rows.append((f"MD on {device}: {name}", f"{steps} steps, SchNet float64, {len(atoms)} atoms",
                     f"max position deviation from CPU {deviation:.1e} A, atoms resident {resident}",
                     deviation <= 1e-6 and resident))
    return rows


# ----------------------------------------------------------------------------- 4. training on the device
TRAINING_RUNS = {"one process": (1, "data"), "data-parallel, 2 ranks": (2, "data"),
                 "pipeline S=2 (auto), 2 ranks": (2, "pipeline"),
                 "pipeline 2 replicas x 2 stages, 4 ranks": (4, "pipeline")}
TRAINING_METRICS = ("train_loss", "val_loss", "energy_mae", "forces_mae", "stress_mae")


def training_config(data, out, parallel, epochs=3):
    return {"data": {"train": str(data), "validation_fraction": 0.125},
            "model": {"name": "SchNet", "cutoff": 4.5, "hyperparameters": {"features": 32, "layers": 6},
                      "dtype": "float64"},
            "loss": {"energy_weight": 1.0, "forces_weight": 10.0, "stress_weight": 1.0}, "ema_decay": 0.9,
            "schedule": {"name": "none"}, "epochs": epochs, "batch_size": 4, "seed": 0, "parallel": parallel,
            "pipeline": {"stages": 2, "microbatches": 4, "schedule": "auto"},
            "output": {"directory": str(out), "overwrite": True}}


def training_checks(device, env, epochs=3, ranks=None):
    """Each ``TRAINING_RUNS`` run of ``mlip-train`` (``ranks``: those on these rank counts alone) on ``device`` (ranks
    share the GPU), ``epochs`` epochs, against one process on the CPU: every epoch's metrics (relative, 1e-9)."""
    import csv
    import tempfile

    import numpy as np
    import yaml
    from ase.io import write

    def train(ranks, parallel, where, tmp, name):
        job = tmp / f"{name}.yaml"
        job.write_text(yaml.safe_dump(training_config(tmp / "cu.extxyz", tmp / name, parallel, epochs)))
        cmd = train_command(ranks, job)
        cuda = {} if where == "cuda" else {"CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, **cuda))
        if proc.returncode != 0:
            print(f"--- {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            return None, (proc.stdout + proc.stderr).strip().splitlines()[-1:]
        with open(tmp / name / "metrics.csv") as f:
            return [{c: float(row[c]) for c in TRAINING_METRICS} for row in csv.DictReader(f)], None

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write(tmp / "cu.extxyz", cu_emt_frames(16, 32), format="extxyz")
        reference, error = train(1, "data", "cpu", tmp, "reference")
        if reference is None:
            return [("training", "one process on the CPU (the reference)", str(error), False)]
        for k, (label, (run_ranks, parallel)) in enumerate(TRAINING_RUNS.items()):
            if device == "cpu" and run_ranks == 1 or ranks is not None and run_ranks not in ranks:
                continue  # (one process on the CPU: that is the reference itself)
            metrics, error = train(run_ranks, parallel, device, tmp, f"run{k}")
            setting = f"{label}, SchNet float64, {epochs} epochs"
            if metrics is None:
                rows.append((f"mlip-train on {device}", setting, str(error)[:120], False))
                continue
            worst = float(np.max([abs(m[c] - r[c]) / max(abs(r[c]), 1e-300)  # np.max: a NaN is the worst
                                  for m, r in zip(metrics, reference) for c in TRAINING_METRICS] or [np.nan]))
            rows.append((f"mlip-train on {device}", setting,
                         f"largest relative difference of the epoch metrics from one CPU process {worst:.1e}",
                         worst <= 1e-9 and len(metrics) == len(reference)))
    return rows


# ----------------------------------------------------------------------------- 5. throughput
def throughput_worker(args):
    """Under a launcher: MD steps/s of a float32 SchNet; rank 0 prints one JSON line."""
    import numpy as np
    import torch
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.parallel import DummyMPI

    import mlip_parallel
    from md.engine import MDSystem, run
    from md.integrators import VelocityVerlet

    backend, atoms, model = schnet_worker_setup(args.cells)
    device = mlip_parallel.rank_device(backend) if not args.cpu else torch.device("cpu")
    model.to(device)
    thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(0), comm=DummyMPI())
    system = MDSystem.from_atoms(model, atoms, skin=1.0)
    integrator = VelocityVerlet(2.0)
    run(system, integrator, 2, thermo_every=2)  # warm-up (allocations, kernels)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_hwm()
    halo0 = system.timers["halo"]
    backend.barrier()
    start = time.perf_counter()
    run(system, integrator, args.steps, thermo_every=args.steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    halo = (system.timers["halo"] - halo0) / args.steps
    memory = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else status_mb("VmHWM")
    layer = []  # one layer's feature exchange (64 floats per ghost row), every rank ready
    features = torch.randn(system.sub.comm.n_local, 64, device=device)
    for _ in range(10):
        backend.barrier()
        t0 = time.perf_counter()
        system.sub.comm.forward_comm(features)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        layer.append(time.perf_counter() - t0)
    halos, memories, layers = backend.allgather(halo), backend.allgather(memory), backend.allgather(float(np.median(layer)))
    if backend.rank == 0:
        print(json.dumps({"atoms": len(atoms), "seconds_per_step": seconds / args.steps, "halo": max(halos),
                          "layer": max(layers), "memory_mb": max(memories), "library": backend.library}))


def throughput(sizes, steps, cpu):
    rows = []
    for cells in sizes:
        for ranks in (1, 2):
            for backend, launcher in BACKENDS.items():
                if ranks == 1 and backend == "torch":
                    continue  # one rank: no messages, the backends do not differ
                options = ["--cells", cells, "--steps", steps] + (["--cpu"] if cpu else [])
                try:
                    r = launch(ranks, __file__, options, launcher=launcher, backend=backend)
                except RuntimeError as exc:
                    print(exc, flush=True)
                    rows.append((f"MD throughput, {cells} cells", f"{ranks} rank(s), {backend} backend",
                                 str(exc).splitlines()[-1][:120], False))
                    continue
                label = "one process" if ranks == 1 else f"{ranks} ranks, {r['library'].split(' (')[0]}"
                rows.append((f"MD throughput, {r['atoms']} atoms", label,
                             f"{r['atoms'] / r['seconds_per_step']:,.0f} atom-steps/s, halo "
                             f"{1e3 * r['halo']:.1f} of {1e3 * r['seconds_per_step']:.1f} ms/step "
                             f"({1e3 * r['layer']:.2f} ms per layer exchange), peak {r['memory_mb']:,.0f} MB/rank",
                             None))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="use the CPU as the device (no GPU needed)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="self-check rank counts")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="throughput sizes in cubic fcc cells per direction (4 atoms each); default "
                             "14 and 29 (11 k, 98 k atoms) on a GPU, 10 and 15 (4 k, 13.5 k) on the CPU")
    parser.add_argument("--steps", type=int, default=None, help="timed MD steps per throughput run")
    parser.add_argument("--md-steps", type=int, default=100, help="steps of the device-vs-CPU MD check")
    parser.add_argument("--train-epochs", type=int, default=3, help="epochs of each mlip-train run")
    parser.add_argument("--models", nargs="+", help="the models checked on the device (default: every one installed: "
                                                    "SchNet, PaiNN, NequIP, SevenNet-0, MACE)")
    parser.add_argument("--train-ranks", type=int, nargs="+", help="the mlip-train runs on these rank counts alone "
                                                                   "(default: every run, on 1, 2 and 4)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["self-check", "models", "md", "training", "throughput"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cells", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return throughput_worker(args)

    import torch
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device (torch.cuda.is_available() is False); "
                 "run with --cpu to check the CPU path")
    device = "cpu" if args.cpu else "cuda"
    sizes = args.sizes or ([10, 15] if args.cpu else [14, 29])
    steps = args.steps or (5 if args.cpu else 20)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    print(f"mlip-parallel gpu_check on {torch.cuda.get_device_name() if device == 'cuda' else 'the CPU'}, "
          f"torch {torch.__version__}", flush=True)
    start, rows = time.perf_counter(), []
    sections = {"self-check": lambda: self_checks(args.ranks, env), "models": lambda: model_checks(device, args.models),
                "md": lambda: md_check(device, args.md_steps),
                "training": lambda: training_checks(device, env, args.train_epochs, args.train_ranks),
                "throughput": lambda: throughput(sizes, steps, args.cpu)}
    for name, section in sections.items():
        if name not in args.skip:
            try:
                rows += section()
            except Exception as exc:  # noqa: BLE001 (one table: a broken section is a FAILED row)
                traceback.print_exc()
                rows.append((name, "section", f"{type(exc).__name__}: {exc}"[:160], False))
            print(f"  {name} done ({time.perf_counter() - start:.0f} s)", flush=True)
    widths = [max(len(str(r[k])) for r in rows) for k in range(3)]
    print(f"\n{'check':{widths[0]}s}  {'setting':{widths[1]}s}  {'result':{widths[2]}s}  verdict")
    for check, setting, result, ok in rows:
        verdict = "-" if ok is None else ("OK" if ok else "FAILED")
        print(f"{check:{widths[0]}s}  {setting:{widths[1]}s}  {result:{widths[2]}s}  {verdict}")
    failed = [r for r in rows if r[3] is False]
    print(f"\n{len(rows)} rows, {len(failed)} failed, {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
