"""The equality tests of the other packages' models can fail: each fault a distributed evaluation could have, injected
into the comparison those tests make (a serial layerwise ``evaluate`` of a periodic cell, whose images are ghost rows,
against the package's own calculator), moves the result by more than 100 times the test's tolerance.

The faults: zeroed ghost rows (the halo hands back zeros), one skipped halo refresh between layers (the ghost rows keep
what the rank computed for them), a wrong species mapping (the first and last elements swapped), ghost gradients not
returned to their owners (the reverse exchange adds nothing) and the reference energies dropped. Allegro exchanges no
node features (strictly local: one cutoff of ghosts, no halo between its layers), so the first two cannot reach it:
its test shows that its evaluation calls no halo. fairchem's own sensitivity test is in tests/test_fairchem.py."""
import contextlib
import importlib.util

import numpy as np
import pytest
import torch

import mlip_parallel
import potentials
from mlip_parallel.comm import FeatureHalo, _ForwardComm
from systems import GEOMETRIES, NEQUIP_DIR, mace_fixture, max_relative_error, nequip_reference, \
    oxide_triclinic, sevennet_reference

pytestmark = pytest.mark.filterwarnings("ignore:::(mace|e3nn|nequip|allegro|sevenn)")

FAULTS = ("zeroed ghost rows", "one skipped halo refresh", "wrong species mapping", "ghost gradients dropped",
          "reference energies dropped")


def needs(*modules):
    return pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in modules), reason=f"needs {modules}")


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
    """Within it, the fault ``name`` in the halo, the species mapping or the model (undone after); ``calls``
    collects the halo's calls."""
    halo, species_index = FeatureHalo.__call__, type(model).species_index
    backward, before = _ForwardComm.backward, model.reference_energies()

    def counted(self, h):
        calls.append(h.shape[0])
        if name == "zeroed ghost rows":
            out = halo(self, h)
            return torch.cat([out[: self.comm.n_local], torch.zeros_like(out[self.comm.n_local:])])
        if name == "one skipped halo refresh" and len(calls) == 1 and h.shape[0] == self.comm.n_local + self.comm.n_ghost:
            return h  # the ghost rows as this rank left them
        return halo(self, h)

    def swapped(self, numbers):
        index = species_index(self, numbers)
        first, last = index.min(), index.max()
        return np.where(index == first, last, np.where(index == last, first, index))

    FeatureHalo.__call__ = counted
    try:
        if name == "wrong species mapping":
            type(model).species_index = swapped
        elif name == "ghost gradients dropped":
            _ForwardComm.backward = staticmethod(lambda ctx, grad: (grad.new_zeros(ctx.comm.n_local, *grad.shape[1:]),
                                                                    None))
        elif name == "reference energies dropped":
            model.set_reference_energies(np.zeros_like(before))
        yield
    finally:
        FeatureHalo.__call__, type(model).species_index, _ForwardComm.backward = halo, species_index, backward
        model.set_reference_energies(before)


@pytest.mark.parametrize("case", CASES.values())
def test_every_fault_moves_the_comparison_far_beyond_its_tolerance(case):
    build, atoms, reference, tolerance = case()
    model = build()

    def error() -> float:
        result = mlip_parallel.evaluate(model, atoms, comm=mlip_parallel.SerialBackend())
        return max(max_relative_error({k: result[k] for k in reference}, reference).values())

    calls = []
    with fault("none", model, calls):
        assert error() < tolerance
    local = type(model).__name__ == "NequIPFramework" and model.state_per_edge  # Allegro: no halo between layers
    assert (calls == []) == local, calls
    moved = {}
    for name in FAULTS:
        if local and name in FAULTS[:2]:
            continue
        calls = []
        with fault(name, model, calls):
            moved[name] = error()
    assert min(moved.values()) > 100 * tolerance, moved
    assert error() < tolerance  # every fault undone
