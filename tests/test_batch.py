"""Many structures at once (potentials.batch, md.batch, mlip-batch): batched single points equal ``predict`` of each
structure alone for every family, on ragged batches; batched FIRE relaxations equal ASE's FIRE with our calculator
per structure (the same steps), with and without the cell filter; batched MD equals mlip-md on each structure alone
in every ensemble; the graph size is found by measured throughput within the memory model; a bad structure is named;
mlip-batch on 2 and 3 ranks gives one result per structure, equal to one process; a resumed run skips what is
done."""
import dataclasses
import re
import sys

import numpy as np
import pytest
import yaml
from ase import Atoms
from ase.build import bulk, molecule
from ase.filters import FrechetCellFilter
from ase.io import read, write
from ase.optimize import FIRE

import potentials
from comparison import assert_beyond, assert_close
from conftest import ROOT, needs
from md.batch import md_many, relax_many, single_points
from md.calculator import MLIPCalculator
from potentials.batch import BatchError, BatchSizer, evaluate_batch, leading_group, predict_many, prepare_batch
from systems import GEOMETRIES, MACE_DIR, NEQUIP_DIR, fairchem_model, write_small_sevennet

ONE_GRAPH = float("inf")  # max_atoms: every structure in one graph


def ragged(elements, seed: int = 0, large: bool = True) -> list:
    """Structures of 1 to 500 atoms (``large``: the 500-atom one included), periodic and not, triclinic and slab,
    ``elements`` mixed at random: the test geometries, a lone atom and a dimer without a cell, a 500-atom cell."""
    rng = np.random.default_rng(seed)
    structures = [make() for make in GEOMETRIES.values()]
    lone = Atoms("Cu", positions=[[0.0, 0.0, 0.0]])
    dimer = Atoms("Cu2", positions=[[0.0, 0.0, 0.0], [2.3, 0.1, 0.2]])
    structures += [lone, dimer]
    if large:
        big = bulk("Cu", "fcc", a=3.7, cubic=True).repeat((5, 5, 5))[:500]
        big.rattle(0.05, seed=seed)
        structures.append(big)
    for atoms in structures:
        atoms.set_chemical_symbols(list(rng.choice(elements, len(atoms))))
    return structures


def assert_equal_to_predict(model, structures, tolerance: float = 1e-12, **options) -> float:
    """predict_many == predict of each structure alone (energy, per-atom energies, forces, stress; a committee's
    also its model deviation, against mlip_parallel.evaluate of the structure alone), relative to the largest value of
    each quantity; returns the largest relative difference."""
    import mlip_parallel

    many = predict_many(model, structures, **options)
    worst = 0.0
    for k, (result, atoms) in enumerate(zip(many, structures)):
        alone = mlip_parallel.evaluate(model, atoms) if isinstance(model, potentials.Committee) else \
            potentials.predict(model, atoms)
        assert set(result) == set(alone), (k, set(result) ^ set(alone))
        for key, reference in alone.items():
            worst = max(worst, assert_close(result[key], reference, tolerance, label=f"structure {k} {key}"))
    return worst


def family_models():
    """(id, a float64 model of the family, its elements) for every family: ours, Lennard-Jones, SevenNet, MACE,
    NequIP and Allegro, fairchem's eSEN and UMA (experts routed per structure; the omol task with charge and spin),
    a committee of three architectures, and a package's own family (examples/family_plugin)."""
    cases = [
        pytest.param(lambda tmp: potentials.SchNet(["Ag", "Cu"], cutoff=4.0, seed=0).double(), id="schnet"),
        pytest.param(lambda tmp: potentials.PaiNN(["Ag", "Cu"], cutoff=4.0, seed=1).double(), id="painn"),
        pytest.param(lambda tmp: potentials.NequIP(["Ag", "Cu"], cutoff=4.0, seed=2).double(), id="nequip-ours"),
        pytest.param(lambda tmp: potentials.LennardJones(0.4, 2.3, 5.0), id="lennard-jones"),
        pytest.param(lambda tmp: sevennet_fixture(tmp), marks=needs("sevenn"), id="sevennet"),
        pytest.param(lambda tmp: potentials.MACE(MACE_DIR / "mace-zbl-f64.model"), marks=needs("mace"), id="mace"),
        pytest.param(lambda tmp: potentials.NequIPFramework(NEQUIP_DIR / "nequip-zbl.ckpt").double(),
                     marks=needs("nequip"), id="nequip"),
        pytest.param(lambda tmp: potentials.NequIPFramework(NEQUIP_DIR / "allegro.ckpt").double(),
                     marks=needs("nequip"), id="allegro"),
        pytest.param(lambda tmp: fairchem_model("esen"), marks=needs("fairchem"), id="esen"),
        pytest.param(lambda tmp: fairchem_model("uma-moe"), marks=needs("fairchem"), id="uma-moe"),
        pytest.param(lambda tmp: potentials.Committee([potentials.SchNet(["Ag", "Cu"], cutoff=4.0, seed=0).double(),
                                                       potentials.PaiNN(["Ag", "Cu"], cutoff=3.5, seed=1).double(),
                                                       potentials.LennardJones(0.4, 2.3, 5.0)]), id="committee"),
        pytest.param(lambda tmp: toy_family_model(tmp), id="package-family"),
    ]
    return cases


