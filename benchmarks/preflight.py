"""How close the memory pre-flight's estimate (``mlip_parallel.preflight.rank_load``) is to what an
evaluation takes: for each model, one ``mlip_parallel.evaluate`` of rattled fcc Cu (energy + forces +
stress, the automatic memory budget, one thread) in a fresh process per case; memory is the peak resident
size during the call above the resident size before it (after a warm-up on 2³ cells), side by side with
the estimate for the same call. The pre-flight stops inputs that need many times a rank's memory and lets
the others run, so the ratio estimated / measured must stay within 1.0-3 (never below: it errs on the safe side);
each case outside is flagged, and the run exits with status 1. With --ranks 2, the largest rank's peak against the
per-rank estimate.

With --batch, the same for graphs of many structures (``potentials.predict_many``, every structure in one graph):
the estimate ``leading_group`` sizes a batch by (the family's ``evaluation_bytes`` of the whole graph, one pass)
against the peak of ``predict_many`` on rattled, strained fcc Cu cells of 8-128 atoms (benchmarks/batch.py's).

    python benchmarks/preflight.py [--ranks 1] [--quick] [--batch]
"""
import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cu_crystal, launch, reset_hwm, status_mb  # noqa: E402
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
    "SevenNet-0 256": ("sevennet", 4),
    "Allegro (test fixture) 500": ("allegro", 5),
    "UMA (test fixture, MoE) 256": ("uma", 4),
}
QUICK = ("Lennard-Jones 6 Å, 6,912", "cu-emt (PaiNN) 6,912", "SchNet F=64 16,384")
# --batch: label: (model, structures of 8-128 atoms in one graph)
BATCH_CASES = {
    "Lennard-Jones 6 Å, batch": ("lj", 400),
    "cu-emt (PaiNN), batch": ("cu-emt", 400),
    "SchNet F=64, batch": ("schnet", 400),
    "NequIP, batch": ("nequip", 40),
    "MACE (MP-0-small size), batch": ("mace", 40),
    "SevenNet-0, batch": ("sevennet", 20),
    "Allegro (test fixture), batch": ("allegro", 40),
    "UMA (test fixture, MoE), batch": ("uma", 20),
}
BATCH_QUICK = ("Lennard-Jones 6 Å, batch", "cu-emt (PaiNN), batch", "SchNet F=64, batch")
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
    if name == "sevennet":
        return potentials.SevenNet("7net-0")
    if name == "allegro":
        return potentials.load_model(f"nequip:{ROOT / 'tests/data/nequip/allegro.nequip.zip'}")
    if name == "uma":
        return potentials.load_model(f"fairchem:{ROOT / 'tests/data/fairchem/uma-moe.pt'}", task="omat")
    raise ValueError(name)


def worker(args):
    import torch

    import mlip_parallel
    from mlip_parallel.domain import Domain
    from mlip_parallel.evaluate import ghost_reach
    from mlip_parallel.grid import Grid
    from mlip_parallel.preflight import check_rank_memory, rank_load

    torch.set_num_threads(1)
    backend = mlip_parallel.get_backend()
    model = build(args.model, args.model_file)
    mlip_parallel.evaluate(model, cu_crystal(2))  # warm-up
    atoms = cu_crystal(args.cells)
    domain = Domain.from_positions(atoms.positions, atoms.cell, atoms.pbc)
    dims = Grid.for_ranks(backend.size, domain).dims
    reach = ghost_reach(model, "layerwise") if backend.size > 1 else 0.0  # (one process: no ghosts, as evaluate)
    budget = check_rank_memory(backend, model, len(atoms), domain, dims, reach)  # (GB; inf: every edge at once)
    chunk = None if budget == float("inf") else budget * 1e9
    load = rank_load(model, len(atoms), domain, dims, reach, 0.0, True, chunk)
    base = trimmed_rss()
    reset_hwm()
    mlip_parallel.evaluate(model, atoms)
    peak = max(backend.allgather(status_mb("VmHWM") - base))
    if backend.rank == 0:
        print(json.dumps({"atoms": len(atoms), "estimated_mb": load.bytes / 2**20, "measured_mb": peak,
                          "rows": load.rows, "edges": load.edges, "one_pass": budget == float("inf")}))


def batch_worker(args):
    """The peak of one ``predict_many`` of ``args.structures`` structures as one graph, and ``leading_group``'s
    estimate of it."""
    import torch
    from ase.io import read

    from batch import write_structures
    from potentials.batch import predict_many, prepare_batch

    torch.set_num_threads(1)
    model = build(args.model, args.model_file)
    predict_many(model, [cu_crystal(2)])  # warm-up
    with tempfile.TemporaryDirectory() as tmp:
        write_structures(Path(tmp) / "s.extxyz", args.structures, 8, 128)
        structures = read(Path(tmp) / "s.extxyz", ":")
    batch = prepare_batch(model, structures)
    rows, edges = int(batch.sizes.sum()), len(batch.i)
    estimated = model.evaluation_bytes(rows, edges, chunked=False)
    del batch
    base = trimmed_rss()
    reset_hwm()
    predict_many(model, structures, max_atoms=float("inf"), memory_budget_gb=float("inf"))
    print(json.dumps({"atoms": rows, "estimated_mb": estimated / 2**20, "measured_mb": status_mb("VmHWM") - base,
                      "rows": rows, "edges": edges, "one_pass": True}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--model-file", help=argparse.SUPPRESS)
    parser.add_argument("--cells", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="SchNet, Lennard-Jones and cu-emt only")
    parser.add_argument("--batch", action="store_true", help="graphs of many structures (potentials.predict_many)")
    parser.add_argument("--structures", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return batch_worker(args) if args.structures else worker(args)
    cases, quick = (BATCH_CASES, BATCH_QUICK) if args.batch else (CASES, QUICK)
    if args.batch and args.ranks != 1:
        parser.error("--batch runs in one process (predict_many; mlip_parallel.predict_many shares the list)")
    print(f"memory pre-flight: estimated vs measured peak of one evaluation, {args.ranks} rank(s), one thread each"
          + (", graphs of many structures" if args.batch else ""))
    print(f"{'case':32s} {'atoms':>7s} {'rows/rank':>9s} {'edges':>9s} {'estimated MB':>13s} {'measured MB':>12s} "
          f"{'ratio':>6s}  run")
    outside = []
    with tempfile.TemporaryDirectory() as tmp:
        model_file = None
        for label, (model, count) in cases.items():
            if args.quick and label not in quick:
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
            size = ["--structures", count] if args.batch else ["--cells", count]
            row = launch(args.ranks, __file__, ["--model", model, *size, *extra])
            ratio = row['estimated_mb'] / max(row['measured_mb'], 1e-9)
            flag = "" if LIMITS[0] <= ratio <= LIMITS[1] else ("  below 1.0" if ratio < LIMITS[0] else "  above 3")
            if flag:
                outside.append(label)
            how = "every edge at once" if row["one_pass"] else "in chunks"
            print(f"{label:32s} {row['atoms']:7d} {row['rows']:9d} {row['edges']:9d} {row['estimated_mb']:13.0f} "
                  f"{row['measured_mb']:12.0f} {ratio:6.2f}  {how}{flag}", flush=True)
    print(f"estimated / measured within {LIMITS[0]}-{LIMITS[1]}: " + ("every case" if not outside else
                                                                    f"not {', '.join(outside)}"))
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
