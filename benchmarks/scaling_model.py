"""A weak-scaling model fitted from measured runs: per-atom compute and per-ghost communication costs.

    python benchmarks/scaling_model.py [--cells 6] [--steps 6] [--ranks 1 2 3 4] [--cores N]

1. Measure: MD with a float32 SchNet (layerwise halo) on P = 1..4 ranks, weak scaling (``cells``³ cubic
   fcc cells per rank, the box stretched along z so that each rank owns one cube). Each rank reports its
   owned atoms n, ghosts g, swaps and its seconds per step in the force, halo, neighbour and integrate
   phases.
2. Fit, by least squares over every rank of every run:
       compute(rank)   = a · n                    (force + neighbour + integrate phases)
       exchange(rank)  = b · g · w/F + c · swaps  (one exchange of w floats per row and its reverse, timed
                                                   alone after a barrier, w = 4 and F: bytes ∝ ghosts × w,
                                                   latency per swap)
       allreduce       = d · log2(P)
   and a step = compute + LAYERS exchanges + 3 allreduces. Ranks beyond the machine's cores share them:
   measured times are scaled by the core share min(1, cores / P) before fitting and back when predicting.
3. Check: predicted step time (slowest rank: compute + halo) against the measured one at each P.
4. Predict weak-scaling efficiency T(1)/T(P) at 8–1,024 ranks for cubic subdomains of n atoms: ghosts of a
   cube of side L = (n/ρ)^(1/3) with a shell r (cutoff + skin) split in 1, 2 or 3 dimensions (P = 2, 4,
   ≥ 8), 2 swaps per split dimension per exchange. It assumes the measured interconnect everywhere; across
   nodes, latency and bandwidth are worse (pass --halo-factor to scale b and c beyond --ranks-per-node).
   Anchors: SevenNet reports > 80 % weak-scaling efficiency on 32 GPUs, Allegro 70 % on 5,120.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch, schnet_worker_setup  # noqa: E402

CUTOFF, SKIN, FEATURES, LAYERS = 5.0, 1.0, 64, 3
ALLREDUCES = 3  # global sums per MD step: energy/virial, the rebuild decision, thermo
WIDTHS = (4, FEATURES)  # floats per row in the timed exchanges: separates latency from bytes
DENSITY = 4 / 3.61**3  # fcc Cu, atoms/Å³


def worker(args):
    import numpy as np
    import torch
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.parallel import DummyMPI

    import mlip_parallel
    from md.engine import PHASES, MDSystem, run
    from md.integrators import VelocityVerlet

    P = mlip_parallel.get_backend().size  # one cube of cells per rank, stacked along z
    backend, atoms, model = schnet_worker_setup((args.cells, args.cells, args.cells * P), FEATURES, CUTOFF, LAYERS)
    thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(0), comm=DummyMPI())
    grid = (1, 1, backend.size)
    system = MDSystem.from_atoms(model, atoms, skin=SKIN, grid=grid)
    integrator = VelocityVerlet(2.0)
    run(system, integrator, 2, thermo_every=2)  # warm-up
    before = dict(system.timers)
    backend.barrier()
    start = time.perf_counter()
    run(system, integrator, args.steps, thermo_every=args.steps)
    seconds = (time.perf_counter() - start) / args.steps
    phases = {k: (system.timers[k] - before[k]) / args.steps for k in PHASES}
    halo = system.sub.comm
    pair = {width: [] for width in WIDTHS}
    latency = []
    for _ in range(5):  # one feature exchange and its reverse, every rank ready (no waiting on a slower peer)
        for width in WIDTHS:
            features = torch.randn(halo.n_local, width)
            backend.barrier()
            t0 = time.perf_counter()
            halo.reverse_comm(halo.forward_comm(features))
            pair[width].append(time.perf_counter() - t0)
        backend.barrier()
        t0 = time.perf_counter()
        backend.allreduce(np.zeros(10))
        latency.append(time.perf_counter() - t0)
    mine = {"n": halo.n_local, "g": halo.n_ghost, "swaps": sum(s.dest not in (None, backend.rank) for s in halo.plan),
            "pair": {w: float(np.median(t)) for w, t in pair.items()}, "allreduce": float(np.median(latency)), **phases}
    ranks = backend.allgather(mine)
    if backend.rank == 0:
        print(json.dumps({"P": backend.size, "seconds_per_step": seconds, "ranks": ranks}))


class Costs(NamedTuple):
    a: float  # s per owned atom and step: force + neighbour + integrate phases
    b: float  # s per ghost row of FEATURES floats, one exchange and its reverse
    c: float  # s per swap with another rank (latency), one exchange and its reverse
    d: float  # s per allreduce and log2(P)


def fit(runs, cores) -> Costs:
    """Least squares over every rank of every run; times of oversubscribed runs scaled by the core share."""
    import numpy as np

    rows_a, t_a, rows_h, t_h, rows_d, t_d = [], [], [], [], [], []
    for run in runs:
        share = min(1.0, cores / run["P"])
        for r in run["ranks"]:
            rows_a.append([r["n"]])
            t_a.append((r["force"] + r["neighbour"] + r["integrate"]) * share)
            if run["P"] > 1:
                for width, t in r["pair"].items():
                    rows_h.append([r["g"] * int(width) / FEATURES, r["swaps"]])
                    t_h.append(t * share)
                rows_d.append([np.log2(run["P"])])
                t_d.append(r["allreduce"] * share)
    solve = lambda rows, t: np.linalg.lstsq(np.array(rows, float), np.array(t), rcond=None)[0]  # noqa: E731
    a = solve(rows_a, t_a)[0]
    b, c = solve(rows_h, t_h) if rows_h else (0.0, 0.0)
    d = solve(rows_d, t_d)[0] if rows_d else 0.0
    return Costs(a, max(b, 0.0), max(c, 0.0), max(d, 0.0))


def step_time(costs: Costs, P: int, n: float, ghosts: float, swaps: int) -> float:
    """Seconds per MD step of a rank: compute, LAYERS exchange pairs (positions and the features between
    layers, forward and reverse) and ALLREDUCES global sums."""
    import numpy as np

    halo = LAYERS * (costs.b * ghosts + costs.c * swaps) if P > 1 else 0.0
    return costs.a * n + halo + ALLREDUCES * costs.d * np.log2(P)


def predicted_step(run, costs, cores):
    share = min(1.0, cores / run["P"])
    return max(step_time(costs, run["P"], r["n"], r["g"], r["swaps"]) for r in run["ranks"]) / share


def cube_ghosts(n, dims_split, shell=CUTOFF + SKIN):
    """Ghost atoms of a cubic subdomain of ``n`` atoms split along ``dims_split`` dimensions."""
    side = (n / DENSITY) ** (1 / 3)
    return DENSITY * side ** (3 - dims_split) * ((side + 2 * shell) ** dims_split - side**dims_split)


def efficiency(P, n, costs, ranks_per_node, halo_factor):
    split = 0 if P == 1 else 1 if P == 2 else 2 if P < 8 else 3
    if P > ranks_per_node:
        costs = costs._replace(b=costs.b * halo_factor, c=costs.c * halo_factor, d=costs.d * halo_factor)
    return costs.a * n / step_time(costs, P, n, cube_ghosts(n, split), 2 * split)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=6, help="cubic fcc cells per rank and direction (6 → 864 atoms)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="cores the ranks share")
    parser.add_argument("--atoms-per-rank", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--halo-factor", type=float, default=1.0,
                        help="multiply the halo costs by this beyond one node (slower interconnect)")
    parser.add_argument("--launcher", default="mpiexec", choices=["mpiexec", "torchrun"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    runs = [launch(P, __file__, ["--cells", args.cells, "--steps", args.steps], launcher=args.launcher)
            for P in args.ranks]
    costs = fit(runs, args.cores)
    print(f"SchNet F={FEATURES} L={LAYERS} rc={CUTOFF} A (+{SKIN} A skin), float32, weak scaling "
          f"{runs[0]['ranks'][0]['n']} atoms/rank, {args.cores} core(s), {args.launcher}")
    print(f"fitted: compute {1e6 * costs.a:.1f} us/atom; halo (one exchange + reverse, {FEATURES} floats) "
          f"{1e6 * costs.b:.2f} us/ghost + {1e6 * costs.c:.0f} us/swap; allreduce {1e6 * costs.d:.0f} us x log2(P)")
    print(f"{'P':>3s} {'ghosts/rank':>12s} {'measured s/step':>16s} {'predicted':>10s} {'error':>7s}")
    for run in runs:
        measured, predicted = run["seconds_per_step"], predicted_step(run, costs, args.cores)
        ghosts = max(r["g"] for r in run["ranks"])
        print(f"{run['P']:3d} {ghosts:12d} {measured:16.3f} {predicted:10.3f} {100 * (predicted / measured - 1):+6.1f}%"
              + ("  (oversubscribed)" if run["P"] > args.cores else ""))
    sizes = args.atoms_per_rank
    print(f"\npredicted weak-scaling efficiency T(1)/T(P), cubic subdomains, {args.ranks_per_node} ranks/node, "
          f"halo x{args.halo_factor:g} across nodes")
    print(f"{'P':>6s}" + "".join(f"{f'{n:,} atoms/rank':>20s}" for n in sizes))
    for P in (8, 32, 128, 1024):
        print(f"{P:6d}" + "".join(f"{100 * efficiency(P, n, costs, args.ranks_per_node, args.halo_factor):19.0f}%"
                                  for n in sizes))
    print("anchors: SevenNet > 80 % on 32 GPUs; Allegro 70 % on 5,120 GPUs")


if __name__ == "__main__":
    main()