def sevennet_fixture(tmp):
    write_small_sevennet(tmp / "sevennet.pth")
    return potentials.load_model(f"sevennet:{tmp / 'sevennet.pth'}").double()


def toy_family_model(tmp):
    sys.path.insert(0, str(ROOT / "examples" / "family_plugin"))
    try:
        import toy_family
    finally:
        sys.path.pop(0)
    toy_family.write_model(tmp / "toy.pt", species=["Cu", "Ag"], layers=3)
    return toy_family.load(str(tmp / "toy.pt"))


@pytest.mark.parametrize("build", family_models())
def test_batched_single_points_equal_predict_for_every_family(build, tmp_path):
    """Every family, float64: a ragged batch of 1-500 atoms (the 500-atom structure for this package's families) as
    one graph, and (this package's) as graphs of at most 64 atoms and (but the slow NequIP) at the sizes the sizer
    picks, and one structure alone: each structure equals ``predict`` of it alone to 1e-12 (relative to the largest value of each quantity)."""
    model = build(tmp_path)
    package = type(model).__name__ in ("SevenNet", "MACE", "NequIPFramework", "FAIRChem")
    structures = ragged(["Ag", "Cu"], large=not package)
    for max_atoms in (ONE_GRAPH,) if package else (ONE_GRAPH, 64) if isinstance(model, potentials.NequIP) else \
            (ONE_GRAPH, 64, None):
        assert_equal_to_predict(model, structures, max_atoms=max_atoms)
    assert_equal_to_predict(model, structures[3:4])


@needs("fairchem")
def test_each_structures_charge_and_spin_reach_the_model_in_a_batch():
    """UMA's omol task reads each structure's own charge and spin (atoms.info) in a batch: equal to predict of each
    alone; the same structures with their charges swapped differ (the batch does not share one structure's)."""
    model = fairchem_model("uma-dense", charge=None, spin=None)
    one, two = molecule("H2O"), molecule("CH4")
    one.info.update(charge=1, spin=2)
    two.info.update(charge=0, spin=1)
    assert_equal_to_predict(model, [one, two, one.copy()], max_atoms=ONE_GRAPH)
    swapped = [one.copy(), two.copy()]
    swapped[0].info.update(charge=0, spin=1)
    assert_beyond(predict_many(model, swapped, max_atoms=ONE_GRAPH)[0]["energy"],
                  potentials.predict(model, one)["energy"], 1e-6, scale="absolute", label="charge swapped")


def test_the_comparison_catches_edges_that_cross_structures_and_a_shared_strain():
    """The equality above fails, by orders of magnitude, on a batch whose edges point into the wrong structure
    (senders not offset by their structure's first row), and on stress taken from one strain shared by all."""
    model = potentials.SchNet(["Ag", "Cu"], cutoff=4.0, seed=0).double()
    structures = ragged(["Ag", "Cu"], large=False)
    batch = prepare_batch(model, structures)
    offsets = batch.offsets[batch.edge_batch]
    crossed = dataclasses.replace(batch, j=(batch.j - offsets + batch.sizes[0]) % len(batch.numbers))
    wrong = evaluate_batch(model, crossed)
    assert_beyond(np.concatenate([r["forces"] for r in wrong]),
                  np.concatenate([potentials.predict(model, a)["forces"] for a in structures]), 1e-3, label="forces")
    shared = dataclasses.replace(batch, cells=np.broadcast_to(batch.cells[:1], batch.cells.shape).copy())
    periodic = [k for k, a in enumerate(structures) if a.cell.rank == 3 and a.pbc.any()]
    k = periodic[-1]
    assert_beyond(evaluate_batch(model, shared)[k]["stress"], potentials.predict(model, structures[k])["stress"],
                  1e-3, label="stress")


