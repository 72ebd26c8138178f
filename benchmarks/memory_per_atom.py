"""Bytes and time per atom of one energy + forces + stress evaluation, the plain path (every edge of a
block at once under autograd: ``memory_budget_gb=inf``, what every evaluation did before the bounded
path, and what training's create_graph still takes) against the memory-bounded one (the automatic
budget), side by side, on rattled fcc Cu, one thread, each measurement in a fresh process; launches
alternate --rounds times and the medians are printed with the ratios.

Memory is the peak resident size (VmHWM) during the call above the resident size before it (VmRSS after
a warm-up on 2³ cells, gc and malloc_trim), per atom, in a fresh process per path; time is the median
over the case's launches of --repeat calls per path, the paths' calls alternating in each process.
Models: SchNet (F=64, 3 layers, cutoff 5 Å, 4,000 and 16,384 atoms), PaiNN (F=64, 3 layers, cutoff 5 Å,
2,048 atoms), NequIP (defaults, cutoff 4.5 Å, 500 and 864 atoms); the training step of the SchNet
(force loss, create_graph, parameter gradients); and the external adapters through their own blocks
against one pass and against the package's own ASE calculator: SevenNet-0 on 512 and 1,728 Si atoms
(SevenNetCalculator; its convolutions' edge steps in chunks from outside), random MACE models of
MACE-MP-0-small and -medium size, float32 (MACECalculator; ``adapters.mace_chunked.chunked_interaction``), the
NequIP and Allegro models of benchmarks/nequip_scaling.py, float64, trained and packaged here
(NequIPCalculator; ``adapters.nequip_layers.chunked_convolutions``, Allegro in groups of atoms), and a UMA-S-shaped
fairchem model, float32, on 256 and 500 atoms (FAIRChemCalculator with its own activation checkpointing;
benchmarks/fairchem_scaling.py).

    python benchmarks/memory_per_atom.py [--rounds 1] [--repeat 3] [--quick] [--cases MACE]
    python benchmarks/memory_per_atom.py --largest 64 [--ranks 2]   # SchNet on 4·64³ = 1,048,576 atoms
    python benchmarks/memory_per_atom.py --largest 30 --model mace-medium   # 108,000 atoms

``--largest CELLS`` runs one bounded evaluation of 4·CELLS³ atoms on --ranks ranks (``mlip_parallel.evaluate``;
SchNet, or a random MACE of MACE-MP-0-small / -medium size) and prints each rank's peak resident size and
the wall time.
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
from common import cu_crystal, launch, reset_hwm, status_mb  # noqa: E402
from pipeline import trimmed_rss  # noqa: E402

warnings.filterwarnings("ignore")

# label: (model, cubic cells per direction of the crystal, paths)
CASES = {
    "SchNet 4,000": ("schnet", 10, ("plain", "bounded")),
    "SchNet 16,384": ("schnet", 16, ("plain", "bounded")),
    "PaiNN 2,048": ("painn", 8, ("plain", "bounded")),
    "NequIP 500": ("nequip", 5, ("plain", "bounded")),
    "NequIP 864": ("nequip", 6, ("plain", "bounded")),
    "SchNet training 4,000": ("schnet", 10, ("training",)),
    "SevenNet-0 512 (Si)": ("sevennet", 4, ("theirs", "plain", "bounded")),
    "SevenNet-0 1,728 (Si)": ("sevennet", 6, ("theirs", "plain", "bounded")),
    "NequIP (framework) 500": ("nequip-framework", 5, ("theirs", "plain", "bounded")),
    "NequIP (framework) 864": ("nequip-framework", 6, ("theirs", "plain", "bounded")),
    "Allegro 500": ("allegro", 5, ("theirs", "plain", "bounded")),
    "Allegro 1,372": ("allegro", 7, ("theirs", "plain", "bounded")),
    "MACE (MP-0-small size) 500": ("mace", 5, ("theirs", "plain", "bounded")),
    "MACE (MP-0-small size) 1,372": ("mace", 7, ("theirs", "plain", "bounded")),
    "MACE (MP-0-medium size) 256": ("mace-medium", 4, ("theirs", "plain", "bounded")),
    "MACE (MP-0-medium size) 500": ("mace-medium", 5, ("theirs", "plain", "bounded")),
    "UMA-S-shaped 256": ("fairchem", 4, ("theirs", "plain", "bounded")),
    "UMA-S-shaped 500": ("fairchem", 5, ("theirs", "plain", "bounded")),
}
MACE_HIDDEN = {"mace": "128x0e", "mace-medium": "128x0e+128x1o"}
FRAMEWORK = ("nequip-framework", "allegro")  # benchmarks/nequip_scaling.py's models, trained and packaged here
QUICK = ("SchNet 4,000", "PaiNN 2,048", "NequIP 500")


def build(name, model_file=None):
    import torch

    import potentials

    if name == "schnet":
        return potentials.SchNet(["Cu"], cutoff=5.0, features=64, layers=3, seed=0)
    if name == "painn":
        return potentials.PaiNN(["Cu"], cutoff=5.0, features=64, layers=3, seed=0)
    if name == "nequip":
        return potentials.NequIP(["Cu"], cutoff=4.5, seed=0)
    if name == "sevennet":
        from potentials.adapters.sevennet import SevenNet

        return SevenNet("7net-0")
    if name in MACE_HIDDEN:
        return potentials.MACE(model_file).to(torch.float32)
    if name in FRAMEWORK:
        return potentials.NequIPFramework(model_file)
    if name == "fairchem":
        return potentials.FAIRChem(model_file, task="omat")
    raise ValueError(name)


def their_calculator(name, model_file):
    """The package's own ASE calculator for the model ``build(name, model_file)`` is, and a function run before
    each of its calls."""
    import torch

    if name == "sevennet":
        from sevenn.calculator import SevenNetCalculator

        return SevenNetCalculator("7net-0", device="cpu"), lambda: None
    if name in FRAMEWORK:
        from nequip.integrations.ase import NequIPCalculator

        # the framework's calculator runs in its global dtype, float64, as after its set_global_state
        return (NequIPCalculator._from_saved_model(model_file, device="cpu", chemical_species_to_atom_type_map=True),
                lambda: torch.set_default_dtype(torch.float64))
    if name == "fairchem":
        from fairchem_scaling import fairchem_calculator

        return fairchem_calculator(argparse.Namespace(model=model_file)), lambda: None
    from mace.calculators import MACECalculator

    return MACECalculator(model_paths=model_file, device="cpu", default_dtype="float32"), lambda: None


def structure(name, cells):
    if name == "sevennet":
        from sevennet_scaling import silicon

        return silicon(cells)
    return cu_crystal(cells)


def evaluation(name, model, path, model_file=None):
    """A function of Atoms doing one energy + forces + stress evaluation along ``path`` ("theirs": the package's
    own calculator, ``their_calculator``)."""
    from potentials.predict import energy_forces

    if path == "theirs":
        calculator, before = their_calculator(name, model_file)

        def theirs(atoms):
            atoms = atoms.copy()
            before()
            calculator.reset()  # (else ASE returns the previous call's results for the same positions)
            atoms.calc = calculator
            return atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
        return theirs
    if path == "training":
        def step(atoms):  # the force-matching step of mlip-train: create_graph, then parameter gradients
            model.zero_grad()
            energies, forces, dE_dstrain = energy_forces(model, atoms, create_graph=True)
            (energies.sum() ** 2 + forces.pow(2).sum() + dE_dstrain.pow(2).sum()).backward()
        return step
    budget = float("inf") if path == "plain" else None
    return lambda atoms: [t.detach() for t in energy_forces(model, atoms, memory_budget_gb=budget)]


def worker(args):
    """Memory: one call along ``args.path`` in this fresh process. Then time: every path of
    ``args.time_paths`` (this one among them), calls alternating, ``args.repeat`` rounds; the medians."""
    import logging

    import torch

    logging.disable(logging.INFO)  # the nequip framework's log lines
    torch.set_num_threads(1)
    model = build(args.model, args.model_file)
    paths = args.time_paths.split(",")
    calls = {path: evaluation(args.model, model, path, args.model_file) for path in paths}
    small = structure(args.model, 2)
    calls[args.path](small)  # warm-up: kernels, allocator pools
    atoms = structure(args.model, args.cells)
    base = trimmed_rss()
    reset_hwm()
    calls[args.path](atoms)
    peak = status_mb("VmHWM") - base
    for path in paths:
        calls[path](atoms)  # every path warmed up on this size before the timed rounds
    times = {path: [] for path in paths}
    for _ in range(args.repeat):
        for path in paths:
            start = time.perf_counter()
            calls[path](atoms)
            times[path].append(time.perf_counter() - start)
    print(json.dumps({"atoms": len(atoms), "kb_per_atom": peak * 1024 / len(atoms),
                      "us_per_atom": {p: 1e6 * statistics.median(t) / len(atoms) for p, t in times.items()}}))


def largest(args):
    """One bounded evaluation of 4·cells³ atoms (``args.model``) on this rank's share; rank 0 prints the peaks."""
    import torch

    import mlip_parallel

    torch.set_num_threads(1)
    backend = mlip_parallel.get_backend()
    model = build(args.model, args.model_file)
    mlip_parallel.evaluate(model, cu_crystal(2))  # warm-up
    atoms = cu_crystal(args.cells)
    base = trimmed_rss()
    reset_hwm()
    backend.barrier()
    start = time.perf_counter()
    result = mlip_parallel.evaluate(model, atoms)
    seconds = time.perf_counter() - start
    peaks = backend.allgather(status_mb("VmHWM"))
    bases = backend.allgather(base)
    if backend.rank == 0:
        print(json.dumps({"atoms": len(atoms), "ranks": backend.size, "seconds": seconds,
                          "peak_rss_mb": peaks, "base_rss_mb": bases, "energy_per_atom": result["energy"] / len(atoms)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="schnet", help="the --largest run's model: schnet, mace (MP-0-small "
                        "size) or mace-medium")
    parser.add_argument("--model-file", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--time-paths", help=argparse.SUPPRESS)
    parser.add_argument("--cells", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per path in each launch")
    parser.add_argument("--rounds", type=int, default=1, help="alternating launches per path")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--cases", help="only the cases whose label contains this text (e.g. MACE)")
    parser.add_argument("--largest", type=int, metavar="CELLS", help="the largest-system run (see above)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the --largest run")
    parser.add_argument("--largest-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker and args.largest_worker:
        return largest(args)
    if args.worker:
        return worker(args)
    if args.largest:
        with tempfile.TemporaryDirectory() as tmp:
            extra = []
            if args.model in MACE_HIDDEN:
                from mace_scaling import make_model

                extra = ["--model-file", str(Path(tmp) / "largest.model")]
                make_model(extra[1], "float32", MACE_HIDDEN[args.model])
            out = launch(args.ranks, Path(__file__), ["--largest-worker", "--cells", args.largest, "--model",
                                                      args.model, *extra])
        peaks = [p - b for p, b in zip(out["peak_rss_mb"], out["base_rss_mb"])]
        title = {"schnet": "SchNet F=64, 3 layers, cutoff 5 Å", "mace": "MACE of MACE-MP-0-small size, float32",
                 "mace-medium": "MACE of MACE-MP-0-medium size, float32"}[args.model]
        print(f"{title}, {out['atoms']:,} atoms on {out['ranks']} ranks: "
              f"{out['seconds']:.0f} s; peak resident per rank {', '.join(f'{p / 1024:.2f}' for p in out['peak_rss_mb'])} GiB "
              f"({', '.join(f'{p / 1024:.2f}' for p in peaks)} GiB above the warmed-up process), "
              f"{sum(peaks) * 1024 / out['atoms']:.1f} KB per atom in all")
        return
    with tempfile.TemporaryDirectory() as tmp:
        labels = [label for label in (QUICK if args.quick else CASES) if args.cases is None or args.cases in label]
        model_files, wanted = {}, {CASES[label][0] for label in labels}
        for name, hidden in MACE_HIDDEN.items():
            if name in wanted:
                from mace_scaling import make_model

                model_files[name] = str(Path(tmp) / f"{name}.model")
                make_model(model_files[name], "float32", hidden)
        for name in FRAMEWORK:
            if name in wanted:
                sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "data" / "nequip"))
                from make_fixtures import train_and_package
                from nequip_scaling import MODELS

                short = name.split("-")[0]
                train_and_package(short, MODELS[short], Path(tmp), Path(tmp))
                model_files[name] = str(Path(tmp) / f"{short}.nequip.zip")
        if "fairchem" in wanted:
            from fairchem_scaling import make_model as make_fairchem_model

            model_files["fairchem"] = str(make_fairchem_model(tmp))
        runs = {}
        for _ in range(args.rounds):
            for label in labels:
                name, cells, paths = CASES[label]
                for path in paths:
                    extra = ["--model-file", model_files[name]] if name in model_files else []
                    runs.setdefault((label, path), []).append(launch(1, Path(__file__), [
                        "--model", name, "--cells", cells, "--path", path, "--time-paths", ",".join(paths),
                        "--repeat", args.repeat, *extra]))
    # memory: the path's own launches; time: every launch of the case (all its paths time side by side)
    med = {}
    for (label, path), rs in runs.items():
        timed = [r["us_per_atom"][path] for p in CASES[label][2] for r in runs[(label, p)]]
        med[(label, path)] = {"atoms": rs[0]["atoms"], "kb_per_atom": statistics.median(r["kb_per_atom"] for r in rs),
                              "us_per_atom": statistics.median(timed)}
    print("one thread; KB/atom: peak resident above the warmed-up process; µs/atom: median call")
    print(f"{'case':28s} {'path':9s} {'atoms':>7s} {'KB/atom':>9s} {'µs/atom':>9s} {'memory ×':>9s} {'time ×':>7s}")
    for label in labels:
        paths = CASES[label][2]
        for path in paths:
            m = med[(label, path)]
            ratios = ""
            if path == "bounded":
                other = med[(label, "theirs" if "theirs" in paths else "plain")]
                ratios = f"{m['kb_per_atom'] / other['kb_per_atom']:9.3f} {m['us_per_atom'] / other['us_per_atom']:7.2f}"
            print(f"{label:28s} {path:9s} {m['atoms']:7.0f} {m['kb_per_atom']:9.1f} {m['us_per_atom']:9.1f} {ratios}")
    print("ratios: bounded / theirs (the package's own calculator: MACECalculator, NequIPCalculator, "
          "SevenNetCalculator, FAIRChemCalculator with its activation checkpointing), else bounded / plain, measured "
          "in the same run")


if __name__ == "__main__":
    main()
