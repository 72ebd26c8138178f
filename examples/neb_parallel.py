"""NEB images in parallel, each image spatially decomposed: a vacancy hop in fcc copper (cu-emt).

    mpiexec -n 4 python examples/neb_parallel.py               # 2 images x 2 ranks
    mpiexec -n 6 python examples/neb_parallel.py --images 3    # 3 images x 2 ranks
    python examples/neb_parallel.py                            # one process, every image in turn

ASE's ``NEB(images, parallel=True)`` gives each moving image ``ranks / images`` consecutive ranks: each rank
evaluates only its own image. Those ranks evaluate that image together, so its calculator gets their communicator
(``MLIPCalculator(model, comm=world.Split(image))``); every other image stays without a calculator on that rank.
A calculator on the whole world instead would have ranks pass different images into one evaluation: it stops on
every rank with RanksDisagreeError, naming this way out. The end points are relaxed by all ranks together (one
structure, ``comm`` the whole world).
"""
import argparse

import numpy as np
import torch
from ase.build import bulk
from ase.mep import NEB
from ase.optimize import BFGS, FIRE

from md import MLIPCalculator


def vacancy_hop(model, cells: int = 3, comm=None, fmax: float = 0.02) -> tuple:
    """(initial, final): fcc copper of ``cells``³ cubic cells with a vacancy at atom 0's site, and with its nearest
    neighbour moved into it, each relaxed (BFGS to ``fmax`` eV/Å) with ``MLIPCalculator(model, comm=comm)``."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(cells)
    site = atoms.positions[0].copy()
    distances = np.linalg.norm(atoms.positions - site, axis=1)
    neighbour = int(np.argsort(distances)[1])
    del atoms[0]
    initial, final = atoms.copy(), atoms.copy()
    final.positions[neighbour - 1] = site  # (indices after the deletion shift by one)
    for end in (initial, final):
        end.calc = MLIPCalculator(model, comm=comm)
        BFGS(end, logfile=None).run(fmax=fmax, steps=100)
    return initial, final


def image_of_rank(rank: int, size: int, moving: int) -> int:
    """The moving image (1 ... ``moving``) ASE's NEB(parallel=True) gives ``rank`` of ``size``."""
    return rank * moving // size + 1


def band(model, initial, final, moving: int, comm=None, steps: int = 50, fmax: float = 0.05) -> NEB:
    """A NEB of ``moving`` images between ``initial`` and ``final`` (interpolated), relaxed with FIRE for at most
    ``steps`` steps. ``comm``: an mpi4py communicator whose ranks share the images, ``size`` a multiple of
    ``moving`` (each image on its ranks, split by ``image_of_rank``); None: one process, every image in turn."""
    images = [initial] + [initial.copy() for _ in range(moving)] + [final]
    parallel = comm is not None and comm.Get_size() > 1
    if parallel:
        if comm.Get_size() % moving:
            raise SystemExit(f"{comm.Get_size()} ranks cannot share {moving} images alike: use a multiple of {moving}")
        mine = image_of_rank(comm.Get_rank(), comm.Get_size(), moving)
        images[mine].calc = MLIPCalculator(model, comm=comm.Split(mine))
    else:
        for image in images[1:-1]:
            image.calc = MLIPCalculator(model, comm="serial")
    neb = NEB(images, parallel=parallel, world=world_of(comm) if parallel else None)
    neb.interpolate()
    FIRE(neb, logfile=None).run(fmax=fmax, steps=steps)
    return neb


def world_of(comm):
    """ASE's wrapper of the mpi4py communicator ``comm`` (NEB's ``world``)."""
    from ase.parallel import MPI4PY

    return MPI4PY(comm)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2, help="moving images")
    parser.add_argument("--steps", type=int, default=50, help="FIRE steps of the band at most")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from mpi4py import MPI

    import potentials

    world = MPI.COMM_WORLD
    model = potentials.load_model("cu-emt", checkpoint_dtype="float64")
    initial, final = vacancy_hop(model, comm=world)
    neb = band(model, initial, final, args.images, comm=world, steps=args.steps)
    profile = band_energies(neb)
    if world.rank == 0:
        print(f"{world.size} rank(s), {args.images} image(s) x {max(world.size // args.images, 1)} rank(s): energies "
              f"along the band {', '.join(f'{e:.4f}' for e in profile)} eV; barrier {max(profile):.4f} eV")


def band_energies(neb) -> np.ndarray:
    """The energies of ``neb``'s images relative to the first (eV), every rank alike: the end points' from their
    calculators, the moving images' from the band's last evaluation (NEB broadcasts them to every rank)."""
    ends = [neb.images[0].get_potential_energy(), neb.images[-1].get_potential_energy()]
    energies = np.concatenate([[ends[0]], neb.energies[1:-1], [ends[1]]])
    return energies - ends[0]


if __name__ == "__main__":
    main()