def test_the_sizer_keeps_the_fastest_graph_size_and_memory_bounds_every_graph():
    """BatchSizer: candidates tried in turn until one is more than 10 % slower than the best before it, each costed
    as the median of its graphs' seconds over what their structures take alone (a + b * atoms, fitted to the first
    trial's), the fastest kept (here 64 atoms, whose graphs of small structures cost more per atom than the first
    trial's larger ones alone: per atom the search would have kept one structure per graph); candidate 32, whose
    graphs hold one structure each as the first's, does not end the search; not counted: the warm-up call, a graph
    made at an earlier candidate, and (the median) one slow graph in three; a given max_atoms is kept. A task runner
    holds at least a trial's atoms and structures, but near its queue's end. leading_group: consecutive structures within max_atoms and the
    memory model's one-pass share of the free memory, never fewer than one."""
    model = potentials.SchNet(["Cu"], cutoff=4.0, seed=0)
    a, b = 2e-3, 1e-4  # seconds per call and per atom of a structure alone
    graphs = {1: [[32], [24]], 32: [[8]], 64: [[8, 8, 8, 8], [8, 16]], 128: [[32, 32, 8, 16, 24]]}
    speed = {1: 1.0, 32: 1.3, 64: 0.6, 128: 0.8}  # a graph's seconds over its structures' alone
    sizer = BatchSizer(model, rounds=3, trial_atoms=10, trial_structures=2, trial_seconds=0.0)
    sizer.record([100], 1e6)  # warm-up: ignored
    k, seen = 0, 1
    while sizer.chosen is None:
        if sizer.max_atoms != seen:  # the rest of a call made at the candidate before: ignored
            sizer.record([8], 1e6, made_at=seen)
            seen = sizer.max_atoms
        sizes = graphs[sizer.max_atoms][k % len(graphs[sizer.max_atoms])]
        slow = 1e3 if sizer.max_atoms > 1 and k % 3 == 0 else 1.0  # one graph in three: this host's noise
        sizer.record(sizes, slow * speed[sizer.max_atoms] * sum(a + b * n for n in sizes))
        k += 1
    assert sizer.chosen == 64 and set(sizer.trials) == {1, 32, 64, 128}, sizer.trials
    assert np.allclose(sizer.alone, (a, b)) and abs(sizer.cost(64) - 0.6) < 1e-9
    searching, chosen = BatchSizer(model), BatchSizer(model, max_atoms=64)
    assert searching.has_room(0, 0, 500) and chosen.has_room(0, 0, 500)  # (a structure larger than any graph)
    assert searching.has_room(255, 7, 32) and not searching.has_room(255, 8, 32)  # (a trial: 256 atoms, 8 structures)
    assert chosen.has_room(200, 9, 56) and not chosen.has_room(200, 3, 57)
    assert not searching.has_room(8, 1, 8, plenty=False) and chosen.has_room(32, 2, 32, plenty=False)  # (near the
    # queue's end: what one graph holds)
    fixed = BatchSizer(model, max_atoms=300)
    fixed.record([10], 1.0)
    assert fixed.max_atoms == 300 and fixed.chosen == 300
    sizes, edges = np.array([10, 20, 30, 40]), np.array([100, 200, 300, 400])
    assert leading_group(model, sizes, edges, 35, float("inf")) == 2
    assert leading_group(model, sizes, edges, 5, float("inf")) == 1  # larger than max_atoms: alone
    one_pass = model.evaluation_bytes(30, 300, chunked=False)
    assert leading_group(model, sizes, edges, ONE_GRAPH, 2 * one_pass / 0.999) == 2  # (within half the free memory)
    assert leading_group(model, sizes, edges, ONE_GRAPH, 1.0) == 1


