"""A committee of models (``potentials.Committee``) for active learning: DeePMD's model deviation by hand, the
committee distributed == its members alone (tests/mpi/committee.py), the refusals, the ASE calculator and
``mlip-train eval`` with several models, and mlip-md's uncertainty section end to end: model_devi.csv on two ranks
== one process, candidates.extxyz's σ_F == the committee evaluated afresh on each frame, stop_above ending a run
that resumes to the straight run's rows, and the candidates labelled (ASE's EMT) and fine-tuned by mlip-train."""
import csv
import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.io import read, write

import potentials
from comparison import assert_beyond, assert_close
from conftest import MPI_DIR, ROOT, importable, require
from md.calculator import MLIPCalculator
from mlip_parallel.backend import SerialBackend
from mlip_parallel.evaluate import evaluate
from potentials.committee import Committee, CommitteeError, deviations, load_committee
from potentials.errors import UnknownSpeciesError
from potentials.families import ModelSpecError
from systems import MACE_DIR, write_small_sevennet

DEVIATION = ("max_devi_f", "min_devi_f", "avg_devi_f", "devi_e")


def example(name: str):
    """A module of examples/active_learning/ (the demo's members and labelling, tested here)."""
    path = ROOT / "examples" / "active_learning" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"active_learning_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_distributed_committee_equals_its_members_alone(mpirun, tmp_path):
    """tests/mpi/committee.py on 4 ranks (1-4 ranks as sub-communicators): 32 cases of four members of three
    architectures, two package families beside ours, LAMMPS's per-atom deviation, and the halo's faults planted
    (tests/faults.py), each caught."""
    directory = "-"  # no SevenNet without sevenn (nor MACE without mace, LAMMPS without lammps: left out)
    if importable("sevenn"):
        write_small_sevennet(tmp_path / "sevennet.pth")
        directory = tmp_path
    rc, out, _ = mpirun(4, MPI_DIR / "committee.py", directory)
    assert rc == 0 and "committee: 0 failures" in out and "FAIL" not in out, out
    assert out.count("OK  4 members,") == 32, out
    assert "faults caught 6 of 6" in out, out  # the halo's three faults, on 2 ranks and on a 3-rank grid
    require("mace", "sevenn", "lammps")  # the parts left out without them: the test is skipped or fails


def test_deviation_formulas_by_hand():
    """Two members whose forces on atom 0 are ±d: σ_F = |d| there, 0 on the atom they agree on; three members with
    x-forces 0, 1, 5 on one atom: σ_F = sqrt(((0-2)² + (1-2)² + (5-2)²) / 3); the energy deviation is the population
    standard deviation."""
    d = torch.tensor([0.3, -0.4, 1.2], dtype=torch.float64)
    forces = torch.zeros(2, 2, 3, dtype=torch.float64)
    forces[0, 0], forces[1, 0] = d, -d
    devi_f, devi_e = deviations(forces, torch.tensor([[1.0, 2.0], [3.0, 2.0]], dtype=torch.float64))
    assert devi_f.tolist() == pytest.approx([float(d.norm()), 0.0], abs=1e-15)
    assert devi_e.tolist() == pytest.approx([1.0, 0.0], abs=1e-15)
    three = torch.zeros(3, 1, 3, dtype=torch.float64)
    three[:, 0, 0] = torch.tensor([0.0, 1.0, 5.0])
    devi_f, devi_e = deviations(three, torch.zeros(3, 1, dtype=torch.float64))
    assert float(devi_f[0]) == pytest.approx(np.sqrt(14 / 3), abs=1e-15) and float(devi_e[0]) == 0.0
    one, _ = deviations(three[:1], torch.zeros(1, 1, dtype=torch.float64))
    assert float(one[0]) == 0.0


def small_schnet(species, seed, cutoff=4.0):
    torch.manual_seed(seed)
    return potentials.SchNet(species, cutoff=cutoff, features=8, layers=2).double()


def test_committee_refusals_name_the_member():
    with pytest.raises(CommitteeError, match="needs at least one member"):
        Committee([])
    with pytest.raises(CommitteeError, match="forces must be one of"):
        Committee([small_schnet(["Cu"], 0)], forces="median")
    with pytest.raises(CommitteeError, match=r"share no element: member 1 \(SchNet\) knows \['Cu'\]; member 2"):
        Committee([small_schnet(["Cu"], 0), small_schnet(["Ar"], 1)])
    committee = Committee([small_schnet(["Cu", "Ni"], 0), small_schnet(["Cu"], 1)])
    assert committee.species == ["Cu"]
    atoms = bulk("Cu", cubic=True)
    atoms.numbers[0] = 28
    with pytest.raises(UnknownSpeciesError, match="committee member 2: .*Ni"):
        evaluate(committee, atoms, comm=SerialBackend())
    with pytest.raises(CommitteeError, match=r"member 2 \(no-such-file.pt\): "):
        load_committee(["cu-emt", "no-such-file.pt"])
    with pytest.raises(ModelSpecError, match="no member of the committee takes the option 'head'"):
        load_committee(["cu-emt", "lj:0.0104,3.4,8.5"], head="pbe")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_load_committee_routes_each_option_to_the_members_that_take_it(restore_environment):
    require("mace")
    committee = load_committee(["cu-emt", f"mace:{MACE_DIR / 'mace-heads-f64.model'}"], "float64", head="pbe")
    assert committee.members[1].head == "pbe" and type(committee.members[0]).__name__ == "PaiNN"
    assert committee.cutoff == max(m.cutoff for m in committee.members)


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """The demo's four members (cu-emt with seeded noise on its weights): (directory, [paths])."""
    directory = tmp_path_factory.mktemp("committee")
    perturbed_cu_emt = example("make_committee").perturbed_cu_emt
    paths = []
    for seed in range(4):
        paths.append(directory / f"m{seed}.pt")
        potentials.save(perturbed_cu_emt(seed), paths[-1])
    return directory, paths


