"""The contract every model keeps (potentials.base: the Trainable, MemoryModel and Splittable protocols) and the one
shape of the adapters (potentials.base.PackageModel): the rebuild keyword, an error class per family, the memory
model; the one helper that puts the process back (potentials/process.py); temporary patches of packages' modules
undone on any exit; fairchem's mixed experts made again when their weights change; MACE's copied code run only
under the mace-torch it was copied from."""
import copy
import os
import warnings

import numpy as np
import pytest
import torch

import potentials
from comparison import assert_beyond, assert_close
from conftest import needs
from potentials.base import MemoryModel, PackageModel, Splittable, Trainable
from potentials.errors import MLIPError
from systems import FAIRCHEM_DIR, GEOMETRIES, MACE_DIR, NEQUIP_DIR

CHUNKED = 1e-3  # memory_budget_gb: the chunked path (the default runs one pass where it fits)


ADAPTERS = {  # family: (module, model class, error class, a model of the test fixtures)
    "mace": pytest.param("mace", "MACE", "MACEModelError", lambda: potentials.MACE(MACE_DIR / "mace-zbl-f64.model"),
                         marks=needs("mace"), id="mace"),
    "nequip": pytest.param("nequip", "NequIPFramework", "NequIPFrameworkError",
                           lambda: potentials.NequIPFramework(NEQUIP_DIR / "nequip-zbl.ckpt"), marks=needs("nequip"),
                           id="nequip"),
    "sevennet": pytest.param("sevennet", "SevenNet", "SevenNetModelError", lambda: potentials.SevenNet("7net-0"),
                             marks=needs("sevenn"), id="sevennet"),
    "fairchem": pytest.param("fairchem", "FAIRChem", "FAIRChemModelError",
                             lambda: potentials.FAIRChem(FAIRCHEM_DIR / "esen.pt", dtype=torch.float64),
                             marks=needs("fairchem"), id="fairchem"),
}


def test_this_packages_models_keep_the_contract():
    for model in (potentials.LennardJones(0.01, 3.4, 8.5), potentials.SchNet(["Cu"], cutoff=4.0, seed=0),
                  potentials.PaiNN(["Cu"], cutoff=4.0, seed=0), potentials.NequIP(["Cu"], cutoff=4.0, seed=0)):
        assert isinstance(model, Trainable) and isinstance(model, MemoryModel), model
        assert isinstance(model, Splittable) == (not isinstance(model, potentials.LennardJones))
    schnet = potentials.SchNet(["Cu", "Ag"], cutoff=4.0, seed=0)
    schnet.set_reference_energies([-1.5, -2.5])
    assert np.array_equal(schnet.reference_energies(), [-1.5, -2.5])
    assert potentials.LennardJones().reference_energies() is None


@pytest.mark.parametrize("module, cls, error, build", ADAPTERS.values())
def test_every_adapter_has_one_shape(module, cls, error, build):
    """An adapter is a PackageModel keeping the protocols; its error class derives from MLIPError; it rebuilds from
    its ``hyperparameters`` = {"architecture": ..., its options} (a deep copy, as the EMA makes one) with the same
    state and results (float64: 1e-12); its memory model is its methods (no instance attribute over a class's)."""
    from importlib import import_module

    adapter = import_module(f"potentials.adapters.{module}")
    assert issubclass(getattr(adapter, error), MLIPError)
    model = build().double()
    assert type(model).__name__ == cls and isinstance(model, PackageModel)
    assert isinstance(model, Trainable) and isinstance(model, MemoryModel)
    assert isinstance(model, Splittable)  # (every adapter also trains in pipeline stages)
    assert "architecture" in model.hyperparameters
    assert not {k for k in vars(model) if k.endswith("_BYTES_PER_ROW") or k.endswith("_BYTES_PER_EDGE")}
    assert model.evaluation_bytes(100, 4000) > 0 and model.training_bytes(100, 4000) > model.evaluation_bytes(100, 4000)
    assert model.package_module is not None
    clone = copy.deepcopy(model)
    assert clone.state_dict().keys() == model.state_dict().keys()
    atoms = GEOMETRIES["small_cell"]()
    one, two = potentials.predict(model, atoms), potentials.predict(clone, atoms)
    assert_close(two["energy"], one["energy"], 1e-12 * max(1.0, abs(one["energy"])), scale="absolute", label="energy")
    assert_close(two["forces"], one["forces"], 1e-12, scale="absolute", label="forces")


@needs("sevenn")
def test_sevennet_checkpoints_of_before_the_shared_keyword_still_load(tmp_path):
    """A potentials checkpoint of a fine-tuned SevenNet written when its rebuild keyword was ``config``."""
    import json

    model = potentials.SevenNet("7net-0")
    potentials.save(model, tmp_path / "new.pt")
    payload = torch.load(tmp_path / "new.pt", weights_only=True)
    config = json.loads(payload["config"])
    config["hyperparameters"] = {"config": config["hyperparameters"]["architecture"]}
    torch.save(dict(payload, config=json.dumps(config)), tmp_path / "old.pt")
    old = potentials.load(tmp_path / "old.pt")
    assert old.hyperparameters.keys() == {"architecture"}
    atoms = GEOMETRIES["small_cell"]()
    atoms.numbers[:] = 14
    assert potentials.predict(old, atoms)["energy"] == potentials.predict(model, atoms)["energy"]


