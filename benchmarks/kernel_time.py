"""The kernel's share of an evaluation's CPU time, by glibc malloc setting: one process, one thread, rattled fcc Cu,
energy + forces + stress through MLIPCalculator at its default budget (one pass where it fits, chunks where not).

Freed tensors' memory that glibc hands back to the system is faulted in again at the next allocation: every
large temporary costs page faults, system time. Settings (each in a fresh process, one after the other):
  default   glibc's own thresholds (MLIPCalculator(keep_freed_memory=False))
  kept      ``mlip_parallel.allocator.keep_freed_memory``: blocks up to 32 MiB from the heap, trimmed only
            beyond 2 GiB (MLIPCalculator's default)
Prints per call: wall seconds, user and system CPU seconds, the system share (goal <= 5 %), minor page faults,
and the peak resident size. ``--ranks P``: under mpiexec, the structure decomposed over P ranks (CPU seconds and
faults summed over the ranks, wall and peak the largest rank's); ``--settings kept``: that setting alone.

    python benchmarks/kernel_time.py [--atoms 4000,97556] [--model schnet|cu-emt|mace-medium] [--calls 2]
        [--ranks 1] [--settings default,kept]
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import cu_crystal  # noqa: E402

CELLS = {500: 5, 4000: 10, 32000: 20, 97556: 29, 108000: 30}
SETTINGS = ("default", "kept")


def build(name, file=None):
    """The model: SchNet F=64, 3 layers, cutoff 5 Å (float32), this package's cu-emt (PaiNN, float64), or a random
    MACE of MACE-MP-0-medium's shape (float32, 6 Å; ``file``: written by ``mace_scaling.make_model``)."""
    import potentials

    if name == "cu-emt":
        return potentials.load_model("cu-emt", checkpoint_dtype="float64")
    if name == "mace-medium":
        return potentials.MACE(file)
    return potentials.SchNet(["Cu"], cutoff=5.0, features=64, layers=3, seed=0)


def worker(args) -> None:
    import torch

    from md.calculator import MLIPCalculator

    torch.set_num_threads(1)
    atoms = cu_crystal(CELLS[args.atoms])
    atoms.calc = MLIPCalculator(build(args.model, args.file), keep_freed_memory=args.setting == "kept")

    def call():
        atoms.calc.reset()
        atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    call()  # warm-up: the first call's allocations are fresh in every setting
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.calls):
        call()
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
    n = args.calls
    print(json.dumps({"wall": wall / n, "user": (after.ru_utime - before.ru_utime) / n,
                      "system": (after.ru_stime - before.ru_stime) / n,
                      "faults": (after.ru_minflt - before.ru_minflt) / n, "peak_gb": after.ru_maxrss / 1e6}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", default="4000,97556", help=f"comma-separated, of {list(CELLS)}")
    parser.add_argument("--model", default="schnet", choices=["schnet", "cu-emt", "mace-medium"])
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--setting", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.atoms = int(args.atoms)
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "mace-medium":
            from mace_scaling import make_model

            args.file = str(Path(tmp) / "mace-medium.model")
            make_model(args.file, "float32", hidden="128x0e+128x1o")
        run(args)


def run(args) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for key in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_"):
        env.pop(key, None)
    print(f"{args.model}, {args.ranks} rank(s) of one thread, energy+forces+stress per call (mean of {args.calls} "
          f"after a warm-up); system share = system / (user + system) CPU, goal <= 5 %", flush=True)
    launch = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(args.ranks)] if args.ranks > 1 else []
    for n in (int(a) for a in args.atoms.split(",")):
        for setting in args.settings.split(","):
            done = subprocess.run(launch + [sys.executable, __file__, "--worker", "--atoms", str(n), "--model",
                                            args.model, "--calls", str(args.calls), "--setting", setting]
                                  + (["--file", args.file] if args.file else []),
                                  capture_output=True, text=True, env=env)
            if done.returncode:
                print(f"{n:7d} atoms {setting:8s}: FAILED\n{done.stderr[-2000:]}", flush=True)
                continue
            ranks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            r = {key: sum(rank[key] for rank in ranks) for key in ("user", "system", "faults")}
            r.update(wall=max(rank["wall"] for rank in ranks), peak_gb=max(rank["peak_gb"] for rank in ranks))
            share = r["system"] / (r["user"] + r["system"])
            print(f"{n:7d} atoms {setting:8s}: wall {r['wall']:8.2f} s  user {r['user']:8.2f} s  system "
                  f"{r['system']:7.2f} s  system share {100 * share:5.1f} %  minor faults {r['faults']:10.3g}  "
                  f"peak {r['peak_gb']:5.2f} GB", flush=True)


if __name__ == "__main__":
    main()
