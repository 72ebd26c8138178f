"""Generate an fcc-copper training set labelled with ASE's EMT potential (energy, forces, stress).

    python examples/generate_cu_emt_data.py                        # ~280 structures -> cu_emt.extxyz
    python examples/generate_cu_emt_data.py --output data.extxyz --seed 1 --frames 20
    python examples/generate_cu_emt_data.py --quick                # tiny set for tests

Structures (fcc Cu, a = 3.61 Å), tagged with ``atoms.info["kind"]`` and ``atoms.info["temperature_K"]``:

* ``bulk``     – Langevin MD snapshots of a 2x2x2 cubic cell (32 atoms) at 300, 600, 900 and 1200 K;
* ``strained`` – random symmetric strains (up to ±3 %) and pure volume changes (±4 %), rattled by 0.05 Å;
* ``vacancy``  – MD snapshots of the 32-atom cell minus one atom at 300 and 900 K;
* ``surface``  – MD snapshots of a periodic fcc(111) slab (2x2x4, 6 Å vacuum) at 300 and 600 K.

``--frames`` is the number of snapshots per bulk MD temperature; the vacancy and surface runs take half
as many per temperature and the strained set has ``--frames`` structures. ``--quick`` uses 4-atom cells,
a 4-atom slab and at most 2 frames. Output is deterministic for a given ``--seed``.
"""
import argparse
import time
from collections import Counter

import numpy as np
from ase import Atoms, units
from ase.build import bulk, fcc111
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io import write
from ase.md.langevin import Langevin

try:  # ASE >= 3.29 (MaxwellBoltzmannDistribution is deprecated there)
    from ase.md.velocitydistribution import thermalize_momenta
except ImportError:  # ASE < 3.29
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution as _mbd

    def thermalize_momenta(atoms, temperature_K, *, rng=None):
        """Fallback for ASE < 3.29: ``MaxwellBoltzmannDistribution``."""
        _mbd(atoms, temperature_K=temperature_K, rng=rng)

A_CU = 3.61
BULK_TEMPERATURES = (300.0, 600.0, 900.0, 1200.0)
VACANCY_TEMPERATURES = (300.0, 900.0)
SURFACE_TEMPERATURES = (300.0, 600.0)
TIMESTEP_FS = 5.0
FRICTION_PER_FS = 0.02


def labelled_copy(atoms, kind, temperature_K):
    """Return a bare copy of ``atoms`` (no velocities) carrying its EMT energy, forces and stress."""
    energy = atoms.get_potential_energy()
    forces = atoms.get_forces()
    stress = atoms.get_stress()
    frame = Atoms(numbers=atoms.numbers, positions=atoms.positions, cell=atoms.cell, pbc=atoms.pbc)
    frame.info["kind"] = kind
    frame.info["temperature_K"] = float(temperature_K)
    frame.calc = SinglePointCalculator(frame, energy=energy, forces=forces, stress=stress)
    return frame


def md_snapshots(atoms, temperature_K, n_frames, rng, kind, equilibration=100, interval=10):
    """Run EMT Langevin MD on a copy of ``atoms`` and return ``n_frames`` labelled snapshots."""
    atoms = atoms.copy()
    atoms.calc = EMT()
    thermalize_momenta(atoms, temperature_K, rng=rng)
    dyn = Langevin(atoms, timestep=TIMESTEP_FS * units.fs, temperature_K=temperature_K,
                   friction=FRICTION_PER_FS / units.fs, fixcm=False, rng=rng)
    dyn.run(equilibration)
    frames = []
    for _ in range(n_frames):
        dyn.run(interval)
        frames.append(labelled_copy(atoms, kind, temperature_K))
    return frames


def strained_cells(atoms, n_frames, rng, max_strain=0.03, max_volume_change=0.04, rattle=0.05):
    """Return ``n_frames`` randomly strained (3/4) or isotropically scaled (1/4), rattled, labelled cells."""
    n_volume = n_frames // 4
    frames = []
    for i in range(n_frames):
        strained = atoms.copy()
        if i < n_frames - n_volume:
            eps = rng.uniform(-max_strain, max_strain, size=(3, 3))
            eps = 0.5 * (eps + eps.T)
        else:
            eps = ((1.0 + rng.uniform(-max_volume_change, max_volume_change)) ** (1.0 / 3.0) - 1.0) * np.eye(3)
        strained.set_cell(strained.cell[:] @ (np.eye(3) + eps), scale_atoms=True)
        strained.rattle(stdev=rattle, rng=rng)
        strained.calc = EMT()
        frames.append(labelled_copy(strained, "strained", 0.0))
    return frames


def generate(seed=0, frames=40, quick=False):
    """Return the labelled Cu structures (bulk, strained, vacancy, surface) as a list of Atoms."""
    if quick:
        frames, repeat, slab_size, equilibration, interval = min(frames, 2), 1, (1, 1, 4), 10, 5
    else:
        repeat, slab_size, equilibration, interval = 2, (2, 2, 4), 100, 10
    half = max(1, frames // 2)
    md = dict(equilibration=equilibration, interval=interval)

    cell = bulk("Cu", "fcc", a=A_CU, cubic=True).repeat(repeat)
    vacancy = cell.copy()
    del vacancy[0]
    slab = fcc111("Cu", size=slab_size, vacuum=6.0, a=A_CU)
    slab.pbc = True

    n_runs = len(BULK_TEMPERATURES) + 1 + len(VACANCY_TEMPERATURES) + len(SURFACE_TEMPERATURES)
    rngs = iter([np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(n_runs)])

    out = []
    for T in BULK_TEMPERATURES:
        out += md_snapshots(cell, T, frames, next(rngs), "bulk", **md)
    out += strained_cells(cell, frames, next(rngs))
    for T in VACANCY_TEMPERATURES:
        out += md_snapshots(vacancy, T, half, next(rngs), "vacancy", **md)
    for T in SURFACE_TEMPERATURES:
        out += md_snapshots(slab, T, half, next(rngs), "surface", **md)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="cu_emt.extxyz", help="extxyz file to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed (MD, strains, rattles)")
    parser.add_argument("--frames", type=int, default=40, help="snapshots per bulk MD temperature")
    parser.add_argument("--quick", action="store_true", help="tiny set (small cells, few frames) for tests")
    args = parser.parse_args()

    t0 = time.perf_counter()
    frames = generate(seed=args.seed, frames=args.frames, quick=args.quick)
    write(args.output, frames, format="extxyz")
    counts = Counter(f.info["kind"] for f in frames)
    summary = ", ".join(f"{kind}={n}" for kind, n in counts.items())
    print(f"wrote {len(frames)} structures ({summary}; {sum(len(f) for f in frames)} atoms) "
          f"to {args.output} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
