"""The nequip-framework adapter (potentials.NequIPFramework: NequIP and Allegro models from .ckpt or
.nequip.zip) on one process against the framework's own ASE calculator; the process's global state left
as it was; bad files named; mlip-md and mlip-lammps driving it on 2 ranks. tests/mpi/nequip_models.py
runs the comparison on 2-4 ranks. The fixtures (tests/data/nequip) are made by make_fixtures.py."""
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:::nequip")  # the framework's own deprecations

import mlip_parallel
import potentials
from comparison import assert_close
from conftest import needs
from md import MLIPCalculator
from potentials.adapters.nequip import NequIPFrameworkError
from systems import (ALLEGRO_PRUNED, GEOMETRIES, NEQUIP_DIR, NEQUIP_FIXTURES, allegro_architecture,
                     in_many_chunks, nequip_reference, run_md_comparison)

pytestmark = needs("nequip")  # (and the Allegro cases nequip-allegro, both of the nequip extra)
FILES = [NEQUIP_DIR / f"{name}{suffix}" for name in NEQUIP_FIXTURES for suffix in (".ckpt", ".nequip.zip")]


def allegro_needs(name: str):
    """``name`` as a parameter, needing nequip-allegro where it is an Allegro model."""
    return pytest.param(name, marks=needs("allegro") if "allegro" in str(name) else (), id=Path(str(name)).name)


@pytest.mark.parametrize("path", [allegro_needs(path) for path in FILES])
def test_equals_the_frameworks_calculator(path):
    """predict, serial evaluate (layerwise; wide for the small geometries) and MLIPCalculator == the
    framework's NequIPCalculator on every geometry, to 1e-9 relative (float64)."""
    model = potentials.NequIPFramework(path)
    assert model.dtype == torch.float64 and model.species == ["Cu", "Ag"] and model.cutoff == 4.5
    assert model.layers == (3 if path.name.startswith("nequip") else 1)
    for geometry, make in GEOMETRIES.items():
        atoms = make()
        reference = nequip_reference(path, atoms)
        results = [potentials.predict(model, atoms), mlip_parallel.evaluate(model, atoms, comm="serial", decompose=True)]
        if geometry in ("clusters", "small_cell"):
            results.append(mlip_parallel.evaluate(model, atoms, mode="wide", comm="serial", decompose=True))
        for result in results:
            result.pop("energies")
            assert_close(result, reference, 1e-9, label=geometry)
    atoms = GEOMETRIES["sheared"]()
    reference = nequip_reference(path, atoms)
    atoms.calc = MLIPCalculator(model)
    via = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    assert_close(via, reference, 1e-9, label="MLIPCalculator")


def test_loading_leaves_the_process_as_it_was():
    """The framework's set_global_state (float64 default dtype, seeds, e3nn and torch settings, environment
    variables) runs while loading; afterwards the default dtype, every random state, the environment and
    e3nn's defaults are what they were, also after an evaluation."""
    import e3nn

    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    before = (torch.get_default_dtype(), torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate(),
              dict(os.environ), dict(e3nn.get_optimization_defaults()))
    for path in FILES[:2]:
        model = potentials.NequIPFramework(path)
        potentials.predict(model, GEOMETRIES["small_cell"]())
    after = (torch.get_default_dtype(), torch.get_rng_state(), np.random.get_state()[1], random.getstate(),
             dict(os.environ), dict(e3nn.get_optimization_defaults()))
    assert after[0] == before[0] == torch.float32
    assert torch.equal(after[1], before[1]) and np.array_equal(after[2], before[2]) and after[3] == before[3]
    assert after[4] == before[4] and after[5] == before[5]


