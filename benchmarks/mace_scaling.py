"""A MACE model the size of MACE-MP-0 small (random weights: 128x0e, max_L 0, max_ell 3, correlation 3, two
interactions, r_max 6 Å, 89 elements) on rattled fcc Cu, one thread per process: MACE's own MACECalculator
and ours (potentials.MACE through mlip_parallel.evaluate) on one process, their calls alternating, then
ours on 2 ranks; the two launches alternate --rounds times. Each times energy + forces + stress per call
(median of --repeat after a warm-up); prints the medians and the ratios (targets: ours on 1 rank /
MACECalculator ≤ 1.05, 2 ranks ≥ 1.8× 1 rank).
Needs the mace extra.

    python benchmarks/mace_scaling.py [--cells 8] [--repeat 3] [--rounds 2] [--dtype float32]
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cu_crystal, launch  # noqa: E402

warnings.filterwarnings("ignore")


def make_model(path, dtype):
    """Write a random MACE-MP-0-small-sized model to ``path`` (torch.save, as MACE's training does)."""
    import numpy as np
    import torch
    from e3nn import o3
    from mace import modules

    torch.set_default_dtype(getattr(torch, dtype))
    torch.manual_seed(0)
    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    model = modules.ScaleShiftMACE(
        r_max=6.0, num_bessel=8, num_polynomial_cutoff=5, max_ell=3, interaction_cls=block,
        interaction_cls_first=block, num_interactions=2, num_elements=89, hidden_irreps=o3.Irreps("128x0e"),
        MLP_irreps=o3.Irreps("16x0e"), gate=torch.nn.functional.silu, atomic_energies=-np.linspace(1, 5, 89),
        avg_num_neighbors=60.0, atomic_numbers=list(range(1, 90)), correlation=3, radial_MLP=[64, 64, 64],
        atomic_inter_scale=1.0, atomic_inter_shift=0.0)
    torch.save(model, path)


def worker(args):
    """``--which pair`` (one process): MACECalculator and ours on one rank, calls alternating; ``--which
    ours`` (any ranks): ours alone. Prints {"n_atoms", "mace", "ours"}: median seconds per call."""
    import torch

    import mlip_parallel
    import potentials

    torch.set_num_threads(1)
    atoms = cu_crystal(args.cells)
    model, backend = potentials.MACE(args.model), mlip_parallel.get_backend()
    calls = {"ours": lambda: mlip_parallel.evaluate(model, atoms)}
    if args.which == "pair":
        from mace.calculators import MACECalculator

        theirs = atoms.copy()
        theirs.calc = MACECalculator(model_paths=args.model, device="cpu", default_dtype=args.dtype)

        def mace_call():
            theirs.calc.reset()
            return theirs.get_potential_energy(), theirs.get_forces(), theirs.get_stress()
        calls["mace"] = mace_call
    for call in calls.values():
        call()  # warm-up
    times = {name: [] for name in calls}
    for _ in range(args.repeat):
        for name, call in calls.items():
            backend.barrier()
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    if backend.rank == 0:
        print(json.dumps({"n_atoms": len(atoms), **{k: statistics.median(v) for k, v in times.items()}}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=8, help="cubic fcc cells per direction (8 → 2,048 atoms)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--which", choices=["pair", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mace-mp-0-small-sized.model"
        make_model(path, args.dtype)
        flags = ["--cells", args.cells, "--repeat", args.repeat, "--dtype", args.dtype, "--model", path]
        rounds = []
        for _ in range(args.rounds):  # alternating launches; in the one-process launch, alternating calls
            pair = launch(1, __file__, flags + ["--which", "pair"])
            rounds.append((pair, launch(2, __file__, flags + ["--which", "ours"])))
    mace = statistics.median(p["mace"] for p, _ in rounds)
    one = statistics.median(p["ours"] for p, _ in rounds)
    two = statistics.median(t["ours"] for _, t in rounds)
    print(f"MACE-MP-0-small-sized model ({args.dtype}), {rounds[0][0]['n_atoms']} atoms rattled fcc Cu, one thread "
          f"per process; seconds per energy+forces+stress, medians of {args.repeat} calls per launch, "
          f"{args.rounds} rounds:")
    for k, (p, t) in enumerate(rounds):
        print(f"  round {k + 1}: MACECalculator {p['mace']:.3f}, ours 1 rank {p['ours']:.3f} (ratio "
              f"{p['ours'] / p['mace']:.3f}), ours 2 ranks {t['ours']:.3f} (speed-up {p['ours'] / t['ours']:.2f}x)")
    print(f"1 rank / MACECalculator = {one / mace:.3f} (target <= 1.05, goal <= 1.0)")
    print(f"2 ranks speed-up over 1 rank = {one / two:.2f}x (target >= 1.8x); over MACECalculator {mace / two:.2f}x")


if __name__ == "__main__":
    main()