def test_process_kept_puts_back_exactly_what_changed(monkeypatch):
    """Variables set, changed or removed inside come back as they were; no other is written again (the
    environment is not cleared and refilled); with ``random``, ``dtype`` and ``warning_filters`` those too."""
    from potentials.process import process_kept

    monkeypatch.setenv("KEPT_CHANGED", "before")
    monkeypatch.setenv("KEPT_REMOVED", "before")
    monkeypatch.delenv("KEPT_ADDED", raising=False)
    written = []
    real_putenv, real_unsetenv = os.putenv, os.unsetenv
    torch.manual_seed(3)
    state, filters = torch.get_rng_state(), list(warnings.filters)
    with process_kept(random=True, dtype=True, warning_filters=True):
        os.environ["KEPT_CHANGED"] = "inside"
        del os.environ["KEPT_REMOVED"]
        os.environ["KEPT_ADDED"] = "inside"
        torch.set_default_dtype(torch.float64)
        torch.rand(5)
        warnings.simplefilter("ignore")
        monkeypatch.setattr(os, "putenv", lambda k, v: (written.append(os.fsdecode(k)), real_putenv(k, v)))
        monkeypatch.setattr(os, "unsetenv", lambda k: (written.append(os.fsdecode(k)), real_unsetenv(k)))
    assert os.environ["KEPT_CHANGED"] == "before" and os.environ["KEPT_REMOVED"] == "before"
    assert "KEPT_ADDED" not in os.environ
    assert sorted(written) == ["KEPT_ADDED", "KEPT_CHANGED", "KEPT_REMOVED"]
    assert torch.get_default_dtype() == torch.float32 and torch.equal(torch.get_rng_state(), state)
    assert warnings.filters == filters


@needs("mace")
def test_a_mace_patch_is_undone_when_a_warning_is_an_error(monkeypatch):
    """A block whose class the chunked path does not know warns; with warnings as errors that ends the forward
    after the product blocks were patched: none stays patched, and the next evaluation is MACE's own."""
    from potentials.adapters import mace_chunked as adapter

    model = potentials.MACE(MACE_DIR / "mace-zbl-f64.model")
    monkeypatch.setattr(adapter, "CHUNKED", ())
    monkeypatch.setattr(adapter, "_NOTED", set())
    atoms = GEOMETRIES["small_cell"]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="runs its own forward over all edges at once"):
            potentials.predict(model, atoms, memory_budget_gb=CHUNKED)
    blocks = [*model.mace.products, *model.mace.interactions]
    assert [m for m in blocks if "forward" in vars(m)] == []


@needs("mace")
def test_maces_copied_code_runs_only_under_the_version_it_was_copied_from(monkeypatch):
    """Under another mace-torch the interaction blocks keep MACE's own forward, with a note naming the version;
    the result equals the chunked path's (1e-12, float64)."""
    from potentials.adapters import mace_chunked as adapter

    model = potentials.MACE(MACE_DIR / "mace-zbl-f64.model")
    atoms = GEOMETRIES["fcc_bulk"]()
    chunked = potentials.predict(model, atoms, memory_budget_gb=CHUNKED)
    monkeypatch.setattr(adapter, "mace_version", lambda: "0.3.99")
    monkeypatch.setattr(adapter, "_NOTED", set())
    with pytest.warns(UserWarning, match=r"under mace-torch 0\.3\.99 \(written from 0\.3\.16\)"):
        own = potentials.predict(model, atoms, memory_budget_gb=CHUNKED)
    assert_close(own["forces"], chunked["forces"], 1e-12, scale="absolute", label="forces")


@needs("nequip")
def test_a_nequip_patch_is_undone_when_a_warning_is_an_error(monkeypatch):
    """The second interaction block with a kernel the chunked path does not know: its warning, raised as an
    error, ends the forward after the first block was patched; no module stays patched."""
    from potentials.adapters import nequip_layers as adapter

    model = potentials.NequIPFramework(NEQUIP_DIR / "nequip-zbl.ckpt")
    blocks = [m for m in model.framework.modules() if adapter._class_path(m).endswith("InteractionBlock")]
    assert len(blocks) > 1
    real = adapter._class_path
    monkeypatch.setattr(adapter, "_class_path", lambda obj: "x.OtherKernel" if obj is blocks[1].tp_scatter else real(obj))
    monkeypatch.setattr(adapter, "_NOTED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="OtherKernel runs its own forward"):
            potentials.predict(model, GEOMETRIES["small_cell"](), memory_budget_gb=CHUNKED)
    assert [m for b in blocks for m in (b.edge_mlp, b.tp_scatter) if "forward" in vars(m)] == []


@needs("fairchem")
def test_mixed_experts_are_mixed_again_when_their_weights_change():
    """A mixture-of-experts layer keeps its mixed weights for one set of coefficients; a change of its experts'
    weights in place (as an optimizer step makes) mixes them again: its output is fairchem's own forward's."""
    from fairchem.core.models.uma.nn.mole import MOLE

    model = potentials.FAIRChem(FAIRCHEM_DIR / "uma-moe.pt", task="omat", dtype=torch.float64)
    potentials.predict(model, GEOMETRIES["small_cell"]())  # sets the coefficients of one structure
    layer = next(m for m in model.backbone.modules() if type(m) is MOLE)
    x = torch.randn(7, layer.weights.shape[-1], dtype=torch.float64)
    before = layer(x)
    assert_close(before, MOLE.forward(layer, x), 1e-12, scale="absolute", label="before")
    with torch.no_grad():
        layer.weights.mul_(1.5)
    after = layer(x)
    assert_beyond(after, before, 1e-8 + 1e-5 * float(before.abs().max()), scale="absolute", label="mixed again")
    assert_close(after, MOLE.forward(layer, x), 1e-12, scale="absolute", label="after")
