"""A committee of K models in MD against K single runs: per-step time of mlip-md's engine with a committee of K = 2,
4 and 8 members (one decomposition, neighbour list and ghost set per step; each member its own forward, halo
exchanges and backward, one after another) over K × the per-step time of one member alone (goal: at most 0.9), and
the peak memory per atom of a committee's force evaluation against one member's. Members are SchNets of one
architecture (F=64, 3 layers, cutoff 5 Å: different seeds, as fine-tunes of one model), float32, on rattled fcc Cu;
one thread per rank; in each process the single run and the committees alternate, --rounds times, medians printed.

With --batched (one process) it also measures the batched call the committee could make for members of one
architecture: their weights stacked and the forward and force backward vmapped over them (torch.func), against the
members one after another on the same graph (the same forces to float32 rounding).

    python benchmarks/committee.py [--cells 5] [--steps 5] [--rounds 2] [--ranks 1 2] [--batched]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cu_crystal, launch, reset_hwm, status_mb  # noqa: E402
from pipeline import trimmed_rss  # noqa: E402

SIZES = (2, 4, 8)


def members(count, cutoff=5.0):
    import torch

    import potentials

    out = []
    for seed in range(count):
        torch.manual_seed(seed)
        out.append(potentials.SchNet(["Cu"], cutoff=cutoff, features=64, layers=3))
    return out


def md_step_seconds(model, atoms, steps) -> float:
    """Seconds per MD step (velocity Verlet, the engine mlip-md runs) of ``model`` from ``atoms``, after the
    first force evaluation."""
    from md.engine import MDSystem, run
    from md.integrators import VelocityVerlet

    system = MDSystem.from_atoms(model, atoms, skin=0.5)
    system.backend.barrier()
    start = time.perf_counter()
    run(system, VelocityVerlet(2.0), steps, thermo_every=steps)
    return time.perf_counter() - start


def force_memory_mb(model, atoms) -> float:
    """Peak resident memory (MB) of one force evaluation above the trimmed resident size before it."""
    from md.engine import MDSystem

    system = MDSystem.from_atoms(model, atoms, skin=0.5)
    base = trimmed_rss()
    reset_hwm()
    system.compute_forces()
    peak = status_mb("VmHWM") - base
    del system
    return peak


def worker(args):
    import numpy as np
    import torch
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.parallel import DummyMPI

    import mlip_parallel
    from potentials.committee import Committee

    torch.set_num_threads(1)
    backend = mlip_parallel.get_backend()
    atoms = cu_crystal(args.cells)
    MaxwellBoltzmannDistribution(atoms, temperature_K=600, rng=np.random.default_rng(0), comm=DummyMPI())
    pool = members(max(SIZES))
    cases = {"single": pool[0], **{f"K={k}": Committee(pool[:k]) for k in SIZES}}
    for model in cases.values():  # warm-up
        md_step_seconds(model, atoms, 1)
    seconds = {name: [] for name in cases}
    for _ in range(args.repeat):
        for name, model in cases.items():
            seconds[name].append(md_step_seconds(model, atoms, args.steps) / args.steps)
    memory = {name: force_memory_mb(model, atoms) for name, model in cases.items()}
    memory = {name: max(backend.allgather(mb)) for name, mb in memory.items()}
    seconds = {name: max(backend.allgather(statistics.median(s))) for name, s in seconds.items()}
    result = {"n_atoms": len(atoms), "ranks": backend.size, "seconds": seconds, "memory_mb": memory}
    if args.batched and backend.size == 1:
        result["batched"] = {f"K={k}": batched_ratio(pool[:k], atoms, args.repeat) for k in SIZES}
    if backend.rank == 0:
        print(json.dumps(result))


def batched_ratio(models, atoms, repeat) -> dict:
    """Seconds of the forces of ``models`` vmapped over their stacked weights / one after another, on one graph
    of ``atoms`` (one process, no halo), and the largest force difference between the two."""
    import copy

    import torch
    from torch.func import functional_call, grad, stack_module_state, vmap

    from vesin import NeighborList

    from potentials.graph import AtomGraph

    i, j, shifts = NeighborList(cutoff=models[0].cutoff, full_list=True).compute(
        points=atoms.positions, box=atoms.cell[:], periodic=True, quantities="ijS")
    dtype = torch.float64  # edge vectors in float64, as potentials.predict builds them
    positions = torch.tensor(atoms.positions, dtype=dtype)
    i, j = torch.as_tensor(i.astype("int64")), torch.as_tensor(j.astype("int64"))
    shift = torch.as_tensor(shifts, dtype=dtype) @ torch.tensor(atoms.cell[:], dtype=dtype)
    species = torch.zeros(len(atoms), dtype=torch.long)

    def graph(pos):
        return AtomGraph(species=species, edge_index=torch.stack([j, i]), edge_vec=pos[j] - pos[i] + shift,
                         n_local=len(atoms))

    def one_after_another():
        forces = []
        for model in models:
            pos = positions.clone().requires_grad_(True)
            forces.append(-torch.autograd.grad(model(graph(pos)).sum(), pos)[0])
        return torch.stack(forces)

    weights, buffers = stack_module_state(list(models))
    skeleton = copy.deepcopy(models[0]).to("meta")

    def energy(weights, buffers, pos):
        return functional_call(skeleton, (weights, buffers), (graph(pos),)).sum()

    def batched():
        return -vmap(grad(energy, argnums=2), in_dims=(0, 0, None))(weights, buffers, positions)

    difference = float((one_after_another() - batched()).abs().max())
    times = {"sequential": [], "batched": []}
    for _ in range(repeat):
        for name, call in (("sequential", one_after_another), ("batched", batched)):
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    sequential, vmapped = statistics.median(times["sequential"]), statistics.median(times["batched"])
    return {"sequential_s": sequential, "batched_s": vmapped, "ratio": vmapped / sequential,
            "max_force_difference": difference}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=5, help="cubic fcc cells per direction (5 → 500 atoms)")
    parser.add_argument("--steps", type=int, default=5, help="MD steps per timing")
    parser.add_argument("--repeat", type=int, default=2, help="timings per case in each process (alternating)")
    parser.add_argument("--rounds", type=int, default=1, help="launches per rank count")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batched", action="store_true", help="also the vmapped batched call (one process)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    flags = ["--cells", args.cells, "--steps", args.steps, "--repeat", args.repeat] + (["--batched"] if args.batched
                                                                                       else [])
    for ranks in args.ranks:
        runs = [launch(ranks, __file__, flags) for _ in range(args.rounds)]
        seconds = {name: statistics.median(r["seconds"][name] for r in runs) for name in runs[0]["seconds"]}
        memory = {name: statistics.median(r["memory_mb"][name] for r in runs) for name in runs[0]["memory_mb"]}
        n = runs[0]["n_atoms"]
        share = n / ranks  # memory: the fullest rank's peak over its share of the atoms
        print(f"{n} atoms, {ranks} rank(s), {args.rounds} launch(es): one member {seconds['single'] * 1e3:.0f} ms/step, "
              f"{memory['single'] * 1024 / share:.1f} KB per atom of a rank's share, peak of one evaluation")
        for k in SIZES:
            name = f"K={k}"
            ratio = seconds[name] / (k * seconds["single"])
            print(f"  committee of {k}: {seconds[name] * 1e3:7.0f} ms/step = {ratio:.3f} x {k} single runs "
                  f"({'meets' if ratio <= 0.9 else 'misses'} the 0.9 goal); memory {memory[name] * 1024 / share:.1f} KB/atom "
                  f"= {memory[name] / memory['single']:.2f} x one member's")
        if "batched" in runs[0]:
            for name, b in runs[0]["batched"].items():
                print(f"  batched (vmap) {name}: {b['batched_s'] * 1e3:.0f} ms vs {b['sequential_s'] * 1e3:.0f} ms one "
                      f"after another = {b['ratio']:.2f}x (forces differ by {b['max_force_difference']:.1e} eV/A)")


if __name__ == "__main__":
    main()
