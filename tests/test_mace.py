"""The MACE adapter on one process against MACE's own calculator, and its loader's contracts: the pickle's
code never runs, saved constants are carried, the process's state is left as it was, bad files are named.

The fixtures (tests/data/mace, made by make_fixtures.py under e3nn 0.4.4) hold MACECalculator's results;
tests/mpi/mace_models.py runs the same comparison on 2-4 ranks."""
import importlib.util
import os
import pickle
import zipfile

import numpy as np
import pytest
import torch


import mlip_parallel
import potentials
from comparison import assert_beyond, assert_close
from conftest import needs
from md import MLIPCalculator
from potentials.adapters.mace import MACEModelError, load_mace
from potentials.pickled import codegen_tensors, read_module_tree, state_dict
from systems import (GEOMETRIES, MACE_DIR, MACE_FIXTURES, in_many_chunks, mace_fixture, mace_view,
                     run_md_comparison, write_small_mace)

# mace-torch (pip install -e .[mace] && pip install --no-deps mace-torch==0.3.16); its own deprecations quiet
pytestmark = [needs("mace"), pytest.mark.filterwarnings("ignore:::(mace|e3nn)")]


@pytest.fixture(autouse=True)
def environment(mace_environment):
    """MACE's own code (its calculator) in the environment it expects, put back after (conftest)."""


@pytest.fixture(scope="module")
def fixtures():
    return {name: mace_fixture(name) for name in MACE_FIXTURES}


@pytest.mark.parametrize("name", MACE_FIXTURES)
def test_fixture_equals_mace_calculator(fixtures, name):
    """Every head × geometry: predict, serial layerwise evaluate and MLIPCalculator == MACECalculator
    (under e3nn 0.4.4, where the file was written); float64 to 1e-9, float32 to 1e-5; dtype kept."""
    path, heads, geometries = fixtures[name]
    tolerance = 1e-5 if name.endswith("f32") else 1e-9
    for head in heads:
        model = potentials.MACE(path, head=head)
        assert model.dtype == (torch.float32 if name.endswith("f32") else torch.float64)
        assert model.species == ["Cu", "Ag"] and model.head == head
        for geometry, (atoms, references) in geometries.items():
            for result in (potentials.predict(model, atoms),
                           mlip_parallel.evaluate(model, atoms, comm=mlip_parallel.SerialBackend(), decompose=True)):
                assert_close(mace_view(result, references[head], atoms), references[head], tolerance,
                             label=f"{head} {geometry}")
        atoms, references = geometries["sheared"]
        atoms = atoms.copy()
        atoms.calc = MLIPCalculator(model)
        via = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
        assert_close(mace_view(via, references[head], atoms), references[head], tolerance,
                     label=f"{head} MLIPCalculator")


def test_wide_mode_equals_mace_calculator(fixtures):
    path, heads, geometries = fixtures["mace-zbl-f64"]
    model = potentials.MACE(path)
    for geometry in ("clusters", "small_cell", "fcc_bulk"):
        atoms, references = geometries[geometry]
        result = mlip_parallel.evaluate(model, atoms, mode="wide", comm=mlip_parallel.SerialBackend(), decompose=True)
        assert_close(mace_view(result, references["Default"], atoms), references["Default"], 1e-9, label=geometry)


def test_default_head_is_mace_calculators(fixtures):
    path, heads, _ = fixtures["mace-heads-f64"]
    assert heads == ["pbe", "default"] and potentials.MACE(path).head == "default"
    with pytest.raises(MACEModelError, match=r"no head 'omat'; the model's heads are \['pbe', 'default'\]"):
        potentials.MACE(path, head="omat")