def test_a_bad_structure_is_named_by_its_index():
    """One line naming the structure: atoms closer than min_distance (the pair), an element the model does not
    know, no atoms, non-finite positions; no structures at all."""
    model = potentials.SchNet(["Cu"], cutoff=4.0, seed=0).double()
    good = bulk("Cu", "fcc", a=3.6)
    close = Atoms("Cu2", positions=[[0, 0, 0], [0.3, 0, 0]])
    cases = [(close, r"structure 1: atoms 0 and 1 are 0.3 Å apart"), (Atoms("Ag"), r"structure 1: .*Ag"),
             (Atoms(), r"structure 1: no atoms"), (Atoms("Cu", positions=[[np.nan, 0, 0]]), r"structure 1: non-finite")]
    for bad, message in cases:
        with pytest.raises(BatchError, match=message):
            predict_many(model, [good, bad])
    with pytest.raises(BatchError, match="no structures"):
        predict_many(model, [])
    with pytest.raises(BatchError, match="structure 7: atoms 0 and 1"):
        predict_many(model, [good, close], names=[3, 7])


def cu_cells(count: int, seed: int) -> list:
    """``count`` rattled, strained Cu cells of 4-32 atoms (a float64 PaiNN's relaxation targets)."""
    rng = np.random.default_rng(seed)
    structures = []
    for k in range(count):
        atoms = bulk("Cu", "fcc", a=3.55 + 0.1 * rng.random(), cubic=True).repeat(tuple(rng.integers(1, 3, 3)))
        atoms.rattle(0.08, seed=seed + k)
        atoms.set_cell(atoms.cell[:] @ (np.eye(3) + 0.02 * rng.standard_normal((3, 3))), scale_atoms=True)
        structures.append(atoms)
    return structures


@pytest.mark.parametrize("cell", [False, True], ids=["positions", "cell-filter"])
def test_batched_relaxation_equals_ases_fire_per_structure(cell):
    """relax_many (cu-emt, float64), every structure in one graph and at the sizer's sizes, against ASE's FIRE with
    MLIPCalculator on each of 4 structures alone (on FrechetCellFilter(atoms) with the cell): the same steps and
    convergence (some structures stop at the step limit, others converge: each leaves the batch on its own),
    positions and cell within 1e-8 Å, final energy within 1e-10 eV."""
    model = potentials.load_model("cu-emt", checkpoint_dtype="float64")
    structures = cu_cells(4, seed=4)
    references = []
    for atoms in structures:
        alone = atoms.copy()
        alone.calc = MLIPCalculator(model)
        optimizer = FIRE(FrechetCellFilter(alone) if cell else alone, logfile=None)
        converged = optimizer.run(fmax=0.1, steps=20)
        references.append((alone, optimizer.nsteps, converged))
    assert {c for _, _, c in references} == {True, False}  # (both endings exercised)
    for max_atoms in (ONE_GRAPH, None):
        relaxed = relax_many(model, structures, fmax=0.1, max_steps=20, cell=cell, max_atoms=max_atoms)
        for k, (result, (alone, steps, converged)) in enumerate(zip(relaxed, references)):
            assert (result.info["steps"], result.info["converged"]) == (steps, converged), k
            assert_close(result.positions, alone.positions, 1e-8, scale="absolute", label=f"{k} positions")
            assert_close(result.cell[:], alone.cell[:], 1e-8, scale="absolute", label=f"{k} cell")
            assert_close(result.get_potential_energy(), alone.get_potential_energy(), 1e-10, scale="absolute")
            assert np.abs(result.positions - structures[k].positions).max() > 1e-3  # (it moved)


def test_single_points_of_a_committee_carry_its_deviation():
    """single_points with a committee: each structure's energy, forces and model deviation (info's max_devi_f ...,
    arrays' devi_f) equal mlip_parallel.evaluate of it alone (1e-12)."""
    import mlip_parallel

    committee = potentials.Committee([potentials.SchNet(["Ag", "Cu"], cutoff=4.0, seed=0).double(),
                                      potentials.PaiNN(["Ag", "Cu"], cutoff=3.5, seed=1).double()])
    structures = ragged(["Ag", "Cu"], large=False)
    for atoms, original in zip(single_points(committee, structures, max_atoms=ONE_GRAPH), structures):
        alone = mlip_parallel.evaluate(committee, original)
        assert_close(atoms.get_forces(), alone["forces"], 1e-12, label="forces")
        assert_close(atoms.arrays["devi_f"], alone["devi_f"], 1e-12, label="devi_f")
        for key in ("max_devi_f", "min_devi_f", "avg_devi_f", "devi_e"):
            assert_close(atoms.info[key], alone[key], 1e-12, scale="absolute", label=key)


BATCH_JOB = {"model": {"checkpoint": "cu-emt"}, "structures": "structures.extxyz", "task": "relax",
             "relax": {"fmax": 0.1, "max_steps": 20, "cell": True}, "output": {"directory": "out", "progress": False}}


