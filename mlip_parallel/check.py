"""Self-check of an installation, and of a user's own model: ``mpiexec -n P python -m mlip_parallel.check``.
(The command; the comparison it prints is ``verify.py``'s, and neither is the memory ``preflight.py``.)

Also ``torchrun --nproc-per-node P -m mlip_parallel.check`` (the torch.distributed backend). Prints the
ranks, the grid, each rank's host and device, the communication library and, where a rank has a GPU,
whether CUDA tensors travel device to device (NCCL, or a CUDA-aware MPI); then evaluates models distributed,
in both halo modes (layerwise and wide; ``--modes`` chooses), and in one process, and prints the largest energy,
force and stress differences and one verdict line. Exits 0 when every difference is within what summation
order allows in the model's dtype (``mlip_parallel.verify``), 1 when one is not, 2 on bad input.

The models: Lennard-Jones and random small models of this package's architectures, SchNet, PaiNN and NequIP
(float64; ``--models`` chooses), on a rattled Cu–Ag crystal; or ``--model SPEC`` (repeated for several): any model
the tools accept (a checkpoint, ``cu-emt``, or ``NAME:SPEC`` of a model family, its options as flags), on
``--structure FILE`` or a rattled crystal of the model's elements. A structure one process could not hold is
compared through a carve-out of it that one process holds.
"""
from __future__ import annotations

import argparse
import socket
import sys

from potentials.families import check_models, split_spec

from . import get_backend, rank_device, verify
from .config import report_error
from .domain import Domain
from .errors import MLIPError
from .evaluate import MODES
from .grid import Grid
from .model_section import DTYPE_HELP, add_option_arguments, argument_options

PROG = "python -m mlip_parallel.check"


def built_structure(model, repeat: int):
    """A rattled crystal of ``repeat``³ cubic cells of the model's elements: Cu (every third atom Ag where the model
    knows both; any element for an element-agnostic model), else the model's first element in its reference
    crystal (fcc where ASE has none)."""
    from ase.build import bulk
    from ase.data import atomic_numbers, covalent_radii

    species = model.species
    element = "Cu" if species is None or "Cu" in species else species[0]
    try:
        atoms = bulk(element, cubic=True)
    except (ValueError, KeyError, RuntimeError):  # no reference crystal in ASE (a gas): fcc, neighbours 2.2 r apart
        atoms = bulk(element, "fcc", a=2.2 * 2 ** 0.5 * covalent_radii[atomic_numbers[element]], cubic=True)
    atoms = atoms.repeat(repeat)
    atoms.rattle(0.05, seed=0)
    if element == "Cu" and (species is None or "Ag" in species):
        atoms.numbers[::3] = 47
    return atoms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                     epilog="Exit status: 0 every comparison within tolerance, 1 one beyond, 2 bad input.")
    parser.add_argument("--repeat", type=int, default=4, help="cubic cell repeats per direction of the built crystal "
                                                              "(4 → 256 atoms of fcc)")
    models = list(check_models())  # the families' small models: Lennard-Jones and this package's architectures
    parser.add_argument("--models", nargs="+", choices=models, default=models,
                        help="the small random models to check (default: all), without --model")
    parser.add_argument("--model", action="append", metavar="SPEC",
                        help="check this model instead (repeat for several): a checkpoint path, cu-emt, or NAME:SPEC "
                             "of a model family; its family's options as the flags below")
    parser.add_argument("--dtype", choices=("float32", "float64"), help=DTYPE_HELP)
    parser.add_argument("--structure", metavar="FILE", help="any ASE-readable structure file (default: a rattled "
                                                            "crystal of the model's elements)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="halo modes (default both)")
    add_option_arguments(parser)  # each model family's options (none of the above)
    args = parser.parse_args(argv)
    try:
        return check(args)
    except MLIPError as exc:  # a spec, an option or a structure file that does not fit: alike on every rank
        report_error(PROG, exc)
        return 2


def load_models(args) -> list:
    """[(label, model)] the arguments name (loaded on every rank alike; MLIPError naming the problem)."""
    import potentials

    if not args.model:
        small = check_models()
        return [(name, small[name]().double()) for name in args.models]
    given = argument_options(args)
    models = []
    for spec in args.model:
        family = split_spec(spec)[0]
        options = {k: v for k, v in given.items() if k in family.options}
        try:
            models.append((spec, potentials.load_model(spec, args.dtype, checkpoint_dtype="float64", **options)))
        except ImportError as exc:
            raise MLIPError(f"--model {spec}: {exc}") from None
        except MLIPError as exc:
            raise MLIPError(f"--model {spec}: {exc}") from None
    return models


def check(args) -> int:
    import numpy as np
    import torch

    backend = get_backend()
    device = rank_device(backend)
    models = load_models(args)
    given = None
    if args.structure is not None:
        from ase.io import read

        try:
            given = read(args.structure)
        except Exception as exc:  # ASE raises many types for unreadable files
            raise MLIPError(f"--structure: cannot read {args.structure!r}: {exc}") from None
    rows = backend.allgather((backend.rank, socket.gethostname(), str(device),
                              torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"))
    if backend.rank == 0:
        print(f"mlip-parallel self-check: {backend.size} rank(s), communication: {backend.library}")
        if any(dev.startswith("cuda") for _, _, dev, _ in rows):
            print(f"device-direct messages: {'yes' if backend.cuda_aware else 'no (CUDA tensors are host-staged)'}")
        for rank, host, dev, name in rows:
            print(f"  rank {rank}: host {host}, device {dev} ({name})")
    worst, failed = 0.0, []
    for label, model in models:
        model = model.to(device)
        atoms = given if given is not None else built_structure(model, args.repeat)
        try:
            model.species_index(atoms.numbers)
        except MLIPError as exc:
            raise MLIPError(f"{label}: {exc}") from None
        compared, results = verify.check(model, atoms, backend, args.modes)  # (the module's: a test replaces it)
        if backend.rank == 0:
            domain = Domain.from_positions(compared.positions, compared.cell, compared.pbc)
            grid = Grid.for_ranks(backend.size, domain).dims
            carved = "" if compared is atoms else f", compared on a carve-out of {len(compared)} atoms (one process " \
                                                  f"cannot hold all {len(atoms)})"
            print(f"{label}: {type(model).__name__}, {model.dtype}, cutoff {model.cutoff:g} A, {model.layers} layer(s); "
                  f"{compared.get_chemical_formula()} ({len(compared)} atoms){carved}; grid {grid}")
        for mode, comparison in results:
            worst = float(np.max([worst, comparison.forces]))  # (a NaN difference stays NaN: never a pass)
            if not comparison.ok:
                failed.append(f"{label} {mode}")
            if backend.rank == 0:
                print(f"{label:12s} {mode:9s}: max |F_distributed - F_serial| = {comparison.forces:.3e} eV/A, "
                      f"|dE| = {comparison.energy:.3e} eV/atom" + ("" if comparison.stress is None else
                                                                  f", |dstress| = {comparison.stress:.3e} eV/A^3")
                      + ("" if comparison.ok else f"  BEYOND {comparison.limits['forces']:.2g} eV/A"))
    if backend.rank == 0:
        print(f"largest force difference {worst:.3e} eV/A: " + ("OK" if not failed else
                                                                f"FAILED ({', '.join(failed)}: distributed differs "
                                                                f"from one process beyond summation order)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