def test_loader_carries_every_saved_tensor(fixtures):
    """The rebuilt model's state is the file's, tensor for tensor: its parameters and buffers (U matrices,
    E0s, scale/shift, ZBL constants) and the Wigner 3j constants e3nn 0.4.4 kept only in its generated
    TorchScript. Nothing the rebuild computed itself survives."""
    for name in MACE_FIXTURES:
        path = fixtures[name][0]
        tree = read_module_tree(path)
        saved = {**codegen_tensors(tree), **state_dict(tree)}
        loaded = load_mace(path)[0].state_dict()
        assert set(loaded) == set(saved), sorted(set(loaded) ^ set(saved))[:5]
        assert any("U_matrix" in key for key in saved)
        assert any("_w3j_" in key for key in saved) == (name != "mace-small-f32")  # scalars only: no 3j
        for key, value in saved.items():
            assert torch.equal(loaded[key], value.to(loaded[key].dtype)), (name, key)


def test_model_saved_under_current_e3nn(tmp_path, restore_environment):
    """A MACE model written in this environment (e3nn >= 0.6, whose generated code pickles differently)
    loads too, and equals the model it was saved from (MACE's calculator on it)."""
    from mace.calculators import MACECalculator

    path = tmp_path / "current.model"
    write_small_mace(path, seed=4)
    atoms = GEOMETRIES["hcp_triclinic"]()
    ours = potentials.predict(potentials.MACE(path), atoms)
    default = torch.get_default_dtype()
    atoms.calc = MACECalculator(model_paths=str(path), device="cpu", default_dtype="float64")
    reference = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    torch.set_default_dtype(default)  # MACE's calculator sets it for the process
    assert_close(mace_view(ours, reference, atoms), reference, 1e-9)


