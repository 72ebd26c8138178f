"""Is a model exact when distributed? A distributed result compared with one process's evaluation of the same
structure (``potentials.predict``), as the self-check (``python -m mlip_parallel.check --model SPEC``),
``mlip-md``'s ``verify: true`` and ``mlip-lammps --verify`` ask: the largest energy (per atom), force and stress
differences, and a verdict. (The comparison only: the command is ``check.py``; ``preflight.py`` is memory.)

Tolerance: what floating-point summation order allows in the model's dtype, relative to the structure's largest
force (stress: to its largest stress component, energy: to its energy per atom), with a floor: float64 1e-9
relative, 1e-8 absolute; float32 1e-4 and 1e-5. A model that reads a neighbour's features without ``graph.halo``,
or any ghost handled wrongly, misses by orders of magnitude more.

A structure that one process could not hold (the memory pre-flight of one process) is compared through a carve-out:
the atoms nearest its centre, as many as one process holds, taken out as a cluster and evaluated both ways.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

TOLERANCES = {"float64": (1e-9, 1e-8), "float32": (1e-4, 1e-5)}  # (relative, absolute floor)
QUANTITIES = ("energy", "forces", "stress")


class Comparison(NamedTuple):
    """The largest differences of a distributed result from one process's: ``energy`` (eV per atom),
    ``forces`` (eV/Å), ``stress`` (eV/Å³, None without a cell volume), each one's ``limits``, and ``ok``."""

    energy: float
    forces: float
    stress: float | None
    limits: dict
    ok: bool

    def line(self, label: str) -> str:
        stress = "" if self.stress is None else f", max |dstress| {self.stress:.3g} eV/A^3"
        return (f"{label}: max |dE| {self.energy:.3g} eV/atom, max |dF| {self.forces:.3g} eV/A{stress}"
                f" ({'within' if self.ok else 'BEYOND'} {self.limits['forces']:.2g} eV/A)")


def compare(result: dict, reference: dict, n_atoms: int, dtype) -> Comparison:
    """``result`` and ``reference`` ({"energy", "forces", "stress" where the cell has a volume}) of one structure
    of ``n_atoms`` atoms, with ``dtype``'s tolerance (the model's: "float32" or "float64", or a torch dtype)."""
    relative, floor = TOLERANCES["float64" if "64" in str(dtype) else "float32"]
    forces = np.asarray(reference["forces"], dtype=np.float64)
    limits = {"energy": max(floor, relative * abs(reference["energy"]) / max(n_atoms, 1)),
              "forces": max(floor, relative * float(np.abs(forces).max(initial=0.0)))}
    found = {"energy": abs(result["energy"] - reference["energy"]) / max(n_atoms, 1),
             "forces": float(np.abs(np.asarray(result["forces"]) - forces).max(initial=0.0))}
    if "stress" in reference:
        limits["stress"] = max(floor, relative * float(np.abs(reference["stress"]).max()))
        found["stress"] = float(np.abs(np.asarray(result["stress"]) - reference["stress"]).max())
    ok = all(np.isfinite(found[q]) and found[q] <= limits[q] for q in found)
    return Comparison(found["energy"], found["forces"], found.get("stress"), limits, ok)


def one_process(model, atoms) -> dict:
    """One process's energy, forces and stress (where the cell has a volume) of ``atoms`` (``potentials.predict``)."""
    import potentials

    result = potentials.predict(model, atoms)
    return {q: result[q] for q in QUANTITIES if q in result}


def fits_one_process(model, atoms) -> bool:
    """Whether one process holds an evaluation of ``atoms`` (the memory pre-flight's estimate for one rank, within
    the memory this process has)."""
    from potentials.messages import memory_budget_bytes  # (torch: at first use)

    from .domain import Domain  # (torch: at first use)
    from .evaluate import ghost_reach
    from .preflight import rank_load, rank_memory

    domain = Domain.from_positions(atoms.positions, atoms.cell, atoms.pbc)
    load = rank_load(model, len(atoms), domain, (1, 1, 1), ghost_reach(model, "layerwise"), 0.0, True,
                     memory_budget_bytes(None, model.device))
    return load.bytes <= rank_memory(model.device, 1)


def carve_out(atoms, count: int):
    """The ``count`` atoms of ``atoms`` nearest its centre (periodic images folded in), as a cluster (no
    periodicity) in a cell a little wider than they span."""
    from ase import Atoms

    positions = atoms.get_positions(wrap=bool(atoms.pbc.any()))
    centre = atoms.cell.cartesian_positions([0.5, 0.5, 0.5]) if atoms.cell.rank == 3 else positions.mean(axis=0)
    vectors = positions - centre
    if atoms.pbc.any():
        from ase.geometry import find_mic
        vectors, _ = find_mic(vectors, atoms.cell, atoms.pbc)
    nearest = np.argsort(np.linalg.norm(vectors, axis=1), kind="stable")[:count]
    part = Atoms(numbers=atoms.numbers[nearest], positions=vectors[nearest], pbc=False)
    part.center(vacuum=5.0)
    return part


def check(model, atoms, backend, modes=("layerwise", "wide")) -> tuple:
    """(the structure compared, [(mode, Comparison)]): ``mlip_parallel.evaluate`` of ``atoms`` on the ranks of
    ``backend`` in each of ``modes`` against one process's evaluation on rank 0 (sent to every rank), or of a
    carve-out (``carve_out``) where one process cannot hold ``atoms``. Collective; every rank gets the same."""
    from .evaluate import evaluate  # (torch: at first use)

    count = None
    if backend.rank == 0:  # (one rank decides: the memory each rank sees may differ)
        count = len(atoms)
        while count > 1 and not fits_one_process(model, atoms if count == len(atoms) else carve_out(atoms, count)):
            count //= 2
    count = backend.bcast(count)
    compared = atoms if count == len(atoms) else carve_out(atoms, count)
    reference = backend.bcast(one_process(model, compared) if backend.rank == 0 else None)
    results = []
    for mode in modes:
        result = evaluate(model, compared, mode=mode, comm=backend)
        results.append((mode, compare(result, reference, len(compared), model.dtype)))
    return compared, results


def check_step(model, frame, result: dict, backend) -> Comparison:
    """A distributed run's own result for the structure ``frame`` (on rank 0; its energy, forces in ``frame``'s atom
    order and stress where the cell has a volume, also on rank 0) against one process's; where one process cannot
    hold ``frame``, the comparison ``check`` makes on a carve-out in layerwise mode. Collective: every rank gets the
    same Comparison."""
    if backend.bcast(fits_one_process(model, frame) if backend.rank == 0 else None):
        comparison = compare(result, one_process(model, frame), len(frame), model.dtype) if backend.rank == 0 else None
        return backend.bcast(comparison)
    return check(model, backend.bcast(frame), backend, ("layerwise",))[1][0][1]


def verify_step(model, frame, result: dict, backend, step: int, error: type) -> str:
    """``check_step`` as a verdict (``verify: true`` / ``--verify`` of the MD tools): its line ("verify: step STEP on
    P rank(s) against one process: …"), or ``error`` raised on every rank, naming the differences, where they are
    beyond summation order. Collective."""
    comparison = check_step(model, frame, result, backend)
    line = comparison.line(f"verify: step {step} on {backend.size} rank(s) against one process")
    if not comparison.ok:
        raise error(f"{line}: the model is not exact when distributed (does every layer after the first refresh its "
                    f"ghost rows with graph.halo?)")
    return line