def test_mlip_batch_on_2_and_3_ranks_equals_one_process(mpirun, torchrun, tmp_path):
    """mlip-batch (cu-emt, float64) of 10 structures of 4-32 atoms: relaxations with the cell filter on 2 ranks
    (mpiexec) and Langevin MD on 3 (torchrun: torch.distributed's store holds the queue's counter), those above 12
    atoms run spatially decomposed over all ranks (decompose_above), the rest batched from the shared queue. results.extxyz holds each input structure once, in input order, with its index,
    steps and convergence equal to relax_many / md_many in this process; positions, cell, energy, forces and stress
    within 1e-9; MD's trajectory.extxyz the same frames. Every rank took structures from the queue."""
    structures = cu_cells(10, seed=9)
    write(tmp_path / "structures.extxyz", structures)
    start = read(tmp_path / "structures.extxyz", ":")
    model = potentials.load_model("cu-emt", checkpoint_dtype="float64")
    md = {"ensemble": "langevin", "temperature_K": 500.0, "steps": 10, "timestep_fs": 2.0, "seed": 4,
          "trajectory_every": 5}
    expected = {"relax": (relax_many(model, start, fmax=0.1, max_steps=20, cell=True), None)}
    from md.batch_cli import TABLE
    from md.batch_job import md_settings
    from md.start import build_integrator, thermalize
    settings = [md_settings(TABLE.validate({**BATCH_JOB, "md": md})["md"], atoms, k) for k, atoms in enumerate(start)]
    hot = [atoms.copy() for atoms in start]
    for atoms, s in zip(hot, settings):
        thermalize(atoms, s["temperature_K"], s["seed"])
    last, frames = md_many(model, hot, [build_integrator(s) for s in settings], 10, frame_every=5)
    expected["md"] = (last, [f for k in range(10) for f in frames[k]])
    assert sum(len(a) > 12 for a in start) >= 2 and sum(len(a) <= 12 for a in start) >= 4
    for ranks, task, launcher in ((2, "relax", mpirun), (3, "md", torchrun)):
        run = tmp_path / f"ranks{ranks}"
        run.mkdir()
        (run / "job.yaml").write_text(yaml.safe_dump({**BATCH_JOB, "task": task, "md": md, "decompose_above": 12,
                                                      "structures": str(tmp_path / "structures.extxyz"),
                                                      "output": {"directory": str(run / "out"), "progress": False}}))
        rc, out, _ = launcher(ranks, "-m", "md.batch_cli", run / "job.yaml")
        assert rc == 0, out
        assert f"mlip-batch: 10 structures in {run / 'out' / 'results.extxyz'}" in out
        results = read(run / "out" / "results.extxyz", ":")
        reference, trajectory = expected[task]
        assert [r.info["index"] for r in results] == list(range(10))
        for k, (result, wanted) in enumerate(zip(results, reference)):
            assert (result.info["steps"], result.info["converged"]) == (wanted.info["steps"],
                                                                        wanted.info["converged"]), k
            assert minimum_image_distance(result.positions, wanted.positions, wanted.cell) <= 1e-9, k
            assert_close(result.cell[:], wanted.cell[:], 1e-9, scale="absolute", label=f"{k} cell")
            assert_close(result.get_forces(), wanted.get_forces(), 1e-9, scale="absolute", label=f"{k} forces")
            assert_close(result.get_stress(), wanted.get_stress(), 1e-9, scale="absolute", label=f"{k} stress")
            assert_close(result.get_potential_energy(), wanted.get_potential_energy(), 1e-9, scale="absolute")
        if trajectory is not None:
            frames = read(run / "out" / "trajectory.extxyz", ":")
            assert [(f.info["index"], f.info["step"]) for f in frames] == [(k, s) for k in range(10) for s in (0, 5, 10)]
            for mine, wanted in zip(frames, trajectory):
                assert minimum_image_distance(mine.positions, wanted.positions, wanted.cell) <= 1e-9
        done = [len((run / "out" / "parts" / f"rank{r}.done").read_text().split("\n")) - 1 for r in range(ranks)]
        large = sum(len(a) > 12 for a in start)  # (recorded by rank 0)
        assert sum(done) == 10 and done[0] - large > 0 and min(done[1:]) > 0, done  # every rank took from the queue