class RunsACommand:
    """Unpickling this runs ``touch MARKER`` (pickle calls os.system)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickle_that_runs_a_command_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.model"
    torch.save(RunsACommand(marker), path)
    with pytest.raises(MACEModelError, match=r"a posix\.system, not a MACE energy model"):
        potentials.MACE(path)
    assert not marker.exists()
    # the same payload inside a real MACE model file: the model loads, the command still does not run
    path = tmp_path / "evil-inside.model"
    with zipfile.ZipFile(fixture_path("mace-heads-f64")) as source:
        name = next(n for n in source.namelist() if n.endswith("/data.pkl"))
        data = source.read(name)
    data = data.replace(b"use_so3", b"xxx_so3")  # an unknown attribute, then the payload as its value
    evil = pickle.dumps(RunsACommand(marker), protocol=2)[2:-1]  # the object's opcodes, without PROTO/STOP
    at = data.index(b"xxx_so3") + len(b"xxx_so3") + 1  # after the BINPUT of the attribute name
    at = data.index(b"\x89", at)  # its value: NEWFALSE
    data = data[:at] + evil + data[at + 1:]
    rewrite_archive(fixture_path("mace-heads-f64"), path, name, data)
    model = potentials.MACE(path)
    assert not marker.exists() and model.layers == 2


def test_files_that_torch_load_would_run_are_refused_without_running(tmp_path, monkeypatch):
    """Neither path of torch.load that runs code is taken: a plain (legacy) pickle with a zip appended
    (torch.load would unpickle it with plain pickle) and a TorchScript archive (torch.load would hand it
    to torch.jit.load, whose __setstate__ code runs). With TORCH_FORCE_WEIGHTS_ONLY_LOAD set, MACE files
    still load, and the variable stays."""
    marker = tmp_path / "ran"
    legacy = tmp_path / "legacy.model"
    legacy.write_bytes(pickle.dumps(RunsACommand(marker)) + fixture_path("mace-small-f32").read_bytes())
    assert zipfile.is_zipfile(legacy)  # the end of the file is a zip: a loose zip test would accept it
    with pytest.raises(MACEModelError, match="legacy.model: not a torch.save archive"):
        potentials.MACE(legacy)
    assert not marker.exists()

    def refuse(*args, **kwargs):
        raise AssertionError("torch.jit.load called")

    monkeypatch.setattr(torch.jit, "load", refuse)
    scripted = torch.jit.script(torch.nn.Linear(2, 2))
    torch.jit.save(scripted, tmp_path / "scripted.model")
    with pytest.raises(MACEModelError, match="not a MACE energy model"):
        potentials.MACE(tmp_path / "scripted.model")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    assert potentials.MACE(fixture_path("mace-small-f32")).layers == 3
    assert os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] == "1"


def fixture_path(name):
    return MACE_DIR / f"{name}.model"


def rewrite_archive(source, target, member, data):
    """A copy of the torch zip ``source`` with ``member`` replaced by ``data``."""
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info, data if info.filename == member else zin.read(info.filename))


def test_block_class_it_cannot_rebuild_is_named(tmp_path):
    with zipfile.ZipFile(fixture_path("mace-heads-f64")) as source:
        name = next(n for n in source.namelist() if n.endswith("/data.pkl"))
        data = source.read(name)
    data = data.replace(b"RealAgnosticDensityResidualInteractionBlock", b"MyOwnDensityResidualInteractionBlocks")
    path = tmp_path / "custom.model"
    rewrite_archive(fixture_path("mace-heads-f64"), path, name, data)
    with pytest.raises(MACEModelError, match="interaction block mace.modules.blocks.MyOwnDensityResidualInteraction"
                                             "Blocks is not one this loader can rebuild"):
        potentials.MACE(path)


def test_bad_files_are_named(tmp_path):
    (tmp_path / "text.model").write_text("not a model")
    with pytest.raises(MACEModelError, match="text.model: not a torch.save archive"):
        potentials.MACE(tmp_path / "text.model")
    with pytest.raises(MACEModelError, match="none.model: no such file"):
        potentials.MACE(tmp_path / "none.model")
    data = fixture_path("mace-small-f32").read_bytes()
    (tmp_path / "cut.model").write_bytes(data[: len(data) // 2])
    with pytest.raises(MACEModelError, match="cut.model"):
        potentials.MACE(tmp_path / "cut.model")
    with pytest.raises(MACEModelError, match="a compiled .* pass the .model file it was made from"):
        potentials.MACE(tmp_path / "x.model-lammps.pt")
    atoms = GEOMETRIES["small_cell"]()
    atoms.numbers[0] = 26
    with pytest.raises(potentials.UnknownSpeciesError, match=r"\['Fe'\] not known to MACE; it knows \['Cu', 'Ag'\]"):
        potentials.predict(potentials.MACE(fixture_path("mace-small-f32")), atoms)


def test_loading_leaves_the_process_as_it_was(restore_environment, tmp_path):
    """Default dtype, the global random state and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD (which ``import mace``
    sets) are what they were; after ``import mace``, potentials.load still refuses a pickled model: a MACE
    file is named as one (and the key that reads it), a pickle of another module is refused unread."""
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    state, dtype = torch.get_rng_state(), torch.get_default_dtype()
    model = potentials.MACE(fixture_path("mace-zbl-f64"))
    potentials.predict(model, GEOMETRIES["small_cell"]())
    assert torch.equal(torch.get_rng_state(), state) and torch.get_default_dtype() == dtype
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in os.environ
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"  # as `import mace` (MACE's calculator) sets it
    with pytest.raises(potentials.CheckpointError, match=r"a MACE model file, not a potentials checkpoint: name it "
                                                         r"with the key mace \(model: \{mace: FILE\}"):
        potentials.load(fixture_path("mace-zbl-f64"))
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")
    with pytest.raises(potentials.CheckpointError, match="holds pickled Python objects, refused"):
        potentials.load(tmp_path / "module.pt")
    with pytest.raises(potentials.CheckpointError):
        potentials.load_model(str(fixture_path("mace-zbl-f64")))  # no "mace:": never read as a pickle


def test_mlip_train_eval_scores_a_mace_file(tmp_path, fixtures):
    """``mlip-train eval mace:FILE DATA`` on data labelled by MACE's calculator: errors at rounding level."""
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from mlip_parallel.train.cli import evaluate_model

    path, heads, geometries = fixtures["mace-heads-f64"]
    frames = []
    for geometry in ("fcc_bulk", "sheared", "small_cell"):
        atoms, references = geometries[geometry]
        atoms = atoms.copy()
        ref = references["pbe"]
        atoms.calc = SinglePointCalculator(atoms, energy=float(ref["energy"]), forces=ref["forces"],
                                           stress=ref["stress"])
        frames.append(atoms)
    write(tmp_path / "labelled.traj", frames)  # full precision (extxyz rounds positions to 1e-8 Å)
    errors = evaluate_model(f"mace:{path}", str(tmp_path / "labelled.traj"), head="pbe")
    maes = ("energy_mae", "forces_mae", "stress_mae")
    assert_close({k: errors[k] for k in maes}, dict.fromkeys(maes, 0.0), 1e-10, scale="absolute", label="head pbe")
    errors = evaluate_model(f"mace:{path}", str(tmp_path / "labelled.traj"))  # the default head: other labels
    assert_beyond(errors["forces_mae"], 0.0, 1e-4, scale="absolute", label="the default head's forces_mae")


