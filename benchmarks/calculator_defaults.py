"""Our ASE calculator at its default settings against each family's own ASE calculator, from 8 to 2,048 atoms.

Rattled fcc Cu, energy + forces + stress per call, one thread, one process per (family, size): both calculators
built in it, each called once as a warm-up, then ``--repeat`` times, their calls alternating (this host is noisy;
only side-by-side ratios count). Prints seconds per call (medians) and ours / theirs (goal ≤ 1.0 at every size).
With ``--budgets GB,...`` ours also runs with each of those chunk budgets (``memory_budget_gb``; inf: one pass),
a column each: the chunk size that is fastest per family (0.0084: the 8 MiB chunks that were the CPU default before
the default chose one pass wherever it fits).

Families and models (the package's own calculator in brackets):
  sevennet  SevenNet-0 as sevenn ships it (SevenNetCalculator("7net-0"))
  mace      a random model the size of MACE-MP-0 small, float32 (MACECalculator; benchmarks/mace_scaling.py)
  nequip    the test fixture NequIP with ZBL, float64, packaged (NequIPCalculator)
  allegro   the test fixture Allegro, float64, packaged (NequIPCalculator)
  fairchem  a random model of UMA-S's shape, float32, omat task (FAIRChemCalculator with fairchem's defaults)
  cu-emt    this package's bundled PaiNN (no other calculator: the budget columns against ours at its default)

    python benchmarks/calculator_defaults.py [--families sevennet,mace,nequip,allegro,fairchem]
        [--atoms 8,32,108,256,500,2048] [--repeat 3] [--budgets 0.0084,0.067,inf]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import ROOT, cu_crystal  # noqa: E402

warnings.filterwarnings("ignore")
CELLS = {8: (2, 1, 1), 32: 2, 108: 3, 256: 4, 500: 5, 864: 6, 2048: 8}  # fcc Cu atoms -> cubic cells
FAMILIES = ("sevennet", "mace", "nequip", "allegro", "fairchem", "cu-emt")
NEQUIP = ROOT / "tests" / "data" / "nequip"


def theirs(family: str, model: str):
    """The family's own ASE calculator for ``model`` (a path; sevennet: "7net-0")."""
    if family == "sevennet":
        from sevenn.calculator import SevenNetCalculator

        return SevenNetCalculator(model)
    if family == "mace":
        from mace.calculators import MACECalculator

        return MACECalculator(model_paths=model, device="cpu", default_dtype="float32")
    if family in ("nequip", "allegro"):
        from nequip.integrations.ase import NequIPCalculator

        return NequIPCalculator._from_saved_model(model, device="cpu", chemical_species_to_atom_type_map=True)
    import logging

    from fairchem.core.calculate.ase_calculator import FAIRChemCalculator
    from fairchem.core.units.mlip_unit import load_predict_unit
    from fairchem.core.units.mlip_unit.api.inference import InferenceSettings

    logging.disable(logging.WARNING)
    return FAIRChemCalculator(load_predict_unit(model, inference_settings=InferenceSettings(), device="cpu"),
                              task_name="omat")


def ours(family: str, model: str, budget: float | None):
    """MLIPCalculator on the spec a user types, with its defaults (``budget``: memory_budget_gb, None the default)."""
    from md.calculator import MLIPCalculator

    import potentials

    spec = {"sevennet": "sevennet:7net-0", "cu-emt": "cu-emt", "allegro": f"nequip:{model}"}.get(family,
                                                                                               f"{family}:{model}")
    options = {"task": "omat"} if family == "fairchem" else {}
    return MLIPCalculator(potentials.load_model(spec, **options), memory_budget_gb=budget)


def worker(args) -> None:
    """One (family, size): the calculators alternating; prints {"theirs", "ours", budget...}: median seconds."""
    import torch

    torch.set_num_threads(1)
    atoms = cu_crystal(CELLS[args.atoms])
    calculators = {} if args.family == "cu-emt" else {"theirs": theirs(args.family, args.model)}
    calculators["ours"] = ours(args.family, args.model, None)
    for budget in args.budgets:
        calculators[budget] = ours(args.family, args.model, float(budget))
    if args.family in ("nequip", "allegro"):  # the framework's calculator runs in its global dtype, float64
        torch.set_default_dtype(torch.float64)
    copies = {name: atoms.copy() for name in calculators}
    for name, calc in calculators.items():
        copies[name].calc = calc

    def call(name) -> float:
        copies[name].calc.reset()
        start = time.perf_counter()
        copies[name].get_potential_energy(), copies[name].get_forces(), copies[name].get_stress()
        return time.perf_counter() - start

    first = {name: call(name) for name in calculators}  # warm-up
    repeat = max(args.repeat, min(50, int(2.0 / max(min(first.values()), 1e-3))))  # ≥ 2 s per small case
    times = {name: [] for name in calculators}
    for _ in range(repeat):
        for name in calculators:
            times[name].append(call(name))
    print(json.dumps({name: statistics.median(t) for name, t in times.items()}))


def prepare(family: str, directory: Path) -> str:
    """The model of ``family`` for both calculators: a path (sevennet: "7net-0")."""
    if family in ("sevennet", "cu-emt"):
        return "7net-0" if family == "sevennet" else "cu-emt"
    if family == "mace":
        from mace_scaling import make_model

        path = directory / "mace-mp-0-small-sized.model"
        make_model(path, "float32")
        return str(path)
    if family in ("nequip", "allegro"):
        return str(NEQUIP / f"{'nequip-zbl' if family == 'nequip' else 'allegro'}.nequip.zip")
    sys.path.insert(0, str(ROOT / "tests" / "data" / "fairchem"))
    from make_fixtures import uma_s_sized

    return str(uma_s_sized(directory))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--atoms", default="8,32,108,256,500,2048")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--budgets", default="", help="also ours with each memory_budget_gb (GB, comma-separated)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--family", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.atoms, args.budgets = int(args.atoms), [b for b in args.budgets.split(",") if b]
        return worker(args)
    sizes = [int(n) for n in args.atoms.split(",")]
    unknown = [n for n in sizes if n not in CELLS] + [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown sizes or families {unknown}: sizes {list(CELLS)}, families {list(FAMILIES)}")
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    import os

    print(f"seconds per energy+forces+stress call, medians of >= {args.repeat} alternating calls, one thread; "
          f"ours / theirs (goal <= 1.0){'; ours at memory_budget_gb ' + args.budgets if args.budgets else ''}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            model = prepare(family, Path(tmp))
            for n in sizes:
                command = [sys.executable, __file__, "--worker", "--family", family, "--model", model,
                           "--atoms", str(n), "--repeat", str(args.repeat), "--budgets", args.budgets]
                done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env})
                if done.returncode:
                    print(f"{family:9s} {n:5d} atoms: FAILED\n{done.stderr[-2000:]}", flush=True)
                    continue
                t = json.loads(done.stdout.strip().splitlines()[-1])
                base = t.get("theirs", t["ours"])
                extra = "".join(f"   {b} GB {t[b]:8.4f} s ({t[b] / base:.3f})" for b in t if b not in ("theirs", "ours"))
                line = (f"theirs {t['theirs']:8.4f} s   ours {t['ours']:8.4f} s   ours/theirs {t['ours'] / base:.3f}"
                        if "theirs" in t else f"ours {t['ours']:8.4f} s")
                print(f"{family:9s} {n:5d} atoms: {line}{extra}", flush=True)


if __name__ == "__main__":
    main()
