"""The SevenNet adapter on one process: predict, serial evaluate and the ASE calculator against
sevenn's own SevenNetCalculator('7net-0')."""
import numpy as np
import pytest
import torch

pytest.importorskip("sevenn", reason="SevenNet adapter needs the sevenn extra: pip install -e .[sevenn]")
pytestmark = pytest.mark.filterwarnings("ignore:::sevenn")  # sevenn's own deprecations

import mlip_parallel  # noqa: E402
import potentials  # noqa: E402
from md import MLIPCalculator  # noqa: E402
from potentials.adapters.sevennet import SevenNet  # noqa: E402
from systems import in_many_chunks, max_relative_error, oxide_triclinic, sevennet_reference  # noqa: E402


@pytest.fixture(scope="module")
def sevennet():
    return SevenNet("7net-0")


def test_sevennet_adapter_matches_sevenn(sevennet):
    atoms = oxide_triclinic()
    reference = sevennet_reference(atoms)
    assert sevennet.cutoff == 5.0 and sevennet.layers == 5 and sevennet.dtype == torch.float32
    predicted = potentials.predict(sevennet, atoms)
    predicted.pop("energies")
    assert max(max_relative_error(predicted, reference).values()) < 1e-5
    distributed = mlip_parallel.evaluate(sevennet, atoms, comm=mlip_parallel.SerialBackend())
    assert np.isclose(distributed["energies"].sum(), reference["energy"], rtol=1e-6)
    distributed.pop("energies")
    assert max(max_relative_error(distributed, reference).values()) < 1e-5
    atoms.calc = MLIPCalculator(sevennet)
    assert abs(atoms.get_potential_energy() - reference["energy"]) < 1e-5 * abs(reference["energy"])


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
    assert max(max_relative_error(chunked, plain).values()) < 1e-6
    chunked.pop("energies")
    assert max(max_relative_error(chunked, reference).values()) < 1e-5
    decomposed = mlip_parallel.evaluate(sevennet, atoms, memory_budget_gb=1e-9, comm=mlip_parallel.SerialBackend())
    decomposed.pop("energies")
    assert max(max_relative_error(decomposed, reference).values()) < 1e-5


def test_sevennet_unknown_element(sevennet):
    atoms = oxide_triclinic()
    atoms.numbers[0] = 118  # Og: not in SevenNet-0's 89 elements
    with pytest.raises(potentials.UnknownSpeciesError, match="Og"):
        potentials.predict(sevennet, atoms)
