"""Label the frames mlip-md selected (candidates.extxyz) with a reference method — ASE's EMT here, standing in for
the DFT code of a real loop — and write them as training data (energy, forces, stress) for mlip-train.

    python examples/active_learning/label_candidates.py [al_md/candidates.extxyz] [al_labelled.extxyz]
"""
import sys

from ase.calculators.emt import EMT
from ase.io import read, write


def label(source, target) -> int:
    """Every frame of ``source`` with EMT's energy, forces and stress, written to ``target``; the frame count."""
    frames = read(source, ":")
    for frame in frames:
        frame.calc = EMT()  # your DFT calculator here
        frame.get_potential_energy(), frame.get_forces(), frame.get_stress()
    write(target, frames, format="extxyz")
    return len(frames)


def main():
    source = sys.argv[1] if len(sys.argv) > 1 else "al_md/candidates.extxyz"
    target = sys.argv[2] if len(sys.argv) > 2 else "al_labelled.extxyz"
    print(f"{label(source, target)} frames of {source} labelled -> {target}")


if __name__ == "__main__":
    main()
