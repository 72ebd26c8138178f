"""Labelled molten-salt-like NaCl boxes for examples/charges/train_painn_charges.yaml: rattled and strained rocksalt
boxes of 32 ions labelled (energy, forces, stress) by the born_coulomb model with NaCl's Fumi–Tosi parameters and
Ewald, the model of LAMMPS's born/coul/long (tests/mpi/lammps_born.py checks ours against LAMMPS's own).

    python examples/charges/generate_nacl_data.py [--structures 200] [--out nacl_fumi_tosi.extxyz]
"""
import argparse

import numpy as np
from ase.build import bulk
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io import write

import potentials

FUMI_TOSI = {"Na-Na": [0.2637, 0.317, 2.340, 1.0486, -0.4993], "Na-Cl": [0.2110, 0.317, 2.755, 6.99055, -8.6758],
             "Cl-Cl": [0.1582, 0.317, 3.170, 72.40215, -145.4284]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--structures", type=int, default=200)
    parser.add_argument("--out", default="nacl_fumi_tosi.extxyz")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    labeller = potentials.load_model(("born_coulomb", {"charges": {"Na": 1.0, "Cl": -1.0}, "pairs": FUMI_TOSI,
                                                       "cutoff": 8.0, "shift": True}),
                                     long_range={"method": "ewald", "accuracy": 1e-6})
    rng, frames = np.random.default_rng(args.seed), []
    for _ in range(args.structures):
        atoms = bulk("NaCl", "rocksalt", a=5.64 * rng.uniform(0.97, 1.06), cubic=True).repeat((2, 2, 1))
        atoms.positions += rng.normal(0.0, rng.uniform(0.1, 0.35), atoms.positions.shape)
        labels = potentials.predict(labeller, atoms)
        atoms.calc = SinglePointCalculator(atoms, energy=labels["energy"], forces=labels["forces"],
                                           stress=labels["stress"])
        frames.append(atoms)
    write(args.out, frames)
    print(f"{len(frames)} structures of {len(frames[0])} ions -> {args.out}")


if __name__ == "__main__":
    main()
