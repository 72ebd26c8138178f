"""Make ``references.npz``: fairchem's own FAIRChemCalculator on the fixtures of this folder (``make_fixtures.py``),
each with the options the suite runs it with (``tests/systems.FAIRCHEM_FIXTURES``), on the suite's geometries
(``tests/systems.GEOMETRIES``) in float64, and the experts' fixture in float32 on two of them: the oracle of the MPI
launches (tests/mpi/fairchem_models.py), which then need not run fairchem's calculator on a rank while the others
wait. Keys: ``FIXTURE/DTYPE/GEOMETRY/numbers|positions|cell|pbc`` (the structure, as evaluated) and
``.../energy|forces|stress`` (stress where the cell has a volume). tests/test_fairchem.py checks every entry against
FAIRChemCalculator run anew, so a fairchem release that changes a result fails there, not silently.

Run from the project root, in the project's environment with the fairchem extra installed:
``python tests/data/fairchem/make_references.py`` (about 10 s). fairchem-core 2.24.0 made the committed file.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "..", "..")]  # tests/systems.py

from systems import FAIRCHEM_FIXTURES, GEOMETRIES, fairchem_reference  # noqa: E402

CASES = [(name, torch.float64, geometry) for name in FAIRCHEM_FIXTURES for geometry in GEOMETRIES] + \
    [("uma-moe", torch.float32, geometry) for geometry in ("sheared", "slab")]


def key(name: str, dtype, geometry: str) -> str:
    return f"{name}/{str(dtype).removeprefix('torch.')}/{geometry}"


def main() -> None:
    arrays = {}
    for name, dtype, geometry in CASES:
        atoms = GEOMETRIES[geometry]()
        prefix = key(name, dtype, geometry)
        arrays.update({f"{prefix}/numbers": atoms.numbers, f"{prefix}/positions": atoms.positions,
                       f"{prefix}/cell": atoms.cell[:], f"{prefix}/pbc": atoms.pbc})
        for quantity, value in fairchem_reference(name, atoms, dtype).items():
            arrays[f"{prefix}/{quantity}"] = np.asarray(value, dtype=np.float64)
    np.savez_compressed(os.path.join(HERE, "references.npz"), **arrays)
    print(f"references.npz: {len(CASES)} structures")


if __name__ == "__main__":
    main()
