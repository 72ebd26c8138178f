"""A fairchem model of UMA-S's shape (random weights: 128 channels, lmax = mmax = 2, 4 layers, 32 experts routed by
composition, cutoff 6 Å; made by tests/data/fairchem/make_fixtures.py with fairchem's own constructors) on rattled
fcc Cu, float32, one thread per process: fairchem's own FAIRChemCalculator (its default settings: activation
checkpointing on, experts not merged, no compilation) and ours (potentials.FAIRChem through mlip_parallel.evaluate)
on one process, their calls alternating, then ours on 2 ranks; the two launches alternate --rounds times. Each
times energy + forces + stress per call (median of --repeat after a warm-up); prints the medians and the ratios
(targets: ours on 1 rank / FAIRChemCalculator ≤ 1.05, 2 ranks ≥ 1.8× 1 rank). Then, unless --no-memory, the
memory per atom of both (benchmarks/memory_per_atom.py --cases UMA: peak resident above the warmed-up process,
FAIRChemCalculator with checkpointing on, ours chunked and in one pass). Needs the fairchem extra.

    python benchmarks/fairchem_scaling.py [--cells 8] [--repeat 2] [--rounds 2] [--no-memory]
"""
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import adapter_scaling_parser, adapter_worker, ours_against_theirs  # noqa: E402

warnings.filterwarnings("ignore")


def make_model(directory) -> Path:
    """Write the UMA-S-shaped random checkpoint into ``directory``; its path."""
    sys.path.insert(0, str(HERE.parent / "tests" / "data" / "fairchem"))
    from make_fixtures import uma_s_sized

    return uma_s_sized(Path(directory))


def fairchem_calculator(args):
    """FAIRChemCalculator on the omat task with fairchem's default inference settings on a CPU, float32."""
    import logging

    from fairchem.core.calculate.ase_calculator import FAIRChemCalculator
    from fairchem.core.units.mlip_unit import load_predict_unit
    from fairchem.core.units.mlip_unit.api.inference import InferenceSettings

    logging.disable(logging.WARNING)
    unit = load_predict_unit(args.model, inference_settings=InferenceSettings(), device="cpu")
    return FAIRChemCalculator(unit, task_name="omat")


def worker(args):
    """``--which pair`` (one process): FAIRChemCalculator ("theirs") and ours on one rank, calls alternating;
    ``--which ours`` (any ranks): ours alone."""
    import potentials

    adapter_worker(args, lambda path: potentials.FAIRChem(path, task="omat"), fairchem_calculator)


def main():
    parser = adapter_scaling_parser(__doc__, repeat=2)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory-per-atom table")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(tmp)
        flags = ["--cells", args.cells, "--repeat", args.repeat, "--model", path]
        ours_against_theirs(__file__, flags, args.rounds, "FAIRChemCalculator", "UMA-S-shaped fairchem model (float32)")
    if not args.no_memory:
        subprocess.run([sys.executable, str(HERE / "memory_per_atom.py"), "--cases", "UMA", "--repeat", "1"], check=True)


if __name__ == "__main__":
    main()