def test_a_structure_run_decomposed_in_one_process_equals_the_batch():
    """run_decomposed's single point (mlip_parallel.evaluate; here one rank) equals predict_many's (1e-12)."""
    from md.batch import run_decomposed

    model = potentials.load_model("cu-emt", checkpoint_dtype="float64")
    atoms = cu_cells(1, seed=3)[0]
    finished = run_decomposed(model, 7, atoms.copy(), "single_point", None)
    batched = predict_many(model, [atoms])[0]
    assert finished.index == 7 and finished.converged and finished.steps == 0
    assert_close(finished.atoms.get_forces(), batched["forces"], 1e-12, label="forces")
    assert_close(finished.atoms.get_stress(), batched["stress"], 1e-12, label="stress")


@pytest.mark.parametrize("change, message", [
    ({"structures": None}, "structures: no structure file given"),
    ({"structures": "missing.extxyz"}, "missing.extxyz: no such data file"),
    ({"task": "phonons"}, r"task must be one of .*'md'\), got 'phonons'"),
    ({"task": "md", "md": {"ensemble": "langevin", "temperature_K": 0.0}},
     r"structures: structures.extxyz:0: thermostat.temperature_K must be > 0 for ensemble langevin"),
    ({"relax": {"fmax": 0}}, "relax.fmax must be a finite number > 0, got 0.0"),
    ({"model": {"checkpoint": "cu-emt"}, "structures": "silver.extxyz"}, "silver.extxyz:0: .*Ag"),
])
def test_mlip_batch_bad_input_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, change, message):
    """A missing or unreadable structures key, an unknown task, a bad setting, an MD setting a structure cannot run
    with, an element the model does not know: one line naming it, exit 2, no output directory."""
    from md.batch_cli import main

    monkeypatch.chdir(tmp_path)
    write(tmp_path / "structures.extxyz", cu_cells(2, seed=1))
    write(tmp_path / "silver.extxyz", [bulk("Ag", "fcc", a=4.1)])
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**BATCH_JOB, **change}))
    assert main(["job.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlip-batch: error: "), err
    assert re.search(message, err[0]), err
    assert not (tmp_path / "out").exists()


def test_mlip_batch_resume_skips_what_is_done_and_refuses_another_config(tmp_path, monkeypatch, capsys):
    """Structures carrying an earlier calculation's labels get their own results (nothing of the old carried over).
    A run whose parts hold some finished structures and a half-written frame (a kill between the frame and its
    record) resumes: the cut frame is dropped, the recorded ones are kept and not run again, results.extxyz equals
    an uninterrupted run; resuming with another task is one line naming the directory."""
    from md.batch_cli import main

    from ase.calculators.singlepoint import SinglePointCalculator

    monkeypatch.chdir(tmp_path)
    labelled = cu_cells(5, seed=2)
    for atoms in labelled:  # an earlier calculation's labels and a committee's deviation: not carried into results
        atoms.calc = SinglePointCalculator(atoms, energy=123.0, forces=np.ones((len(atoms), 3)),
                                           stress=np.ones(6))
        atoms.info.update(max_devi_f=9.0, step=7)
    write(tmp_path / "structures.extxyz", labelled)
    job = {**BATCH_JOB, "task": "single_point", "resume": True}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["job.yaml"]) == 0
    straight = (tmp_path / "out" / "results.extxyz").read_text()
    model = potentials.load_model("cu-emt", checkpoint_dtype="float64")
    for frame, atoms in zip(read(tmp_path / "out" / "results.extxyz", ":"), read(tmp_path / "structures.extxyz", ":")):
        assert "max_devi_f" not in frame.info and "step" not in frame.info
        assert_close(frame.get_forces(), potentials.predict(model, atoms)["forces"], 1e-12, label="forces")
    parts = tmp_path / "out" / "parts"
    records = (parts / "rank0.done").read_text().splitlines()
    keep = records[:2]
    end = int(keep[-1].split()[1])
    frames = (parts / "rank0.extxyz").read_bytes()
    (parts / "rank0.extxyz").write_bytes(frames[:end] + frames[end:end + 200])  # a frame cut by a kill
    (parts / "rank0.done").write_text("\n".join(keep) + "\n" + records[2][:3])  # and its record, cut
    (tmp_path / "out" / "results.extxyz").unlink()
    assert main(["job.yaml"]) == 0
    assert (tmp_path / "out" / "results.extxyz").read_text() == straight
    lines = (parts / "rank0.done").read_text().splitlines()
    assert [int(line.split()[0]) for line in lines[:2]] == [int(r.split()[0]) for r in keep] and len(lines) == 5
    capsys.readouterr()
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**job, "task": "relax"}))
    assert main(["job.yaml"]) == 2
    assert "holds a run of another config" in capsys.readouterr().err


