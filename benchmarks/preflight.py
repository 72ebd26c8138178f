"""How close the memory pre-flight's estimate (``mlip_parallel.preflight.rank_load``) is to what an
evaluation takes: for each model, one ``mlip_parallel.evaluate`` of rattled fcc Cu (energy + forces +
stress, the automatic memory budget, one thread) in a fresh process per case; memory is the peak resident
size during the call above the resident size before it (after a warm-up on 2³ cells), side by side with
the estimate for the same call. The pre-flight stops inputs that need many times a rank's memory and lets
the others run, so the ratio estimated / measured must stay within 1.0-3 (never below: it errs on the safe side);
each case outside is flagged, and the run exits with status 1. With --ranks 2, the largest rank's peak against the
per-rank estimate.

    python benchmarks/preflight.py [--ranks 1] [--quick]
"""
import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cu_crystal, launch, reset_hwm, status_mb  # noqa: E402
from pipeline import trimmed_rss  # noqa: E402

warnings.filterwarnings("ignore")

# label: (model, cubic cells per direction)
CASES = {
    "Lennard-Jones 6 Å, 6,912": ("lj", 12),
    "Lennard-Jones 6 Å, 32,000": ("lj", 20),
    "cu-emt (PaiNN) 6,912": ("cu-emt", 12),
    "cu-emt (PaiNN) 32,000": ("cu-emt", 20),
    "SchNet F=64 16,384": ("schnet", 16),
    "NequIP 864": ("nequip", 6),
    "MACE (MP-0-small size) 500": ("mace", 5),
    "MACE (MP-0-small size) 1,372": ("mace", 7),
}
QUICK = ("Lennard-Jones 6 Å, 6,912", "cu-emt (PaiNN) 6,912", "SchNet F=64 16,384")
LIMITS = (1.0, 3.0)  # estimated / measured: on the safe side, not by more than 3×


def build(name, model_file=None):
    import torch

    import potentials

    if name == "lj":
        return potentials.LennardJones(0.4, 2.3, 6.0)
    if name == "cu-emt":
        return potentials.load_model("cu-emt")
    if name == "schnet":
        return potentials.SchNet(["Cu"], cutoff=5.0, features=64, layers=3, seed=0)
    if name == "nequip":
        return potentials.NequIP(["Cu"], cutoff=4.5, seed=0)
    if name == "mace":
        return potentials.MACE(model_file).to(torch.float32)
    raise ValueError(name)


def worker(args):
    import torch

    import mlip_parallel
    from mlip_parallel.domain import Domain
    from mlip_parallel.evaluate import ghost_reach
    from mlip_parallel.grid import Grid
    from mlip_parallel.preflight import rank_load
    from potentials.messages import memory_budget_bytes

    torch.set_num_threads(1)
    backend = mlip_parallel.get_backend()
    model = build(args.model, args.model_file)
    mlip_parallel.evaluate(model, cu_crystal(2))  # warm-up
    atoms = cu_crystal(args.cells)
    domain = Domain.from_positions(atoms.positions, atoms.cell, atoms.pbc)
    dims = Grid.for_ranks(backend.size, domain).dims
    load = rank_load(model, len(atoms), domain, dims, ghost_reach(model, "layerwise"), 0.0, True,
                     memory_budget_bytes(None, model.device))
    base = trimmed_rss()
    reset_hwm()
    mlip_parallel.evaluate(model, atoms)
    peak = max(backend.allgather(status_mb("VmHWM") - base))
    if backend.rank == 0:
        print(json.dumps({"atoms": len(atoms), "estimated_mb": load.bytes / 2**20, "measured_mb": peak,
                          "rows": load.rows, "edges": load.edges}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--model-file", help=argparse.SUPPRESS)
    parser.add_argument("--cells", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="SchNet, Lennard-Jones and cu-emt only")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(f"memory pre-flight: estimated vs measured peak of one evaluation, {args.ranks} rank(s), one thread each")
    print(f"{'case':32s} {'atoms':>7s} {'rows/rank':>9s} {'estimated MB':>13s} {'measured MB':>12s} {'ratio':>6s}")
    outside = []
    with tempfile.TemporaryDirectory() as tmp:
        model_file = None
        for label, (model, cells) in CASES.items():
            if args.quick and label not in QUICK:
                continue
            if model == "mace":
                try:
                    from mace_scaling import make_model
                except ImportError:
                    continue
                if model_file is None:
                    model_file = Path(tmp) / "mace.model"
                    try:
                        make_model(model_file, "float32")
                    except ImportError:
                        print(f"{label:32s} (needs the mace extra)")
                        continue
            extra = ["--model-file", model_file] if model == "mace" else []
            row = launch(args.ranks, __file__, ["--model", model, "--cells", cells, *extra])
            ratio = row['estimated_mb'] / max(row['measured_mb'], 1e-9)
            flag = "" if LIMITS[0] <= ratio <= LIMITS[1] else ("  below 1.0" if ratio < LIMITS[0] else "  above 3")
            if flag:
                outside.append(label)
            print(f"{label:32s} {row['atoms']:7d} {row['rows']:9d} {row['estimated_mb']:13.0f} "
                  f"{row['measured_mb']:12.0f} {ratio:6.2f}{flag}", flush=True)
    print(f"estimated / measured within {LIMITS[0]}-{LIMITS[1]}: " + ("every case" if not outside else
                                                                    f"not {', '.join(outside)}"))
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
