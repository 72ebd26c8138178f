"""The SevenNet adapter on one process: predict, serial evaluate and the ASE calculator against
sevenn's own SevenNetCalculator('7net-0')."""
import numpy as np
import pytest
import torch

import mlip_parallel
import potentials
from comparison import assert_close
from conftest import needs, require
from md import MLIPCalculator
from potentials.adapters.sevennet import SevenNet
from systems import (copper_vacancy_hop, in_many_chunks, oxide_triclinic, phonon_frequencies, sevenn_calculator,
                     sevennet_reference)

pytestmark = [needs("sevenn"), pytest.mark.filterwarnings("ignore:::sevenn")]  # (quiet: its own deprecations)


@pytest.fixture(scope="module")
def sevennet():
    return SevenNet("7net-0")


def test_sevennet_adapter_matches_sevenn(sevennet):
    atoms = oxide_triclinic()
    reference = sevennet_reference(atoms)
    assert sevennet.cutoff == 5.0 and sevennet.layers == 5 and sevennet.dtype == torch.float32
    predicted = potentials.predict(sevennet, atoms)
    predicted.pop("energies")
    assert_close(predicted, reference, 1e-5, label="predict")
    distributed = mlip_parallel.evaluate(sevennet, atoms, comm=mlip_parallel.SerialBackend(), decompose=True)
    assert_close(distributed["energies"].sum(), reference["energy"], 1e-6, scale="each", label="sum of energies")
    distributed.pop("energies")
    assert_close(distributed, reference, 1e-5, label="evaluate")
    atoms.calc = MLIPCalculator(sevennet)
    assert_close(atoms.get_potential_energy(), reference["energy"], 1e-5, scale="each", label="MLIPCalculator")


def test_sevennet_memory_bounded_path_matches_sevenn(sevennet, monkeypatch):
    """The convolutions' edge steps in chunks of 61 edges (many per layer, ghost and image edges among
    them) against sevenn's calculator and against one pass over all edges, serial and decomposed
    (layerwise; wide mode's 25 Å shell is slow in such small chunks, and its path is model-agnostic)."""
    atoms = oxide_triclinic()
    reference = sevennet_reference(atoms)
    chunks = in_many_chunks(monkeypatch.setattr)
    plain = potentials.predict(sevennet, atoms, memory_budget_gb=float("inf"))
    assert chunks["edge sums"] == 0
    chunked = potentials.predict(sevennet, atoms, memory_budget_gb=1e-9)
    assert chunks["edge sums"] == sevennet.layers
    assert_close(chunked, plain, 1e-6, label="chunked vs plain")
    chunked.pop("energies")
    assert_close(chunked, reference, 1e-5, label="chunked")
    decomposed = mlip_parallel.evaluate(sevennet, atoms, memory_budget_gb=1e-9, comm=mlip_parallel.SerialBackend(), decompose=True)
    decomposed.pop("energies")
    assert_close(decomposed, reference, 1e-5, label="decomposed")


def test_sevennet_unknown_element(sevennet):
    atoms = oxide_triclinic()
    atoms.numbers[0] = 118  # Og: not in SevenNet-0's 89 elements
    with pytest.raises(potentials.UnknownSpeciesError, match="Og"):
        potentials.predict(sevennet, atoms)


def silicon_rattled():
    """8-atom diamond Si, rattled, its cell strained by 1 %: forces and stress to relax."""
    from ase.build import bulk

    atoms = bulk("Si", "diamond", a=5.43, cubic=True)
    atoms.set_cell(atoms.cell[:] @ [[1.01, 0.003, 0.0], [0.0, 0.995, 0.0], [0.0, 0.0, 1.0]], scale_atoms=True)
    atoms.rattle(0.05, seed=3)
    return atoms


def both_calculators(sevennet) -> tuple:
    """(name, ASE calculator) of ours at its defaults and of sevenn's own SevenNetCalculator('7net-0') (built once
    per process, ``systems.sevenn_calculator``)."""
    theirs = sevenn_calculator()
    theirs.reset()
    return ("ours", MLIPCalculator(sevennet)), ("sevenn", theirs)