def minimum_image_distance(a, b, cell) -> float:
    """The largest |a_i - b_i| (Å) over atoms, each difference taken to its nearest periodic image in ``cell``."""
    fractional = np.linalg.solve(np.asarray(cell).T, (a - b).T).T
    return float(np.abs((fractional - np.round(fractional)) @ np.asarray(cell)).max())


@pytest.mark.parametrize("ensemble", ["nve", "langevin", "bussi", "nose-hoover", "npt"])
def test_batched_md_equals_mlip_md_on_each_structure_alone(tmp_path, ensemble):
    """md_many (cu-emt, float64) of 2 structures in one graph, each with its own start temperature, seed and (npt)
    pressure, against mlip-md run on each structure alone with the same settings: the last positions (nearest image),
    velocities and cell within 1e-10, and the trajectory frames at the same steps within 1e-10 Å."""
    from md.cli import simulate, validate
    from md.start import build_integrator, thermalize

    model = potentials.load_model("cu-emt", checkpoint_dtype="float64")
    starts, configs = [], []
    for k, repeat in enumerate([(2, 2, 1), (1, 2, 2)]):
        atoms = bulk("Cu", "fcc", a=3.6 + 0.05 * k, cubic=True).repeat(repeat)
        atoms.rattle(0.05, seed=k)
        write(tmp_path / f"start{k}.extxyz", atoms)
        config = validate({"model": {"checkpoint": "cu-emt"}, "structure": {"file": str(tmp_path / f"start{k}.extxyz")},
                           "temperature_K": 300 + 200 * k, "ensemble": ensemble, "timestep_fs": 2.0, "steps": 20,
                           "seed": 5 + k, "thermostat": {"temperature_K": 300 + 200 * k},
                           "barostat": {"pressure_GPa": 1.0 * k},
                           "output": {"directory": str(tmp_path / f"md{k}"), "trajectory_every": 5, "progress": False}})
        simulate(config)
        start = read(tmp_path / f"start{k}.extxyz")
        thermalize(start, config["temperature_K"], config["seed"])
        starts.append(start)
        configs.append(config)
    last, frames = md_many(model, starts, [build_integrator(c) for c in configs], 20, frame_every=5,
                           max_atoms=ONE_GRAPH)
    for k, atoms in enumerate(last):
        alone = read(tmp_path / f"md{k}" / "final.extxyz")
        assert minimum_image_distance(atoms.positions, alone.positions, alone.cell) <= 1e-10
        assert_close(atoms.get_velocities(), alone.get_velocities(), 1e-10, scale="absolute", label="velocities")
        assert_close(atoms.cell[:], alone.cell[:], 1e-10, scale="absolute", label="cell")
        trajectory = read(tmp_path / f"md{k}" / "trajectory.extxyz", ":")
        assert [f.info["step"] for f in frames[k]] == [f.info["step"] for f in trajectory] == [0, 5, 10, 15, 20]
        for mine, theirs in zip(frames[k], trajectory):
            assert minimum_image_distance(mine.positions, theirs.positions, theirs.cell) <= 1e-10
        if ensemble == "npt":
            assert np.abs(atoms.cell[:] - starts[k].cell[:]).max() > 1e-4  # (the barostat moved the cell)


