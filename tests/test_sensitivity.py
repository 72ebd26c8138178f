"""The equality tests of the other packages' models can fail: each fault a distributed evaluation could have, injected
into the comparison those tests make (a serial layerwise ``evaluate`` of a periodic cell, whose images are ghost rows,
against the package's own calculator), moves the result by more than 100 times the test's tolerance.

The faults: the halo's (tests/faults.py: stale ghost features, zeroed ghost rows, ghost gradients not sent home, the
same hook the MPI launches plant them with), a wrong species mapping (the first and last elements swapped) and the
reference energies dropped. Allegro exchanges no node features (strictly local: one cutoff of ghosts, no halo between
its layers), so the first two cannot reach it: its test shows that its evaluation calls no halo. fairchem's own
sensitivity test is in tests/test_fairchem.py."""
import contextlib

import numpy as np
import pytest

import mlip_parallel
import potentials
from comparison import compare
from conftest import needs
from faults import FAULTS, FEATURE_FAULTS, planted
from systems import GEOMETRIES, NEQUIP_DIR, mace_fixture, nequip_reference, oxide_triclinic, sevennet_reference

pytestmark = pytest.mark.filterwarnings("ignore:::(mace|e3nn|nequip|allegro|sevenn)")

MODEL_FAULTS = ("wrong species mapping", "reference energies dropped")


def mace_case():
    path, heads, geometries = mace_fixture("mace-zbl-f64")
    atoms, references = geometries["fcc_bulk"]
    reference = {k: v for k, v in references[heads[0]].items() if k != "virial"}
    return (lambda: potentials.MACE(path)), atoms, reference, 1e-9


def nequip_case(name):
    path = NEQUIP_DIR / f"{name}.ckpt"
    atoms = GEOMETRIES["fcc_bulk"]()
    return (lambda: potentials.NequIPFramework(path)), atoms, nequip_reference(path, atoms), 1e-9


def sevennet_case():
    atoms = oxide_triclinic()
    return (lambda: potentials.SevenNet("7net-0")), atoms, sevennet_reference(atoms), 1e-5


CASES = {"MACE": pytest.param(mace_case, marks=needs("mace"), id="MACE"),
         "NequIP": pytest.param(lambda: nequip_case("nequip-zbl"), marks=needs("nequip"), id="NequIP"),
         "Allegro": pytest.param(lambda: nequip_case("allegro"), marks=needs("nequip", "allegro"), id="Allegro"),
         "SevenNet": pytest.param(sevennet_case, marks=needs("sevenn"), id="SevenNet")}


@contextlib.contextmanager
def fault(name: str, model, calls: list):
    """Within it, the fault ``name`` in the halo (``faults.planted``), the species mapping or the model (undone
    after); ``calls`` collects the halo's refreshes."""
    species_index, before = type(model).species_index, model.reference_energies()

    def swapped(self, numbers):
        index = species_index(self, numbers)
        first, last = index.min(), index.max()
        return np.where(index == first, last, np.where(index == last, first, index))

    try:
        if name == "wrong species mapping":
            type(model).species_index = swapped
        elif name == "reference energies dropped":
            model.set_reference_energies(np.zeros_like(before))
        with planted(name if name in FAULTS else "none", calls):
            yield
    finally:
        type(model).species_index = species_index
        model.set_reference_energies(before)


@pytest.mark.parametrize("case", CASES.values())
def test_every_fault_moves_the_comparison_far_beyond_its_tolerance(case):
    build, atoms, reference, tolerance = case()
    model = build()

    def comparison():
        result = mlip_parallel.evaluate(model, atoms, comm=mlip_parallel.SerialBackend(), decompose=True)
        return compare({k: result[k] for k in reference}, reference, tolerance)

    calls = []
    with fault("none", model, calls):
        assert comparison().ok, comparison().message()
    local = type(model).__name__ == "NequIPFramework" and model.state_per_edge  # Allegro: no halo between layers
    assert (calls == []) == local, calls
    moved = {}
    for name in FAULTS + MODEL_FAULTS:
        if local and name in FEATURE_FAULTS:
            continue
        with fault(name, model, []):
            moved[name] = comparison()
    assert all(c.beyond(100 * tolerance) for c in moved.values()), {k: c.message() for k, c in moved.items()}
    assert comparison().ok  # every fault undone
