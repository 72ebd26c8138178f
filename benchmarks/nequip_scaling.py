"""NequIP and Allegro models of the nequip framework, of realistic size (NequIP: 64 features, l_max 2,
4 layers; Allegro: l_max 2, 2 layers, 64 scalar and 16 tensor features; r_max 4.5 Å, float64, trained one
epoch on EMT data by nequip-train, packaged), on rattled fcc Cu, one thread per process: the framework's
own NequIPCalculator and ours (potentials.NequIPFramework through mlip_parallel.evaluate) in one process,
their calls alternating, then ours on 2 ranks; the launches alternate --rounds times. Prints medians of
energy + forces + stress per call and the ratios (targets: ours on 1 rank / NequIPCalculator ≤ 1.05,
2 ranks ≥ 1.8× 1 rank). Needs the nequip extra.

    python benchmarks/nequip_scaling.py [--cells 8] [--repeat 2] [--rounds 2] [--models nequip,allegro]
"""
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, adapter_scaling_parser, adapter_worker, ours_against_theirs  # noqa: E402

warnings.filterwarnings("ignore")
MODELS = {
    "nequip": {"_target_": "nequip.model.NequIPGNNModel", "l_max": 2, "num_layers": 4, "num_features": 64,
               "radial_mlp_depth": 2, "radial_mlp_width": 64},
    "allegro": {"_target_": "allegro.model.AllegroModel", "l_max": 2, "num_layers": 2, "num_scalar_features": 64,
                "num_tensor_features": 16, "allegro_mlp_hidden_layers_width": 64,
                "readout_mlp_hidden_layers_width": 32,
                "radial_chemical_embed": {"_target_": "allegro.nn.TwoBodyBesselScalarEmbed", "num_bessels": 8}},
}


def framework_calculator(args):
    from nequip.integrations.ase import NequIPCalculator

    return NequIPCalculator._from_saved_model(args.model, device="cpu", chemical_species_to_atom_type_map=True)


def worker(args):
    """``--which pair``: NequIPCalculator and ours alternating in one process; ``--which ours``: ours alone."""
    import logging

    import torch

    import potentials

    logging.disable(logging.INFO)
    # the framework's calculator runs in its global dtype, float64, as after its set_global_state
    adapter_worker(args, potentials.NequIPFramework, framework_calculator,
                   before_reference=lambda: torch.set_default_dtype(torch.float64))


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