def test_bad_files_are_named(tmp_path):
    for name in ("model.nequip.pth", "model.nequip.pt2"):
        with pytest.raises(NequIPFrameworkError, match="a compiled nequip model .* pass the .nequip.zip package or "
                                                       "the .ckpt checkpoint"):
            potentials.NequIPFramework(tmp_path / name)
    with pytest.raises(NequIPFrameworkError, match="none.ckpt: no such file"):
        potentials.NequIPFramework(tmp_path / "none.ckpt")
    (tmp_path / "model.pt").write_bytes(b"x")
    with pytest.raises(NequIPFrameworkError, match="not a nequip-framework model file"):
        potentials.NequIPFramework(tmp_path / "model.pt")
    data = FILES[0].read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 3])
    with pytest.raises(NequIPFrameworkError, match="cut.ckpt: the nequip framework cannot load it"):
        potentials.NequIPFramework(tmp_path / "cut.ckpt")
    atoms = GEOMETRIES["small_cell"]()
    atoms.numbers[0] = 26
    with pytest.raises(potentials.UnknownSpeciesError, match=r"\['Fe'\] not known to NequIPFramework"):
        potentials.predict(potentials.NequIPFramework(FILES[1]), atoms)
    assert type(potentials.load_model(f"nequip:{FILES[1]}")).__name__ == "NequIPFramework"


@needs("lammps")
def test_md_on_two_ranks_equals_one_process(mpirun, tmp_path):
    """mlip-md with ``model: {nequip: FILE}`` (NequIP with ZBL, its package), NVE, 20 steps: 2 ranks == 1
    process to 1e-9 Å; mlip-lammps --model nequip:FILE on 2 ranks == mlip-md on 2 ranks to 1e-9 Å."""
    path = NEQUIP_DIR / "nequip-zbl.nequip.zip"
    decks = {"fix": ("fix ext all external pf/callback 1 1", ["--model", f"nequip:{path}"])}
    errors, _ = run_md_comparison(mpirun, tmp_path, {"nequip": str(path)}, decks)
    assert errors["moved"] > 0.05, errors
    assert_close({k: errors[k] for k in ("md2", "fix")}, {"md2": 0.0, "fix": 0.0}, 1e-9, scale="absolute",
                 label="final positions (Å)")
    assert "fix ext external: NequIPFramework (Cu Ag; cutoff 4.5 A, 3 layer(s))" in (tmp_path / "fix.log").read_text()


def test_mlip_train_eval_scores_a_nequip_file(tmp_path):
    """``mlip-train eval nequip:FILE DATA`` on data labelled by the framework's calculator: rounding level."""
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from mlip_parallel.train.cli import evaluate_model

    frames = []
    for geometry in ("fcc_bulk", "sheared"):
        atoms = GEOMETRIES[geometry]()
        ref = nequip_reference(FILES[1], atoms)
        atoms.calc = SinglePointCalculator(atoms, energy=float(ref["energy"]), forces=ref["forces"], stress=ref["stress"])
        frames.append(atoms)
    write(tmp_path / "labelled.traj", frames)
    errors = evaluate_model(f"nequip:{FILES[1]}", str(tmp_path / "labelled.traj"))
    maes = ("energy_mae", "forces_mae", "stress_mae")
    assert_close({k: errors[k] for k in maes}, dict.fromkeys(maes, 0.0), 1e-10, scale="absolute")


@pytest.mark.parametrize("name", [allegro_needs(name) for name in NEQUIP_FIXTURES])
def test_md_force_call_of_a_framework_model_is_memory_bounded(name):
    """One MD force call on 500 Cu atoms keeps at most its chunk budget + 50 KB per atom in saved tensors
    (measured 33 for NequIP: its per-atom features and edge embedding; 3 for Allegro, run in groups of
    atoms), and one pass over all edges (training's path) several times more: the all-edges path cannot
    come back into evaluation unnoticed."""
    from ase.build import bulk

    from test_md import md_force_call_saved_bytes

    model = potentials.NequIPFramework(NEQUIP_DIR / f"{name}.nequip.zip")
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((5, 5, 5))
    atoms.rattle(0.05, seed=0)
    saved = md_force_call_saved_bytes(model, atoms)
    bounded, budget_gb = saved["chunks"]
    assert bounded <= budget_gb * 1e9 + 50e3 * len(atoms), (bounded / len(atoms), budget_gb)
    assert saved[float("inf")][0] > 3 * bounded, saved


