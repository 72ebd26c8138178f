"""A MACE model the size of MACE-MP-0 small (random weights: 128x0e, max_L 0, max_ell 3, correlation 3, two
interactions, r_max 6 Å, 89 elements) on rattled fcc Cu, one thread per process: MACE's own MACECalculator
and ours (potentials.MACE through mlip_parallel.evaluate) on one process, their calls alternating, then
ours on 2 ranks; the two launches alternate --rounds times. Each times energy + forces + stress per call
(median of --repeat after a warm-up); prints the medians and the ratios (targets: ours on 1 rank /
MACECalculator ≤ 1.05, 2 ranks ≥ 1.8× 1 rank).
Needs the mace extra.

    python benchmarks/mace_scaling.py [--cells 8] [--repeat 3] [--rounds 2] [--dtype float32]
"""
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import adapter_scaling_parser, adapter_worker, ours_against_theirs  # noqa: E402

warnings.filterwarnings("ignore")


def make_model(path, dtype, hidden="128x0e", interactions=2):
    """Write a random MACE-MP-0-small-sized model to ``path`` (torch.save, as MACE's training does);
    ``hidden="128x0e+128x1o"``: the MP-0-medium size; ``interactions``: its interaction blocks (MP-0: 2)."""
    import numpy as np
    import torch
    from e3nn import o3
    from mace import modules

    torch.set_default_dtype(getattr(torch, dtype))
    torch.manual_seed(0)
    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    model = modules.ScaleShiftMACE(
        r_max=6.0, num_bessel=8, num_polynomial_cutoff=5, max_ell=3, interaction_cls=block,
        interaction_cls_first=block, num_interactions=interactions, num_elements=89, hidden_irreps=o3.Irreps(hidden),
        MLP_irreps=o3.Irreps("16x0e"), gate=torch.nn.functional.silu, atomic_energies=-np.linspace(1, 5, 89),
        avg_num_neighbors=60.0, atomic_numbers=list(range(1, 90)), correlation=3, radial_MLP=[64, 64, 64],
        atomic_inter_scale=1.0, atomic_inter_shift=0.0)
    torch.save(model, path)


def mace_calculator(args):
    from mace.calculators import MACECalculator

    return MACECalculator(model_paths=args.model, device="cpu", default_dtype=args.dtype)


def worker(args):
    """``--which pair`` (one process): MACECalculator ("theirs") and ours on one rank, calls alternating;
    ``--which ours`` (any ranks): ours alone."""
    import potentials

    adapter_worker(args, potentials.MACE, mace_calculator)


def main():
    parser = adapter_scaling_parser(__doc__, repeat=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mace-mp-0-small-sized.model"
        make_model(path, args.dtype)
        flags = ["--cells", args.cells, "--repeat", args.repeat, "--dtype", args.dtype, "--model", path]
        ours_against_theirs(__file__, flags, args.rounds, "MACECalculator",
                            f"MACE-MP-0-small-sized model ({args.dtype})")


if __name__ == "__main__":
    main()
