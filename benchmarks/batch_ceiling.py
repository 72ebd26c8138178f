"""How far batching can go for one model on this machine: the ASE loop (our ``MLIPCalculator``, a structure per
call) against ``md.batch`` with the graph size found while running (``BatchSizer``) and with fixed sizes, and against
the model alone on graphs of the fixed sizes prepared beforehand (no neighbour lists, optimizer or bookkeeping: the
ceiling of any batching on this device). Single points and ASE FIRE relaxations of rattled, strained fcc Cu cells
(benchmarks/batch.py's structures), one thread, one process, the methods in turn ``--rounds`` times (medians; this
host is noisy: only side-by-side ratios count). Prints milliseconds per structure and the loop's time over each.

    python benchmarks/batch_ceiling.py [--model cu-emt] [--atoms 8,32] [--structures 300] [--relax-structures 40]
        [--sizes 64,128,256] [--rounds 3]
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cu-emt", help="a model spec (potentials.load_model)")
    parser.add_argument("--atoms", default="8,32")
    parser.add_argument("--structures", type=int, default=300)
    parser.add_argument("--relax-structures", type=int, default=40)
    parser.add_argument("--sizes", default="64,128,256", help="fixed graph sizes (atoms)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from ase.io import read
    from ase.optimize import FIRE

    import potentials
    from batch import write_structures
    from md.batch import relax_many, single_points
    from md.calculator import MLIPCalculator
    from potentials.batch import evaluate_batch, leading_group, prepare_batch, select

    low, high = (int(n) for n in args.atoms.split(","))
    sizes = [int(n) for n in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        write_structures(Path(tmp) / "s.extxyz", args.structures, low, high, seed=3)
        write_structures(Path(tmp) / "r.extxyz", args.relax_structures, low, high, seed=4)
        structures, relaxing = read(Path(tmp) / "s.extxyz", ":"), read(Path(tmp) / "r.extxyz", ":")
    model = potentials.load_model(args.model)
    calculator = MLIPCalculator(model)

    def loop(task):
        for atoms in (relaxing if task == "relax" else structures):
            atoms = atoms.copy()
            atoms.calc = calculator
            if task == "relax":
                FIRE(atoms, logfile=None).run(fmax=0.05, steps=30)
            else:
                atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()

    def batched(task, size):
        if task == "relax":
            relax_many(model, [a.copy() for a in relaxing], fmax=0.05, max_steps=30, max_atoms=size)
        else:
            single_points(model, [a.copy() for a in structures], max_atoms=size)

    whole = prepare_batch(model, structures)
    edges = np.bincount(whole.edge_batch, minlength=whole.size)

    def graphs(size):  # consecutive structures up to ``size`` atoms each, as predict_many groups them, prepared once
        parts, first = [], 0
        while first < whole.size:
            last = first + leading_group(model, whole.sizes[first:], edges[first:], size, float("inf"))
            parts.append(select(whole, range(first, last)))
            first = last
        return parts

    prepared = {size: graphs(size) for size in sizes}
    methods = {("single_point", "ASE loop"): lambda: loop("single_point"),
               ("single_point", "batched, sizer"): lambda: batched("single_point", None)}
    methods.update({("single_point", f"batched, {s} atoms"): (lambda s=s: batched("single_point", s)) for s in sizes})
    methods.update({("single_point", f"model alone, {s} atoms"):
                    (lambda s=s: [evaluate_batch(model, b) for b in prepared[s]]) for s in sizes})
    methods.update({("relax", "ASE loop"): lambda: loop("relax"), ("relax", "batched, sizer"): lambda: batched("relax",
                                                                                                              None)})
    methods.update({("relax", f"batched, {s} atoms"): (lambda s=s: batched("relax", s)) for s in sizes})
    single_points(model, structures[:2])  # warm-up
    seconds = {key: [] for key in methods}
    for _ in range(args.rounds):
        for key, run in methods.items():
            start = time.perf_counter()
            run()
            seconds[key].append(time.perf_counter() - start)
    print(f"{args.model}, {low}-{high} atoms: {len(structures)} single points, {len(relaxing)} FIRE relaxations "
          f"(fmax 0.05, <= 30 steps); medians of {args.rounds} rounds")
    for (task, name), times in seconds.items():
        count = len(relaxing if task == "relax" else structures)
        ms = statistics.median(times) / count * 1e3
        loop_ms = statistics.median(seconds[(task, "ASE loop")]) / count * 1e3
        print(f"{task:12s} {name:24s} {ms:9.3f} ms per structure   ASE loop / this {loop_ms / ms:5.2f}")


if __name__ == "__main__":
    main()
