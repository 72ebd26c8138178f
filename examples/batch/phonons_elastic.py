"""Phonons and elastic constants of fcc Cu by finite differences, every displaced and strained cell evaluated
together (potentials.predict_many), with the bundled cu-emt model (float64); each is checked against the same
cells evaluated one at a time with MLIPCalculator.

    python examples/batch/phonons_elastic.py        # phonopy (pip install phonopy) for the phonons

Phonons: phonopy's displaced 3×3×3 supercells of the conventional cell (108 atoms), frequencies at X and L.
Elastic constants: the relaxed lattice constant (FIRE with the cell, relax_many), then ±0.5 % of each of the six
Voigt strains; C_ij = dσ_i/dε_j (central differences), GPa; C11, C12, C44 printed with the cubic averages.
"""
import time

import numpy as np
from ase import Atoms, units
from ase.build import bulk

import potentials
from md.batch import relax_many
from md.calculator import MLIPCalculator

model = potentials.load_model("cu-emt", checkpoint_dtype="float64")

# the lattice constant of this model: the primitive cell relaxed with its cell
unit, = relax_many(model, [bulk("Cu", "fcc", a=3.6)], fmax=1e-5, max_steps=500, cell=True)
a = 3.6 * (unit.get_volume() / bulk("Cu", "fcc", a=3.6).get_volume()) ** (1 / 3)
print(f"lattice constant {a:.5f} Å ({unit.info['steps']} FIRE steps with the cell)")
cubic = bulk("Cu", "fcc", a=a, cubic=True)

# --- phonons: phonopy's displaced supercells as one batch
try:
    from phonopy import Phonopy
    from phonopy.structure.atoms import PhonopyAtoms
except ImportError:
    Phonopy = None
    print("phonons: skipped (pip install phonopy)")
if Phonopy is not None:
    phonon = Phonopy(PhonopyAtoms(symbols=cubic.get_chemical_symbols(), cell=cubic.cell[:],
                                  scaled_positions=cubic.get_scaled_positions()),
                     supercell_matrix=3 * np.eye(3, dtype=int), primitive_matrix="F")
    phonon.generate_displacements(distance=0.01)
    displaced = [Atoms(s.symbols, cell=s.cell, scaled_positions=s.scaled_positions, pbc=True)
                 for s in phonon.supercells_with_displacements]
    start = time.perf_counter()
    phonon.forces = [r["forces"] for r in potentials.predict_many(model, displaced)]
    batched = time.perf_counter() - start
    phonon.produce_force_constants()
    frequencies = {q: phonon.run_qpoints([point]).frequencies[0]
                   for q, point in (("X", [0.5, 0, 0.5]), ("L", [0.5, 0.5, 0.5]))}
    calculator = MLIPCalculator(model)
    loop = []
    for atoms in displaced:
        atoms.calc = calculator
        loop.append(atoms.get_forces())
    worst = max(np.abs(f - g).max() for f, g in zip(phonon.forces, loop))
    print(f"phonons: {len(displaced)} displaced supercell(s) of {len(displaced[0])} atoms in {batched:.2f} s; "
          f"forces against MLIPCalculator one at a time: largest difference {worst:.1e} eV/Å")
    for q, values in frequencies.items():
        print(f"  {q}: " + " ".join(f"{v:.3f}" for v in values) + " THz")

# --- elastic constants: ±0.5 % of each Voigt strain, all 12 cells as one batch
step = 0.005
voigt = [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]
strained = []
for i, j in voigt:
    for sign in (1, -1):
        strain = np.zeros((3, 3))
        strain[i, j] = strain[j, i] = sign * step / (1 if i == j else 2)  # engineering shear strain = step
        atoms = cubic.copy()
        atoms.set_cell(cubic.cell[:] @ (np.eye(3) + strain), scale_atoms=True)
        strained.append(atoms)
stresses = np.array([r["stress"] for r in potentials.predict_many(model, strained)])  # eV/Å³, (1/V) dE/dε
C = (stresses[0::2] - stresses[1::2]).T / (2 * step) / units.GPa  # C_ij = dσ_i/dε_j
c11, c12, c44 = C[[0, 1, 2], [0, 1, 2]].mean(), C[[0, 0, 1], [1, 2, 2]].mean(), C[[3, 4, 5], [3, 4, 5]].mean()
print(f"elastic constants (GPa, from 12 strained cells in one batch): C11 {c11:.1f}, C12 {c12:.1f}, C44 {c44:.1f}; "
      f"bulk modulus {(c11 + 2 * c12) / 3:.1f}")