def test_mlip_batch_md_takes_each_structures_own_settings_and_groups_the_trajectory(tmp_path, monkeypatch):
    """mlip-batch md (Bussi): a structure's info temperature_K and seed win over the md section's (the others take
    seed + index); results.extxyz's last frames equal md_many with those settings (1e-12), and trajectory.extxyz holds
    each structure's frames, grouped in input order."""
    from md.batch_cli import TABLE, main
    from md.batch_job import md_settings
    from md.start import build_integrator, thermalize

    monkeypatch.chdir(tmp_path)
    structures = cu_cells(3, seed=6)
    structures[1].info.update(temperature_K=900.0, seed=42)
    write(tmp_path / "structures.extxyz", structures)
    section = {"ensemble": "bussi", "temperature_K": 400.0, "timestep_fs": 2.0, "steps": 12, "seed": 3,
               "trajectory_every": 4}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**BATCH_JOB, "task": "md", "md": section}))
    assert main(["job.yaml"]) == 0
    full = TABLE.validate({**BATCH_JOB, "task": "md", "md": section})["md"]
    starts = read(tmp_path / "structures.extxyz", ":")
    settings = [md_settings(full, atoms, k) for k, atoms in enumerate(starts)]
    assert [s["seed"] for s in settings] == [3, 42, 5] and settings[1]["thermostat"]["temperature_K"] == 900.0
    for atoms, s in zip(starts, settings):
        thermalize(atoms, s["temperature_K"], s["seed"])
    model = potentials.load_model("cu-emt", checkpoint_dtype="float64")
    last, _ = md_many(model, starts, [build_integrator(s) for s in settings], 12)
    results = read(tmp_path / "out" / "results.extxyz", ":")
    for mine, expected in zip(results, last):
        assert minimum_image_distance(mine.positions, expected.positions, expected.cell) <= 1e-12
        assert mine.info["steps"] == 12 and mine.info["converged"]
    trajectory = read(tmp_path / "out" / "trajectory.extxyz", ":")
    assert [(f.info["index"], f.info["step"]) for f in trajectory] == [(k, s) for k in range(3) for s in (0, 4, 8, 12)]


def test_predict_many_over_3_ranks_equals_each_structure_alone(mpirun):
    """mlip_parallel.predict_many on 3 ranks (tests/mpi/batch_predict.py): ragged structures shared by atom count,
    every rank gets every result equal to predict of the structure alone (SchNet; a committee with its deviation)
    to 1e-12; different lists on the ranks are refused on every rank."""
    rc, out, _ = mpirun(3, ROOT / "tests" / "mpi" / "batch_predict.py")
    assert rc == 0 and "batch_predict on 3 ranks: 0 failure(s)" in out, out
    assert out.count("structures over 3 ranks, max rel err") == 2, out


def test_shares_balance_atoms():
    """The ranks' shares: every structure once, the largest first to the least loaded rank."""
    from mlip_parallel.many import shares

    parts = shares([10, 50, 20, 30, 40], 2)
    assert sorted(k for part in parts for k in part) == list(range(5))
    assert parts == [[0, 1, 2], [3, 4]]  # 50 | 40, 30 | 20 (70 each) | 10 to the lowest rank: loads 80 and 70


def test_the_batch_examples_run(tmp_path, monkeypatch, capsys):
    """examples/batch: make_structures.py, then mlip-batch on relax.yaml, md.yaml and score_candidates.yaml (a
    committee from examples/active_learning/make_committee.py), shortened; phonons_elastic.py: its batched forces
    equal MLIPCalculator's one at a time and its elastic constants are those of a stable cubic crystal."""
    import runpy

    from md.batch_cli import main

    examples = ROOT / "examples"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["make_structures.py", "6"])
    runpy.run_path(str(examples / "batch" / "make_structures.py"), run_name="__main__")
    monkeypatch.setattr(sys, "argv", ["make_committee.py", "--members", "2"])
    runpy.run_path(str(examples / "active_learning" / "make_committee.py"), run_name="__main__")
    for name, shorten in (("relax", {"relax": {"fmax": 0.01, "max_steps": 5, "cell": True}}),
                          ("md", {"md": {"ensemble": "langevin", "temperature_K": 300, "steps": 4,
                                         "timestep_fs": 2.0, "seed": 1, "trajectory_every": 2}}),
                          ("score_candidates", {})):
        job = yaml.safe_load((examples / "batch" / f"{name}.yaml").read_text())
        if name == "score_candidates":
            job["model"]["committee"] = job["model"]["committee"][:2]
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**job, **shorten}))
        assert main([f"{name}.yaml", "--no-progress"]) == 0, name
        results = read(tmp_path / job["output"]["directory"] / "results.extxyz", ":")
        assert [r.info["index"] for r in results] == list(range(6)), name
    assert all(r.info["max_devi_f"] > 0 for r in results)  # (the committee's scores)
    capsys.readouterr()
    runpy.run_path(str(examples / "batch" / "phonons_elastic.py"), run_name="__main__")
    out = capsys.readouterr().out
    difference = float(re.search(r"largest difference ([\d.e+-]+) eV/Å", out)[1])
    c11, c12, c44 = (float(x) for x in re.search(r"C11 ([\d.]+), C12 ([\d.]+), C44 ([\d.]+)", out).groups())
    assert difference <= 1e-12 and c11 > c12 > 0 and c44 > 0 and c11 - c12 > 0, out
