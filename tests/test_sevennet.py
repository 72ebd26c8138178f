"""The SevenNet adapter on one process: predict, serial evaluate and the ASE calculator against
sevenn's own SevenNetCalculator('7net-0')."""
import pytest
import torch

import mlip_parallel
import potentials
from comparison import assert_close
from conftest import needs
from md import MLIPCalculator
from potentials.adapters.sevennet import SevenNet
from systems import in_many_chunks, oxide_triclinic, sevennet_reference

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