@needs("lammps")
def test_md_and_lammps_deck_on_two_ranks_equal_one_process(mpirun, tmp_path):
    """mlip-md with ``model: {mace: FILE}``, NVE, 20 steps: 2 ranks == 1 process to 1e-9 Å; and a MACE
    user's LAMMPS deck (pair_style mace, no fix, no --model), and the deck with a fix external run with
    --model mace:FILE, through mlip-lammps on 2 ranks == mlip-md on 2 ranks to 1e-9 Å."""
    path = fixture_path("mace-zbl-f64")
    decks = {"pair_style": (f"pair_style mace no_domain_decomposition\npair_coeff * * {path}-lammps.pt Cu Ag", []),
             "fix": ("fix ext all external pf/callback 1 1", ["--model", f"mace:{path}"])}
    errors, _ = run_md_comparison(mpirun, tmp_path, {"mace": str(path)}, decks)
    assert errors["moved"] > 0.05, errors
    assert_close({k: errors[k] for k in ("md2", *decks)}, dict.fromkeys(("md2", *decks), 0.0), 1e-9,
                 scale="absolute", label="final positions (Å)")
    for name, fix in (("pair_style", "mlip_external"), ("fix", "ext")):
        text = (tmp_path / f"{name}.log").read_text()
        assert f"fix {fix} external: MACE (Cu Ag; cutoff 4.5 A, 2 layer(s))" in text, text[-2000:]


def test_import_prints_no_cuequivariance_notice():
    """mace-torch prints that cuEquivariance is missing on import, once per process (so once per rank of a
    job); the adapters never use it, and import_mace leaves the notice out (anything else it would print)."""
    import subprocess
    import sys

    from conftest import ROOT

    code = "from potentials.adapters.mace import import_mace; import_mace(); print('imported')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0 and run.stdout.strip() == "imported", run.stdout + run.stderr
    assert "cuequivariance" not in (run.stdout + run.stderr).lower()


INTERACTIONS = ("RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock",
                "RealAgnosticDensityInteractionBlock", "RealAgnosticDensityResidualInteractionBlock",
                "RealAgnosticResidualNonLinearInteractionBlock", "RealAgnosticAttResidualInteractionBlock")