def rattled_cu(seed: int):
    atoms = bulk("Cu", cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.15, seed=seed)
    return atoms


def test_calculator_and_mlip_train_eval_give_the_committee(members, tmp_path):
    """MLIPCalculator with a list of models: the members' mean energy and forces (each member's ``predict``) and
    evaluate's deviation; ``mlip-train eval`` with two checkpoints: one CSV row per structure == evaluate."""
    from mlip_parallel.train.cli import main

    _, paths = members
    models = [potentials.load(p) for p in paths[:2]]
    atoms = rattled_cu(1)
    atoms.calc = MLIPCalculator(models)
    alone = [potentials.predict(m, atoms) for m in models]
    assert atoms.get_potential_energy() == pytest.approx(np.mean([r["energy"] for r in alone]), rel=1e-12)
    assert_close(atoms.get_forces(), np.mean([r["forces"] for r in alone], axis=0), 1e-12, scale="absolute",
                 label="forces: the members' mean")
    want = evaluate(models, atoms, comm=SerialBackend())
    for key in DEVIATION:
        assert atoms.calc.results[key] == pytest.approx(want[key], rel=1e-12), key
    spread = np.linalg.norm(alone[0]["forces"] - alone[1]["forces"], axis=1) / 2  # K=2: σ_F = |F¹ − F²| / 2
    assert_close(atoms.calc.results["devi_f"], spread, 1e-12, scale="absolute", label="devi_f")

    data = tmp_path / "labelled.extxyz"
    frames = []
    for seed in range(3):
        frame = rattled_cu(10 + seed)
        frame.calc = EMT()
        frame.get_forces()
        frames.append(frame)
    write(data, frames, format="extxyz")
    csv_path = tmp_path / "devi.csv"
    assert main(["eval", str(paths[0]), str(paths[1]), str(data), "--deviations", str(csv_path)]) == 0
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    written = read(data, ":")
    assert len(rows) == len(written) == 3
    for row, frame in zip(rows, written):  # (the positions as written: 8 decimals)
        want = evaluate(models, frame, comm=SerialBackend(), min_distance=0.0)
        for key in DEVIATION:
            assert float(row[key]) == pytest.approx(want[key], rel=1e-12, abs=1e-15), key


def md_config(paths, directory, **changes) -> dict:
    config = {"model": {"committee": [{"checkpoint": str(p)} for p in paths], "dtype": "float64"},
              "structure": {"element": "Cu", "repeat": [3, 3, 3]}, "temperature_K": 600, "steps": 30, "seed": 3,
              "uncertainty": {"every": 5},
              "output": {"directory": str(directory), "thermo_every": 10, "trajectory_every": 0, "progress": False}}
    for key, value in changes.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    return config


def read_rows(path) -> list:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def assert_rows_close(rows, reference, label) -> None:
    """Each deviation of model_devi.csv's ``rows`` within 1e-9 of ``reference``'s, relative to max(|reference|,
    1e-3) (step 0's perfect crystal deviates by rounding alone)."""
    assert len(rows) == len(reference), (label, len(rows), len(reference))
    for key in DEVIATION:
        want = np.array([r[key] for r in reference])
        scale = np.maximum(np.abs(want), 1e-3)
        assert_close(np.array([r[key] for r in rows]) / scale, want / scale, 1e-9, scale="absolute",
                     label=f"{label} {key}")


def between(values) -> list:
    """Thresholds midway between neighbouring distinct values (none lies near a value the runs compute)."""
    values = sorted(set(values))
    return [(a + b) / 2 for a, b in zip(values, values[1:])]


