"""Write candidate structures for the batch examples: COUNT fcc Cu cells of 8-64 atoms (1-4 conventional cells per
direction), rattled by 0.1 Å and strained by 2 % at random (seeded), to batch_structures.extxyz; every tenth gets
its own MD temperature in info["temperature_K"] (mlip-batch's md task reads it).

    python examples/batch/make_structures.py [COUNT]        # default 1000
"""
import sys

import numpy as np
from ase.build import bulk
from ase.io import write

count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
rng = np.random.default_rng(0)
shapes = [(a, b, c) for a in range(1, 5) for b in range(1, 5) for c in range(1, 5) if 8 <= 4 * a * b * c <= 64]
structures = []
for k in range(count):
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(shapes[rng.integers(len(shapes))])
    atoms.rattle(0.1, seed=k)
    atoms.set_cell(atoms.cell[:] @ (np.eye(3) + 0.02 * rng.standard_normal((3, 3))), scale_atoms=True)
    if k % 10 == 0:
        atoms.info["temperature_K"] = 600.0
    structures.append(atoms)
write("batch_structures.extxyz", structures)
print(f"batch_structures.extxyz: {count} structures, {sum(len(a) for a in structures)} atoms")