def test_every_interaction_class_runs_its_edge_step_in_chunks(tmp_path, monkeypatch, restore_environment):
    """Every interaction class mace-torch ships (a random model of each, float64): evaluation with the edge
    steps in many 61-edge chunks (a 1-byte budget) == one pass over all edges (MACE's own forward) to 1e-12,
    through predict (a triclinic cell) and a decomposed evaluate (a slab); the chunked path ran for each class, and the
    MACECalculator of one model agrees with the chunked path to 1e-9. (The e3nn 0.4.4 fixtures run chunked
    against MACECalculator on 1-4 ranks in tests/mpi/mace_models.py.)"""
    from mace.calculators import MACECalculator

    chunks = in_many_chunks(monkeypatch.setattr)
    for interaction in INTERACTIONS:
        path = tmp_path / f"{interaction}.model"
        write_small_mace(path, seed=2, interaction=interaction, first="RealAgnosticInteractionBlock")
        model = potentials.MACE(path)
        assert [type(b).__name__ for b in model.mace.interactions][1] == interaction
        for geometry, evaluation in (("hcp_triclinic", potentials.predict), ("slab", mlip_parallel.evaluate)):
            atoms = GEOMETRIES[geometry]()
            before = chunks["edge sums"]
            chunked = evaluation(model, atoms, memory_budget_gb=1e-9)
            plain = evaluation(model, atoms, memory_budget_gb=float("inf"))
            assert chunks["edge sums"] > before, (interaction, geometry)
            assert_close(chunked, plain, 1e-12, label=f"{interaction} {geometry}")
    atoms = GEOMETRIES["hcp_triclinic"]()
    chunked = potentials.predict(model, atoms, memory_budget_gb=1e-9)
    atoms.calc = MACECalculator(model_paths=str(path), device="cpu", default_dtype="float64")
    reference = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    assert_close(mace_view(chunked, reference, atoms), reference, 1e-9)


def test_md_force_call_of_a_mace_model_is_memory_bounded():
    """One MD force call of the mace-small-f32 fixture (three residual interactions) on 500 Cu atoms keeps at
    most its chunk budget + 100 KB per atom in saved tensors (measured ~75: the products' per-atom
    tensors and the edge features), and one pass over all edges (training's path) keeps several times
    more: the all-edges path cannot come back into evaluation unnoticed."""
    from ase.build import bulk

    from test_md import md_force_call_saved_bytes

    path, _, _ = mace_fixture("mace-small-f32")
    model = potentials.MACE(path)
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((5, 5, 5))
    atoms.rattle(0.05, seed=0)
    saved = md_force_call_saved_bytes(model, atoms)
    bounded, budget_gb = saved["chunks"]
    assert bounded <= budget_gb * 1e9 + 100e3 * len(atoms), (bounded / len(atoms), budget_gb)
    assert saved[float("inf")][0] > 3 * bounded, saved


@pytest.mark.parametrize("name", MACE_FIXTURES)
def test_parts_chained_equal_maces_forward(fixtures, name):
    """As pipeline parts (embed, block k with its readout, readout with scale/shift and E0s), chained in one
    process: == MACE's own forward (every head, float64; the ZBL fixture's pair energy travels in the energy
    column) to 1e-12 relative. A stage (``parts``) holds exactly its parts' weights and the shared buffers,
    the stages together hold the whole state, a deep copy (an EMA's) keeps its parts, and a stage alone
    neither evaluates nor writes a .model file."""
    import copy

    from potentials.base import BlockPotential, stage_parts
    from potentials.predict import energy_forces

    path, heads, geometries = fixtures[name]
    for head in heads:
        model = potentials.MACE(path, head=head).double()
        chained = potentials.MACE(path, head=head).double()
        chained.forward = lambda graph, chained=chained: BlockPotential.forward(chained, graph)
        for geometry in ("sheared", "slab", "clusters"):
            atoms = geometries[geometry][0]
            mine = dict(zip(("energies", "forces", "strain"), energy_forces(chained, atoms, memory_budget_gb=float("inf"))))
            theirs = dict(zip(("energies", "forces", "strain"), energy_forces(model, atoms, memory_budget_gb=float("inf"))))
            assert_close(mine, theirs, 1e-12, label=f"{head} {geometry}")
    whole = model.state_dict()
    stages = [potentials.MACE(path, head=head, parts=stage_parts(model.layers, [0, 1, model.layers], s)) for s in (0, 1)]
    held = {}
    for stage in stages:
        state = stage.state_dict()
        assert {stage.part_of(k) for k in state} == set(stage.parts) | {None}, stage.parts
        held.update(state)
        assert copy.deepcopy(stage).parts == stage.parts
        with pytest.raises(RuntimeError, match="holds only the parts"):
            potentials.predict(stage, geometries["slab"][0])
    assert set(held) == set(whole) and all(torch.equal(held[k].double(), whole[k].double()) for k in whole)
    with pytest.raises(MACEModelError, match="a pipeline stage"):
        stages[0].save_native("never.model")
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in model.parameters())


