"""NequIP and Allegro models of the nequip framework, of realistic size (NequIP: 64 features, l_max 2,
4 layers; Allegro: l_max 2, 2 layers, 64 scalar and 16 tensor features; r_max 4.5 Å, float64, trained one
epoch on EMT data by nequip-train, packaged), on rattled fcc Cu, one thread per process: the framework's
own NequIPCalculator and ours (potentials.NequIPFramework through mlip_parallel.evaluate) in one process,
their calls alternating, then ours on 2 ranks; the launches alternate --rounds times. Prints medians of
energy + forces + stress per call and the ratios (targets: ours on 1 rank / NequIPCalculator ≤ 1.05,
2 ranks ≥ 1.8× 1 rank). Needs the nequip extra.

    python benchmarks/nequip_scaling.py [--cells 8] [--repeat 2] [--rounds 2] [--models nequip,allegro]
"""
import json
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ROOT, adapter_scaling_parser, calculator_call, cu_crystal, median_call_times,  # noqa: E402
                    ours_against_theirs)

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

        # in the framework's global dtype, as after its set_global_state
        calls["theirs"] = calculator_call(theirs, before=lambda: torch.set_default_dtype(torch.float64))
    times = median_call_times(calls, args.repeat, backend)
    if backend.rank == 0:
        print(json.dumps({"n_atoms": len(atoms), **times}))


def main():
    parser = adapter_scaling_parser(__doc__, repeat=2)
    parser.add_argument("--models", default="nequip,allegro")
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
            ours_against_theirs(__file__, flags, args.rounds, "NequIPCalculator", name)


if __name__ == "__main__":
    main()