def test_uncertainty_in_mlip_md_on_two_ranks_and_the_active_learning_loop(members, mpirun, tmp_path):
    """mlip-md with a committee of four and ``uncertainty``: the one-process run's model_devi.csv sets the select
    window (some frames in, some out) and a stop_above threshold; on two ranks (one launch): the straight run's rows
    == one process (1e-9), its candidates are exactly the rows within the window, each frame's σ_F == the committee
    evaluated afresh on it (1e-12); the run with stop_above ends with status 1 at the first step above it, one line
    naming the step and the deviation, restart.npz written; resumed with a higher threshold it finishes with every
    step once, rows == the straight run. Then the loop closes: the candidates labelled by ASE's EMT, mlip-train
    fine-tunes m0.pt on them, and the new best.pt runs mlip-md again."""
    from md.cli import main as mlip_md
    from mlip_parallel.train.cli import main as mlip_train

    _, paths = members
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        (tmp_path / "one.json").write_text(json.dumps(md_config(paths, "one")))
        assert mlip_md(["one.json"]) == 0
    finally:
        os.chdir(cwd)
    one = read_rows(tmp_path / "one" / "model_devi.csv")
    assert [int(r["step"]) for r in one] == [0, 5, 10, 15, 20, 25, 30]
    values = [r["max_devi_f"] for r in one]
    assert all(r["min_devi_f"] <= r["avg_devi_f"] <= r["max_devi_f"] for r in one), one
    # step 0: the perfect crystal, no force to differ on
    assert values[0] < 1e-12 and all(v > 1e-3 for v in values[1:]), one
    cuts = between(values)
    select = [cuts[1], cuts[-2]]  # the lowest two rows and the highest one out
    stop_above = between([r["max_devi_f"] for r in one[1:]])[len(one) // 2 - 1]
    stop_step = next(int(r["step"]) for r in one[1:] if r["max_devi_f"] > stop_above)

    configs = {"two": md_config(paths, "two", uncertainty={"select": select}),
               "stop": md_config(paths, "stop", uncertainty={"stop_above": stop_above}, resume=True,
                                 output={"restart_every": 0}),
               "resume": md_config(paths, "stop", uncertainty={"stop_above": 10.0}, resume=True)}
    for name, config in configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    jobs = [["mlip-md", "two.json"], ["mlip-md", "stop.json"], ["mlip-md", "resume.json"]]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    rc, out, _ = mpirun(2, MPI_DIR / "cli_jobs.py", tmp_path)
    assert "cli jobs exit codes [0, 1, 0]" in out, out
    errors = [line for line in out.splitlines() if "uncertainty.stop_above" in line]
    assert len(errors) == 1 and f"step {stop_step}: max_devi_f" in errors[0] and "committee disagrees" in errors[0], out

    two = read_rows(tmp_path / "two" / "model_devi.csv")
    assert [r["step"] for r in two] == [r["step"] for r in one]
    assert_rows_close(two, one, "two ranks vs one process")
    frames = read(tmp_path / "two" / "candidates.extxyz", ":")
    chosen = [int(r["step"]) for r in two if select[0] <= r["max_devi_f"] <= select[1]]
    assert 0 < len(chosen) < len(two) and [int(f.info["step"]) for f in frames] == chosen
    committee = [potentials.load(p) for p in paths]
    for frame in frames:
        assert frame.calc is None or "forces" not in frame.calc.results  # the committee's guesses are no labels
        want = evaluate(committee, frame, comm=SerialBackend())
        assert_close(frame.arrays["devi_f"], want["devi_f"], 1e-12, scale="absolute", label="candidate's devi_f")
        assert frame.info["max_devi_f"] == pytest.approx(want["max_devi_f"], rel=1e-12)

    resumed = read_rows(tmp_path / "stop" / "model_devi.csv")
    assert [r["step"] for r in resumed] == [r["step"] for r in one], resumed  # every step once
    assert_rows_close(resumed, two, "resumed vs straight")

    assert example("label_candidates").label(tmp_path / "two" / "candidates.extxyz",
                                             tmp_path / "labelled.extxyz") == len(frames)
    written = read(tmp_path / "labelled.extxyz", ":")
    assert len(written) == len(frames), (len(written), len(frames))
    for frame, labelled in zip(frames, written):  # EMT's labels, the same frames
        assert_close(labelled.positions, frame.positions, 1e-8, scale="absolute", label="labelled positions")
        frame.calc = EMT()
        assert_close(labelled.get_forces(), frame.get_forces(), 1e-6, scale="absolute", label="EMT's labels")
    train = {"data": {"train": str(tmp_path / "labelled.extxyz"), "validation_fraction": 0.25},
             "model": {"checkpoint": str(paths[0])}, "epochs": 2, "batch_size": 1,
             "output": {"directory": str(tmp_path / "tuned")}}
    (tmp_path / "train.json").write_text(json.dumps(train))
    assert mlip_train([str(tmp_path / "train.json")]) == 0
    tuned = potentials.load(tmp_path / "tuned" / "best.pt")
    start = potentials.load(paths[0])
    assert_beyond(list(tuned.parameters()), list(start.parameters()), 0.0, scale="absolute",
                  label="the fine-tuned weights vs the starting ones")
    again = md_config([tmp_path / "tuned" / "best.pt", *paths[1:]], tmp_path / "again", steps=5)
    (tmp_path / "again.json").write_text(json.dumps(again))
    assert mlip_md([str(tmp_path / "again.json")]) == 0
    assert [int(r["step"]) for r in read_rows(tmp_path / "again" / "model_devi.csv")] == [0, 5]