@pytest.mark.parametrize("name", [allegro_needs(name) for name in NEQUIP_FIXTURES])
def test_memory_bounded_path_in_many_chunks_equals_one_pass(name, monkeypatch):
    """One process (predict and a serial evaluate), a 1-byte budget and 61-edge chunks: NequIP's convolutions
    in many chunks per block, Allegro in many groups of atoms; == one pass over all edges to 1e-12 and ==
    NequIPCalculator to 1e-9 (float64), on every geometry; chunks did run."""
    chunks = in_many_chunks(monkeypatch.setattr)
    path = NEQUIP_DIR / f"{name}.nequip.zip"
    model = potentials.NequIPFramework(path)
    for geometry, make in GEOMETRIES.items():
        atoms = make()
        reference = nequip_reference(path, atoms)
        plain = potentials.predict(model, atoms, memory_budget_gb=float("inf"))
        plain.pop("energies")
        for result in (potentials.predict(model, atoms, memory_budget_gb=1e-9),
                       mlip_parallel.evaluate(model, atoms, memory_budget_gb=1e-9, comm=mlip_parallel.SerialBackend(), decompose=True)):
            result = {k: v for k, v in result.items() if k != "energies"}
            assert_close(result, plain, 1e-12, label=f"{geometry} chunked vs plain")
            assert_close(result, reference, 1e-9, label=geometry)
    assert chunks["edge sums"] + chunks["checkpoints"] > 2 * len(GEOMETRIES), chunks


PART_CASES = {"nequip-zbl.ckpt": {"path": NEQUIP_DIR / "nequip-zbl.ckpt"},
              "nequip-zbl.nequip.zip": {"path": NEQUIP_DIR / "nequip-zbl.nequip.zip"},
              "allegro.nequip.zip": {"path": NEQUIP_DIR / "allegro.nequip.zip"},
              "allegro-pruned-zbl": {"architecture": "allegro-pruned"}}