@pytest.mark.slow  # (runs mace_run_train)
def test_a_model_mace_run_train_writes_loads_in_every_tool(tmp_path, restore_environment):
    """mace_run_train itself, in this environment (1 epoch on 14 EMT-labelled Cu structures under MACE users' label
    names REF_energy / REF_forces / REF_stress, float64), writes tiny.model, whose second interaction's traced tensor
    product holds e3nn's folded constants (``_compiled_main_left_right._tensor_constant0``: a Wigner-3j times its path
    normalisation, which a strict load once refused): the calculator on it equals
    MACECalculator to 1e-9; mlip-md runs it; mlip-train reads the same file under the same label names and fine-tunes
    it; mlip-train eval scores it. The TorchScript tiny_compiled.model MACE writes beside it is refused in one line
    naming the file to give."""
    import subprocess
    import sys

    import yaml
    from ase.build import bulk
    from ase.io import write
    from mace.calculators import MACECalculator

    from md.cli import main as md_main
    from mlip_parallel.train.cli import RULES, SCHEMA, evaluate_model, train, validate

    spec = importlib.util.spec_from_file_location("generator", mlip_parallel.__path__[0] + "/../examples/"
                                                  "generate_cu_emt_data.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    frames = generator.generate(seed=0, quick=True)
    for atoms in frames:  # the labels under MACE's usual names, no calculator
        atoms.info["REF_energy"], atoms.arrays["REF_forces"] = atoms.get_potential_energy(), atoms.get_forces()
        atoms.info["REF_stress"] = atoms.get_stress()
        atoms.calc = None
    write(tmp_path / "train.xyz", frames, format="extxyz")
    keys = {"energy": "REF_energy", "forces": "REF_forces", "stress": "REF_stress"}
    command = [sys.executable, "-c", "from mace.cli.run_train import main; main()", "--name", "tiny",
               "--train_file", "train.xyz", "--valid_fraction", "0.2", "--E0s", "average", "--model", "MACE",
               "--hidden_irreps", "32x0e + 32x1o", "--r_max", "4.0", "--batch_size", "2", "--valid_batch_size", "2",
               "--max_num_epochs", "1", "--device", "cpu", "--default_dtype", "float64", "--num_interactions", "2",
               "--correlation", "3", "--max_L", "1", "--num_radial_basis", "4", "--seed", "1",
               *[f"--{q}_key={name}" for q, name in keys.items()]]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    path = tmp_path / "tiny.model"
    from potentials.pickled import codegen_tensors, read_module_tree
    folded = [k for k in codegen_tensors(read_module_tree(path)) if "_tensor_constant" in k]
    assert folded, "the file should hold e3nn's folded constants (the case the loader must tolerate)"
    with pytest.raises(MACEModelError, match=r"tiny_compiled.model: a TorchScript archive of a "  # (written beside it)
                                             r"mace.modules.models.ScaleShiftMACE .*give the .model file MACE's training "
                                             r"writes beside it \(the same name without _compiled\)"):
        potentials.MACE(tmp_path / "tiny_compiled.model")
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.05, seed=3)
    default = torch.get_default_dtype()
    atoms.calc = MACECalculator(model_paths=str(path), device="cpu", default_dtype="float64")
    reference = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    torch.set_default_dtype(default)  # MACE's calculator sets it for the process
    atoms.calc = MLIPCalculator(potentials.MACE(path))
    ours = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    assert_close(mace_view(ours, reference, atoms), reference, 1e-9)
    md = {"model": {"mace": str(path)}, "structure": {"element": "Cu", "crystal": "fcc", "a": 3.6,
                                                       "repeat": [2, 2, 2]},
          "temperature_K": 300, "ensemble": "nve", "timestep_fs": 1.0, "steps": 4, "seed": 1,
          "output": {"directory": str(tmp_path / "md"), "thermo_every": 2}}
    (tmp_path / "md.yaml").write_text(yaml.safe_dump(md))
    assert md_main([str(tmp_path / "md.yaml")]) == 0
    rows = train(validate({"data": {"train": str(tmp_path / "train.xyz"), "validation_fraction": 0.25, "keys": keys},
                           "model": {"mace": str(path), "dtype": "float64"}, "epochs": 1, "batch_size": 4,
                           "output": {"directory": str(tmp_path / "finetuned"), "progress": False}}, SCHEMA, RULES))
    assert len(rows) == 1 and np.isfinite(rows[0]["val_loss"]) and (tmp_path / "finetuned" / "best.model").exists()
    errors = evaluate_model(f"mace:{path}", str(tmp_path / "train.xyz"), keys=keys)
    assert np.isfinite(errors["forces_mae"]) and errors["forces_mae"] > 0


