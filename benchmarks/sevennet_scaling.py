"""SevenNet-0 on 2 ranks (mlip_parallel layerwise) vs sevenn's own SevenNetCalculator on one process,
one thread each, rattled diamond Si (≥ 512 atoms). Launches alternate; prints medians and the ratio
(target ≥ 1.8×). Needs the sevenn extra.

    python benchmarks/sevennet_scaling.py [--cells 4] [--repeat 2] [--rounds 1]
"""
import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch  # noqa: E402

warnings.filterwarnings("ignore")


def silicon(cells):
    from ase.build import bulk

    atoms = bulk("Si", "diamond", a=5.43, cubic=True).repeat(cells)
    atoms.rattle(0.05, seed=0)
    return atoms


def worker(args):
    import torch

    torch.set_num_threads(1)
    atoms = silicon(args.cells)
    if args.which == "sevenn":
        from sevenn.calculator import SevenNetCalculator

        atoms.calc = SevenNetCalculator("7net-0")

        def run():
            atoms.calc.reset()
            return atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
        rank, barrier = 0, lambda: None
    else:
        import mlip_parallel
        from potentials.adapters.sevennet import SevenNet

        model, backend = SevenNet("7net-0"), mlip_parallel.get_backend()
        rank, barrier = backend.rank, backend.barrier

        def run():
            return mlip_parallel.evaluate(model, atoms)
    run()  # warm-up
    times = []
    for _ in range(args.repeat):
        barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"n_atoms": len(atoms), "time": statistics.median(times)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=4, help="cubic diamond cells per direction (4 → 512 atoms)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--which", choices=["sevenn", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    flags = ["--cells", args.cells, "--repeat", args.repeat]
    runs = {"sevenn": [], "ours": []}
    for _ in range(args.rounds):
        runs["sevenn"].append(launch(1, __file__, flags + ["--which", "sevenn"]))
        runs["ours"].append(launch(2, __file__, flags + ["--which", "ours"]))
    t_ref = statistics.median(r["time"] for r in runs["sevenn"])
    t_ours = statistics.median(r["time"] for r in runs["ours"])
    print(f"SevenNet-0, {runs['ours'][0]['n_atoms']} atoms rattled diamond Si, one thread per process")
    print(f"  SevenNetCalculator, 1 process      : {t_ref:8.2f} s per energy+forces+stress")
    print(f"  mlip_parallel layerwise, 2 ranks   : {t_ours:8.2f} s")
    print(f"speed-up = {t_ref / t_ours:.2f}x (target >= 1.8x)")


if __name__ == "__main__":
    main()