@pytest.mark.parametrize("case", [allegro_needs(case) for case in PART_CASES])
def test_parts_chained_equal_the_frameworks_forward(case):
    """As pipeline parts, chained: == the framework's forward to 1e-12 on three geometries (float64). NequIP:
    embed the type embedding, block k layer k, readout the energy readout, per-type shifts and ZBL; h per node.
    Allegro: embed the two-body embeddings and the first projection, block k its layer k, readout the edge
    readout and sums; h per edge (also with per-edge-type cutoffs that prune edges, three layers and ZBL). Stages
    hold exactly their parts and together the whole state; a stage's deep copy (an EMA's) keeps its parts; a
    stage alone neither evaluates nor writes a checkpoint. An Allegro module this code does not know does not split."""
    import copy

    from potentials.adapters import allegro_layers
    from potentials.base import BlockPotential, stage_parts
    from potentials.predict import energy_forces

    def build():
        if "path" in PART_CASES[case]:
            return potentials.NequIPFramework(PART_CASES[case]["path"], **kwargs)
        return potentials.NequIPFramework(architecture=allegro_architecture(**ALLEGRO_PRUNED), **kwargs)

    kwargs = {}
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(0)
    chained = build()
    allegro = case.startswith("allegro")
    assert (model.n_blocks, model.layers, model.state_per_edge) == \
        ((3 if "pruned" in case else 2), 1, True) if allegro else (3, 3, False)
    chained.forward = lambda graph: BlockPotential.forward(chained, graph)
    contexts, context = [], chained.context
    chained.context = lambda graph: contexts.append(context(graph)) or contexts[-1]
    for geometry in ("sheared", "slab", "clusters"):
        atoms = GEOMETRIES[geometry]()
        mine = [t.detach().numpy() for t in energy_forces(chained, atoms, memory_budget_gb=float("inf"))]
        theirs = [t.detach().numpy() for t in energy_forces(model, atoms, memory_budget_gb=float("inf"))]
        assert_close(dict(zip("efs", mine)), dict(zip("efs", theirs)), 1e-12, label=geometry)
    # the per-edge-type cutoffs did drop edges (the state still has a row per graph edge); none without them
    if "pruned" in case:
        assert sum(len(c["kept"]) for c in contexts) < sum(c["edges"] for c in contexts), case
    else:
        assert all(c["kept"] is None for c in contexts), case
    boundaries = [0, 1, model.n_blocks]
    kwargs = {"parts": None}
    stages = []
    for s in (0, 1):
        kwargs["parts"] = stage_parts(model.n_blocks, boundaries, s)
        stages.append(build())
    held = {}
    for stage in stages:
        state = stage.state_dict()
        assert {stage.part_of(k) for k in state} == set(stage.parts) | {None}
        held.update(state)
        assert copy.deepcopy(stage).parts == stage.parts
        with pytest.raises(RuntimeError, match="holds only the parts"):
            potentials.predict(stage, GEOMETRIES["slab"]())
    assert set(held) == set(model.state_dict())
    with pytest.raises(NequIPFrameworkError, match="a pipeline stage"):
        stages[0].save_native("never.ckpt")
    if allegro:
        unknown = (*allegro_layers._READ, "a_later_attribute")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(allegro_layers, "_READ", unknown)
            with pytest.raises(NequIPFrameworkError, match=r"lacks \['a_later_attribute'\].* does not split into pipeline"):
                build()


def test_layers_are_read_from_the_model_not_from_its_exchange_slots(monkeypatch):
    """A three-layer NequIP built without ghost-exchange slots is still a three-layer model (it was taken for a
    strictly local one, an Allegro, and run with one cutoff of ghosts: wrong forces): wide mode (three cutoffs of
    ghosts) equals the framework's calculator, and layerwise evaluation with ghosts is refused, named; a network of
    neither kind is refused."""
    from potentials.adapters import nequip_loading

    load = nequip_loading.load_framework_model

    def without_slots(path, model_key="sole_model"):  # each slot a module of another class: no slot to fill
        model = load(path, model_key)
        slots = [m for m in model.modules() if type(m).__name__ == "NoOpGhostExchangeModule"]
        plain = type("PlainPassThrough", (type(slots[0]),), {})
        for module in slots:
            module.__class__ = plain
        return model

    monkeypatch.setattr(potentials.adapters.nequip, "load_framework_model", without_slots)
    path = NEQUIP_DIR / "nequip-zbl.ckpt"
    model = potentials.NequIPFramework(path)
    assert model.layers == 3 and not model.state_per_edge and not model.exchange_filled
    atoms = GEOMETRIES["small_cell"]()
    reference = nequip_reference(path, atoms)
    wide = mlip_parallel.evaluate(model, atoms, mode="wide", comm="serial", decompose=True)
    assert_close({k: wide[k] for k in reference}, reference, 1e-9, label="wide")
    with pytest.raises(NequIPFrameworkError, match="ghost-exchange slots cannot be filled .* wide mode"):
        mlip_parallel.evaluate(model, atoms, comm="serial", decompose=True)

    def renamed(path, model_key="sole_model"):
        model = load(path, model_key)
        network = model.model.func if hasattr(model.model, "func") else model.model
        network._modules = {name.replace("_convnet", "_block"): module for name, module in network._modules.items()}
        return model

    monkeypatch.setattr(potentials.adapters.nequip, "load_framework_model", renamed)
    with pytest.raises(NequIPFrameworkError, match="neither NequIP's layerK_convnet modules nor one Allegro_Module"):
        potentials.NequIPFramework(path)