def test_files_from_maces_accelerated_training_and_torch_compile_load(tmp_path, restore_environment):
    """Two files a MACE user brings, each equal to MACECalculator on the model to 1e-9 (float64):
    mace-cueq-f64.model, which mace_run_train wrote after training with cuEquivariance's layers and converting
    them back to e3nn (tests/data/mace/make_cueq_fixture.py), and that model saved after MACE's preparation for
    torch.compile (``mace.tools.compile.prepare``: its symmetric contractions traced by torch.fx, whose pickled
    bodies keep only the tensors the traced forward reads, not the ``weights_*_zeroed`` flags) and torch.compile
    (a wrapper pickled around the module), its readout's activation traced too (MACE registers it for tracing
    when it builds a readout), the gate only in its code. These facts are asserted of the file, so the test
    covers them; without the flags taken from the rebuilt model the strict load refused the second file, and
    with the gate not read from the traced code it was silently rebuilt linear (17 % off in energy)."""
    import subprocess
    import sys

    from ase.build import bulk
    from mace.calculators import MACECalculator

    from potentials.pickled import COMPILED_MODULE, Pickled, _check_archive, _load_archive, _opened, \
        traced_prefixes

    cueq = os.path.join(MACE_DIR, "mace-cueq-f64.model")
    compiled = tmp_path / "compiled.model"
    # in a process of its own: MACE's preparation changes torch.compile's settings for the process. Registering the
    # activation for tracing is what building a MACE readout does (the process's first build, or this line).
    code = ("import torch; from e3nn import nn; from mace.tools.compile import prepare, simplify_if_compile; "
            "torch.set_default_dtype(torch.float64); simplify_if_compile(nn.Activation); "
            f"torch.save(torch.compile(prepare(lambda: torch.load({cueq!r}, weights_only=False))()), {str(compiled)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    default = torch.get_default_dtype()
    with _opened(_check_archive(compiled)) as archive:  # the file as pickled: torch.compile's wrapper outside
        outer = _load_archive(archive, "compiled")
    assert isinstance(outer, Pickled) and type(outer).path == COMPILED_MODULE
    tree = read_module_tree(compiled)
    assert "readouts.1.non_linearity." in traced_prefixes(tree)  # traced: its gate is in its code only
    assert traced_prefixes(tree) and not any(k.endswith("_zeroed") for k in state_dict(tree))
    assert any(k.endswith("_zeroed") for k in state_dict(read_module_tree(cueq)))
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.05, seed=3)
    atoms.calc = MACECalculator(model_paths=cueq, device="cpu", default_dtype="float64")
    reference = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    torch.set_default_dtype(default)  # MACE's calculator sets it for the process
    for path in (cueq, compiled):
        atoms.calc = MLIPCalculator(potentials.MACE(path))
        ours = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
        assert_close(mace_view(ours, reference, atoms), reference, 1e-9, label=str(path))