@pytest.mark.parametrize("how", ["fire", "fire-cell", "bfgs"])
def test_relaxation_equals_sevenns_own_calculator(sevennet, how):
    """ASE's FIRE (of the positions, and of ASE's FrechetCellFilter degrees of freedom) and BFGS, 12 steps with our
    calculator at its defaults == with SevenNetCalculator('7net-0'): positions and cell to 1e-5 Å (float32), energies
    to 1e-5."""
    from ase.filters import FrechetCellFilter
    from ase.optimize import BFGS, FIRE

    relaxed = {}
    for name, calculator in both_calculators(sevennet):
        atoms = silicon_rattled()
        atoms.calc = calculator
        optimizer = BFGS if how == "bfgs" else FIRE
        optimizer(FrechetCellFilter(atoms) if how == "fire-cell" else atoms, logfile=None).run(fmax=1e-4, steps=12)
        relaxed[name] = {"positions": atoms.positions.copy(), "cell": atoms.cell[:].copy(),
                         "energy": atoms.get_potential_energy()}
    assert np.abs(relaxed["ours"]["positions"] - silicon_rattled().positions).max() > 1e-3  # the structure moved
    assert_close(relaxed["ours"], relaxed["sevenn"], 1e-5, scale="absolute", label=how)


@pytest.mark.parametrize("dynamics", ["verlet", "langevin"])
def test_ase_md_equals_sevenns_own_calculator(sevennet, dynamics):
    """ASE's VelocityVerlet and Langevin (its noise seeded), 20 steps of 1 fs from 600 K, with our calculator at its
    defaults == with SevenNetCalculator('7net-0'): positions to 1e-5 Å, velocities to 1e-5 Å/fs (float32)."""
    from ase import units
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.md.verlet import VelocityVerlet

    final = {}
    for name, calculator in both_calculators(sevennet):
        atoms = silicon_rattled()
        MaxwellBoltzmannDistribution(atoms, temperature_K=600, rng=np.random.default_rng(0))
        atoms.calc = calculator
        md = VelocityVerlet(atoms, timestep=units.fs) if dynamics == "verlet" else \
            Langevin(atoms, units.fs, temperature_K=600, friction=0.01 / units.fs, rng=np.random.default_rng(1))
        md.run(20)
        final[name] = {"positions": atoms.positions.copy(), "velocities": atoms.get_velocities() * units.fs}
    assert np.abs(final["ours"]["positions"] - silicon_rattled().positions).max() > 1e-2  # the atoms moved
    assert_close(final["ours"], final["sevenn"], 1e-5, scale="absolute", label=dynamics)


def test_phonopy_frequencies_equal_sevenns_own_calculator(sevennet):
    """phonopy's finite displacements (Si, 2×2×2 primitive cells, one displacement) with our calculator == with
    SevenNetCalculator: Γ's optical frequencies and X's and L's to 1e-3 THz (Γ's zero modes carry the square root of
    float32 rounding, ~1e-2 THz)."""
    require("phonopy")
    from ase.build import bulk

    frequencies = {name: phonon_frequencies(bulk("Si", "diamond", a=5.43), calculator)
                   for name, calculator in both_calculators(sevennet)}
    assert frequencies["ours"].max() > 10  # THz: Si's optical branch (15.5 THz)
    assert_close(frequencies["ours"], frequencies["sevenn"], 1e-3, scale="absolute", label="phonon frequencies")


def test_neb_equals_sevenns_own_calculator(sevennet):
    """ASE's NEB (3 moving images, the middle one climbing: the highest by the hop's symmetry, where two images would
    tie within rounding and each calculator climb its own; 8 FIRE steps) of a vacancy hop in copper with our
    calculator at its defaults, one per image == with SevenNetCalculator('7net-0'): the images' positions to 1e-5 Å,
    the band's energies to 1e-5 eV (float32). NEB(parallel=True) with ours against the band with sevenn's in one
    process: tests/mpi/sevennet_models.py."""
    from ase.mep import NEB
    from ase.optimize import FIRE
    from sevenn.calculator import SevenNetCalculator

    bands = {}
    makers = {"ours": lambda: MLIPCalculator(sevennet), "sevenn": lambda: SevenNetCalculator("7net-0")}
    for name, calculator in makers.items():
        initial, final = copper_vacancy_hop()
        images = [initial] + [initial.copy() for _ in range(3)] + [final]
        for image in images:
            image.calc = calculator()
        neb = NEB(images, climb=True)
        neb.interpolate()
        FIRE(neb, logfile=None).run(fmax=1e-3, steps=8)
        bands[name] = {"positions": np.array([image.positions for image in images]),
                       "energies": np.array([image.get_potential_energy() for image in images])}
    initial = copper_vacancy_hop()[0].positions
    assert np.abs(bands["ours"]["positions"][2] - initial).max() > 0.5  # the middle image on its way along the hop
    assert bands["ours"]["energies"][2] > bands["ours"]["energies"][0] + 0.1  # a barrier between the ends
    assert_close(bands["ours"], bands["sevenn"], 1e-5, scale="absolute", label="NEB")
