"""NequIP and Allegro models of the nequip framework, of realistic size (NequIP: 64 features, l_max 2,
4 layers; Allegro: l_max 2, 2 layers, 64 scalar and 16 tensor features; r_max 4.5 Å, float64, trained one
epoch on EMT data by nequip-train, packaged), on rattled fcc Cu, one thread per process: the framework's
own NequIPCalculator and ours (potentials.NequIPFramework through mlip_parallel.evaluate) in one process,
their calls alternating, then ours on 2 ranks; the launches alternate --rounds times. Prints medians of
energy + forces + stress per call and the ratios (targets: ours on 1 rank / NequIPCalculator ≤ 1.05,
2 ranks ≥ 1.8× 1 rank). Needs the nequip extra.

    python benchmarks/nequip_scaling.py [--cells 8] [--repeat 2] [--rounds 2] [--models nequip,allegro]
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
from common import ROOT, cu_crystal, launch  # noqa: E402

warnings.filterwarnings("ignore")
MODELS = {
    "nequip": {"_target_": "nequip.model.NequIPGNNModel", "l_max": 2, "num_layers": 4, "num_features": 64,
               "radial_mlp_depth": 2, "radial_mlp_width": 64},
    "allegro": {"_target_": "allegro.model.AllegroModel", "l_max": 2, "num_layers": 2, "num_scalar_features": 64,
                "num_tensor_features": 16, "allegro_mlp_hidden_layers_width": 64,
                "readout_mlp_hidden_layers_width": 32,
                "radial_chemical_embed": {"_target_": "allegro.nn.TwoBodyBesselScalarEmbed", "num_bessels": 8}},
}


def worker(args):
    """``--which pair``: NequIPCalculator and ours alternating in one process; ``--which ours``: ours alone.
    Prints {"n_atoms", "theirs", "ours"}: median seconds per call."""
    import logging

    import torch

    import mlip_parallel
    import potentials

    logging.disable(logging.INFO)
    torch.set_num_threads(1)
    atoms = cu_crystal(args.cells)
    model, backend = potentials.NequIPFramework(args.model), mlip_parallel.get_backend()
    calls = {"ours": lambda: mlip_parallel.evaluate(model, atoms)}
    if args.which == "pair":
        from nequip.integrations.ase import NequIPCalculator

        theirs = atoms.copy()
        theirs.calc = NequIPCalculator._from_saved_model(args.model, device="cpu",
                                                         chemical_species_to_atom_type_map=True)

        def framework_call():
            torch.set_default_dtype(torch.float64)  # the framework's global dtype, as after its set_global_state
            theirs.calc.reset()
            return theirs.get_potential_energy(), theirs.get_forces(), theirs.get_stress()
        calls["theirs"] = framework_call
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
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default="nequip,allegro")
    parser.add_argument("--which", choices=["pair", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(ROOT / "tests" / "data" / "nequip"))
    from make_fixtures import train_and_package

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.models.split(","):
            train_and_package(name, MODELS[name], tmp, tmp)
            flags = ["--cells", args.cells, "--repeat", args.repeat, "--model", tmp / f"{name}.nequip.zip"]
            rounds = []
            for _ in range(args.rounds):  # alternating launches; in the one-process launch, alternating calls
                pair = launch(1, __file__, flags + ["--which", "pair"])
                rounds.append((pair, launch(2, __file__, flags + ["--which", "ours"])))
            theirs = statistics.median(p["theirs"] for p, _ in rounds)
            one = statistics.median(p["ours"] for p, _ in rounds)
            two = statistics.median(t["ours"] for _, t in rounds)
            print(f"{name}: {rounds[0][0]['n_atoms']} atoms rattled fcc Cu, one thread per process; seconds per "
                  f"energy+forces+stress, medians of {args.repeat} calls per launch, {args.rounds} rounds:")
            for k, (p, t) in enumerate(rounds):
                print(f"  round {k + 1}: NequIPCalculator {p['theirs']:.3f}, ours 1 rank {p['ours']:.3f} (ratio "
                      f"{p['ours'] / p['theirs']:.3f}), ours 2 ranks {t['ours']:.3f} (speed-up "
                      f"{p['ours'] / t['ours']:.2f}x)")
            print(f"  1 rank / NequIPCalculator = {one / theirs:.3f} (target <= 1.05, goal <= 1.0); 2 ranks speed-up "
                  f"over 1 rank = {one / two:.2f}x (target >= 1.8x), over NequIPCalculator {theirs / two:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
