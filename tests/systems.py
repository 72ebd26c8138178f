"""The geometry set every distributed test runs over, the packages' references and fixtures, and the MPI scripts'
endings (the comparison itself: tests/comparison.py).

Imported by pytest tests and by the MPI scripts in tests/mpi/ (which put this folder on sys.path).
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from ase import Atoms
from ase.build import bulk, fcc111

import potentials

SPECIES = ["Ag", "Cu"]
LJ_PARAMS = dict(epsilon=0.4, sigma=2.3, cutoff=5.0)  # Cu-like Lennard-Jones


def _alloy(atoms, seed):
    """Make roughly a third of the atoms Ag, deterministically."""
    rng = np.random.default_rng(seed)
    numbers = atoms.numbers.copy()
    numbers[rng.random(len(atoms)) < 0.33] = 47
    atoms.numbers = numbers
    return atoms


def fcc_bulk():
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((3, 3, 3))
    atoms.rattle(0.08, seed=1)
    return _alloy(atoms, 1)


def hcp_triclinic():
    atoms = bulk("Cu", "hcp", a=2.55, c=4.16).repeat((4, 4, 3))  # 120° cell
    atoms.rattle(0.08, seed=2)
    return _alloy(atoms, 2)


def sheared():
    atoms = bulk("Cu", "fcc", a=3.61).repeat((4, 4, 4))  # rhombohedral 60° primitive cell
    cell = atoms.cell[:] @ np.array([[1.0, 0.0, 0.0], [0.15, 1.0, 0.0], [-0.1, 0.2, 1.0]])
    atoms.set_cell(cell, scale_atoms=True)
    atoms.rattle(0.08, seed=3)
    return _alloy(atoms, 3)


def slab():
    atoms = fcc111("Cu", size=(3, 3, 4), a=3.61, vacuum=7.0)
    atoms.pbc = (True, True, False)
    atoms.rattle(0.08, seed=4)
    return _alloy(atoms, 4)


def clusters():
    """Two clusters 14 Å apart along z, no pbc, no cell: middle subdomains own no atoms."""
    blob = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((2, 2, 2))
    blob.rattle(0.08, seed=5)
    other = blob.copy()
    other.positions += [1.0, 0.5, 14.0 + blob.positions[:, 2].max()]
    atoms = Atoms(numbers=np.concatenate([blob.numbers, other.numbers]),
                  positions=np.concatenate([blob.positions, other.positions]), pbc=False)
    return _alloy(atoms, 5)


def small_cell():
    """A cell whose edges (2.55 Å, 5.1 Å) are shorter than the cutoff: atoms see images of themselves."""
    atoms = bulk("Cu", "fcc", a=3.61).repeat((1, 2, 1))
    atoms.rattle(0.1, seed=6)
    atoms.numbers = [29, 47]
    return atoms


def on_boundaries():
    """An unrattled lattice (atoms exactly on the cut planes of 2- and 4-way splits), a few atoms
    displaced, and some atoms moved by whole cell vectors out of the cell."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((4, 2, 2))
    positions = atoms.positions.copy()
    positions[[3, 17, 40]] += [[0.2, -0.1, 0.05], [-0.1, 0.15, 0.1], [0.05, 0.05, -0.2]]
    cell = atoms.cell[:]
    positions[[0, 5, 9]] += [cell[0], -2 * cell[1], cell[0] + cell[2]]
    positions[12] -= 3 * cell[2]
    atoms.positions = positions
    return _alloy(atoms, 7)


GEOMETRIES = {
    "fcc_bulk": fcc_bulk,
    "hcp_triclinic": hcp_triclinic,
    "sheared": sheared,
    "slab": slab,
    "clusters": clusters,
    "small_cell": small_cell,
    "on_boundaries": on_boundaries,
}


def lennard_jones():
    return potentials.LennardJones(**LJ_PARAMS)


def schnet(dtype=torch.float64, seed=0, cutoff=4.0, features=16, layers=3):
    """A randomly initialised SchNet with non-trivial per-species shift and scale."""
    torch.manual_seed(seed)
    model = potentials.SchNet(SPECIES, cutoff=cutoff, features=features, layers=layers)
    model.scale_shift.shift.copy_(torch.tensor([-2.1, -3.4]))
    model.scale_shift.scale.copy_(torch.tensor([0.7, 1.3]))
    return model.to(dtype)


def ase_lj_results(atoms):
    """ASE's own LennardJones: the independent oracle for the Lennard-Jones tests."""
    from ase.calculators.lj import LennardJones as AseLJ

    atoms = atoms.copy()
    p = LJ_PARAMS
    atoms.calc = AseLJ(epsilon=p["epsilon"], sigma=p["sigma"], rc=p["cutoff"], smooth=False)
    result = {"energy": atoms.get_potential_energy(), "energies": atoms.get_potential_energies(),
              "forces": atoms.get_forces()}
    if atoms.cell.rank == 3:
        result["stress"] = atoms.get_stress()
    return result


def in_many_chunks(setattr=setattr, edges: int = 61) -> dict:
    """Make every memory-bounded path run in many small chunks (edge counts probed on ``edges`` + 3 edges, chunks of
    ``edges`` edges: several per block, the last one short) and count them: the returned {"edge sums": chunked edge
    sums run (``messages._ChunkedEdgeSum``), "checkpoints": checkpointed chunks (row chunks, groups of atoms)} grows
    as they run. ``setattr``: pytest's ``monkeypatch.setattr`` to undo it after a test."""
    import torch.utils.checkpoint

    import potentials.messages as messages

    counts = {"edge sums": 0, "checkpoints": 0}
    edge_sum, checkpoint = messages._ChunkedEdgeSum.forward, torch.utils.checkpoint.checkpoint

    def counted_edge_sum(ctx, *args):
        counts["edge sums"] += 1
        return edge_sum(ctx, *args)

    def counted_checkpoint(*args, **kwargs):
        counts["checkpoints"] += 1
        return checkpoint(*args, **kwargs)

    setattr(messages, "PROBE_EDGES", edges + 3)
    setattr(messages, "MIN_CHUNK_EDGES", edges)
    setattr(messages._ChunkedEdgeSum, "forward", staticmethod(counted_edge_sum))
    setattr(torch.utils.checkpoint, "checkpoint", counted_checkpoint)
    return counts


def verdict(world, failures: list, summary) -> tuple:
    """(every rank's ``failures`` gathered, each once, sorted; ``summary(number of failures)``): the same on every
    rank."""
    failures = sorted({f for mine in world.allgather(failures) for f in mine})
    return failures, summary(len(failures))


def exit_with_verdict(world, failures: list, summary) -> None:
    """The end of an MPI test script: ``verdict``; rank 0 prints the summary and each failure as "FAIL …"; every
    rank exits, with 1 on any failure."""
    import sys

    failures, line = verdict(world, failures, summary)
    if world.rank == 0:
        print(line)
        for f in failures:
            print("FAIL", f)
    sys.exit(1 if failures else 0)


GRIDS = {1: [None], 2: [None, (2, 1, 1), (1, 1, 2)], 3: [None, (3, 1, 1), (1, 3, 1), (1, 1, 3)],
         4: [None, (1, 1, 4), (2, 2, 1), (4, 1, 1), (1, 2, 2)]}  # ranks -> the grids a launch runs (None: automatic)


def adapter_verdict(world, title: str, failures: list, cases: int, expected: int, empty: int, chunks: dict | None,
                    faults: str) -> tuple:
    """The end of an adapter's run (tests/mpi/*_models.py): the number of cases and (``chunks``: the counts of
    ``in_many_chunks``, None where the run evaluates in one pass) of chunked edge sums checked, then ``verdict``:
    "P=…: TITLE N cases, K failures, E (case, rank) with no atoms, C chunked edge sums; FAULTS; communication: …"
    (``faults``: ``faults.tally()``)."""
    if cases != expected:
        failures.append(f"{cases} cases ran, expected {expected}")
    chunked_calls = 0 if chunks is None else int(world.allreduce(chunks["edge sums"]))
    if chunks is not None and chunked_calls == 0:
        failures.append("no chunked edge sum ran")
    return verdict(world, failures, lambda count: (
        f"P={world.size}: {title} {cases} cases, {count} failures, {empty} (case, rank) with no atoms, "
        f"{chunked_calls} chunked edge sums; {faults}; communication: {world.library}"))


def shared_out(owned: list, n_atoms: int) -> bool:
    """Every rank's owned-atom count ``owned`` covers the ``n_atoms`` atoms once, and on several ranks no
    rank holds them all (structures of more than 8 atoms): each rank evaluated only its share."""
    return sum(owned) == n_atoms and (len(owned) == 1 or n_atoms <= 8 or max(owned) < n_atoms)


# ------------------------------------------------------------------ SevenNet-0 structures
def silicon_diamond():
    atoms = bulk("Si", "diamond", a=5.43, cubic=True).repeat(2)
    atoms.rattle(0.05, seed=11)
    return atoms


def oxide_triclinic():
    """Rock-salt (Mg, Ca)O in its sheared 60° primitive cell: triclinic, three elements."""
    atoms = bulk("MgO", "rocksalt", a=4.21).repeat((2, 2, 2))
    atoms.set_cell(atoms.cell[:] @ np.array([[1.0, 0.05, 0.0], [0.0, 1.0, -0.04], [0.03, 0.0, 1.0]]), scale_atoms=True)
    numbers = atoms.numbers.copy()
    numbers[[0, 6]] = 20  # Ca on two Mg sites
    atoms.numbers = numbers
    atoms.rattle(0.05, seed=12)
    return atoms


def silicon_cluster():
    """A 35-atom diamond-lattice Si cluster, no pbc (wide mode stays affordable: no periodic images)."""
    atoms = bulk("Si", "diamond", a=5.43, cubic=True).repeat(3)
    centre = atoms.positions.mean(axis=0)
    atoms = atoms[np.linalg.norm(atoms.positions - centre, axis=1) < 5.0]
    atoms.pbc = False
    atoms.set_cell(np.zeros((3, 3)))
    atoms.rattle(0.05, seed=13)
    return atoms


SEVENNET_STRUCTURES = {"silicon_diamond": silicon_diamond, "oxide_triclinic": oxide_triclinic,
                       "silicon_cluster": silicon_cluster}


@functools.lru_cache(maxsize=None)
def sevenn_calculator():
    """sevenn's own SevenNetCalculator('7net-0'), built once per process (about a second each build) and shared by the
    tests that read it: an ASE calculator recomputes whenever the atoms it is given differ from its last ones."""
    from sevenn.calculator import SevenNetCalculator

    return SevenNetCalculator("7net-0")


def sevennet_reference(atoms):
    """sevenn's own SevenNetCalculator('7net-0') on one process: the oracle for the adapter."""
    atoms = atoms.copy()
    atoms.calc = sevenn_calculator()
    atoms.calc.reset()
    result = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if atoms.cell.rank == 3:
        result["stress"] = atoms.get_stress()
    return result


# ------------------------------------------------------------------ MACE fixtures (tests/data/mace)
MACE_DIR = Path(__file__).parent / "data" / "mace"
MACE_FIXTURES = ("mace-zbl-f64", "mace-heads-f64", "mace-small-f32")  # see tests/data/mace/make_fixtures.py


def mace_fixture(name: str):
    """(path of NAME.model, its heads, {geometry: (atoms, {head: reference})}): MACE models saved under
    e3nn 0.4.4 and MACECalculator's results for them (energy, forces, stress where periodic in 3D) plus
    the model's own virial (cells of rank 3) on this module's geometries."""
    data = np.load(MACE_DIR / f"{name}.npz")
    heads = [str(h) for h in data["heads"]]
    cases = {}
    for geometry in GEOMETRIES:
        atoms = Atoms(numbers=data[f"{geometry}/numbers"], positions=data[f"{geometry}/positions"],
                      cell=data[f"{geometry}/cell"], pbc=data[f"{geometry}/pbc"])
        cases[geometry] = (atoms, {head: {key: data[f"{geometry}/{head}/{key}"] for key in
                                          ("energy", "forces", "stress", "virial")
                                          if f"{geometry}/{head}/{key}" in data.files} for head in heads})
    return MACE_DIR / f"{name}.model", heads, cases


def mace_view(result: dict, reference: dict, atoms) -> dict:
    """Our ``result`` in the terms of MACE's ``reference`` (its keys: energy, forces, stress where periodic in 3D,
    virial): the virial is -stress × volume in our (ASE's) convention, compared with MACE's own, also for slabs."""
    from ase.stress import voigt_6_to_full_3x3_stress

    ours = {"energy": result["energy"], "forces": result["forces"]}
    if "stress" in reference:
        ours["stress"] = result["stress"]
    if "virial" in reference:
        ours["virial"] = -voigt_6_to_full_3x3_stress(result["stress"]) * atoms.cell.volume
    return ours


# ------------------------------------------------------------------ nequip-framework fixtures (tests/data/nequip)
NEQUIP_DIR = Path(__file__).parent / "data" / "nequip"
NEQUIP_FIXTURES = ("nequip-zbl", "allegro")  # each as NAME.ckpt and NAME.nequip.zip (make_fixtures.py)


@functools.lru_cache(maxsize=None)
def _nequip_calculator(path: str, stamp: tuple):
    """The nequip framework's NequIPCalculator of the file ``path`` as it was at ``stamp`` (its mtime and size: a file
    written again is loaded again), built once per process (about 0.8 s each build)."""
    from nequip.integrations.ase import NequIPCalculator

    return NequIPCalculator._from_saved_model(path, device="cpu", chemical_species_to_atom_type_map=True)


def nequip_reference(path, atoms) -> dict:
    """The nequip framework's own ASE calculator on ``atoms`` (energy, forces, and stress where the cell has
    a volume), run in the framework's global dtype (float64) and the process's put back after."""
    import logging

    dtype, level = torch.get_default_dtype(), logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        stat = Path(path).stat()
        calc = _nequip_calculator(str(path), (stat.st_mtime_ns, stat.st_size))
        calc.reset()
        torch.set_default_dtype(torch.float64)
        atoms = atoms.copy()
        atoms.calc = calc
        result = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
        if atoms.cell.rank == 3:
            result["stress"] = atoms.get_stress()
    finally:
        torch.set_default_dtype(dtype)
        logging.disable(level)
    return result


# ------------------------------------------------------------------ external models driving MD (mlip-md, mlip-lammps)
MD_STEPS = 20  # of the MD comparisons: a halo or force fault shows from the first step (the atoms move ~0.1 Å)
LAMMPS_METAL_MVV2E = 1.0364269e-4  # LAMMPS's metal-unit mass * velocity^2 -> energy constant (update.cpp)
MD_DECK = """units metal
atom_style atomic
boundary p p p
read_data start.data
mass 1 {cu:.17g}
mass 2 {ag:.17g}
{model_lines}
timestep 0.001
fix 1 all nve
thermo_style custom step pe ke etotal press
thermo 10
run {steps}
write_dump all custom {dump} id x y z modify format float %.17g sort id
"""


def write_md_comparison(directory, model: dict, decks: dict) -> Atoms:
    """The inputs of one NVE run (``MD_STEPS`` steps of 1 fs, 108 Cu/Ag atoms from ``fcc_bulk`` at 600 K) done three
    ways: ``md1.yaml`` (mlip-md, to run in one process), ``md2.yaml`` (mlip-md under mpiexec), and one
    LAMMPS deck per entry of ``decks`` {name: (model lines, extra mlip-lammps arguments)}, each writing
    NAME.dump; ``jobs.json`` lists md2 and the decks for tests/mpi/cli_jobs.py. LAMMPS's masses are scaled
    by the ratio of the two codes' unit constants, so that both integrate the same equations. ``model``:
    mlip-md's model section. Returns the start."""
    import json

    import yaml
    from ase import units
    from ase.io import write
    from ase.md.velocitydistribution import Stationary, thermalize_momenta

    directory = Path(directory)
    atoms = GEOMETRIES["fcc_bulk"]()
    thermalize_momenta(atoms, temperature_K=600, rng=np.random.default_rng(7))
    Stationary(atoms)
    assert set(np.round(atoms.get_masses(), 4)) == {63.546, 107.8682}
    write(directory / "start.traj", atoms)
    write(directory / "start.data", atoms, format="lammps-data", specorder=["Cu", "Ag"], velocities=True,
          units="metal")
    scale = 1 / (LAMMPS_METAL_MVV2E * (1000 * units.fs) ** 2)  # m_lammps = m * scale: the same accelerations
    jobs = [["mlip-md", "md2.yaml"]]
    for name, (lines, args) in decks.items():
        (directory / f"{name}.in").write_text(MD_DECK.format(cu=63.546 * scale, ag=107.8682 * scale, steps=MD_STEPS,
                                                             model_lines=lines, dump=f"{name}.dump"))
        jobs.append(["mlip-lammps", "-in", f"{name}.in", *args, "-screen", "none", "-log", f"{name}.log"])
    job = {"model": model, "structure": {"file": "start.traj"}, "temperature_K": 0, "ensemble": "nve",
           "timestep_fs": 1.0, "steps": MD_STEPS, "output": {"thermo_every": 10, "trajectory_every": 10}}
    for name in ("md1", "md2"):
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(dict(job, output=dict(job["output"], directory=name))))
    (directory / "jobs.json").write_text(json.dumps(jobs))
    return atoms


def run_md_comparison(mpirun, directory, model: dict, decks: dict, pythonpath=(), one_process=()) -> tuple:
    """``write_md_comparison``, then md1 in this process and md2 + the decks in one 2-rank launch of
    tests/mpi/cli_jobs.py: (``md_comparison_errors``, the launch's output); every job must exit 0. With
    ``pythonpath`` (directories the launches import from: an installed package's model family), md1 runs in a
    1-rank launch instead, with the further jobs ``one_process`` ([command, arg, ...] of cli_jobs.py), and its
    output comes first in the one returned."""
    import json
    import os

    from conftest import MPI_DIR
    from md.cli import main

    write_md_comparison(directory, model, decks)
    if pythonpath:
        jobs = [["mlip-md", "md1.yaml"], *one_process]
        (Path(directory) / "one.json").write_text(json.dumps(jobs))
        rc, first, _ = mpirun(1, MPI_DIR / "cli_jobs.py", directory, "one.json", pythonpath=pythonpath)
        assert rc == 0 and f"cli jobs exit codes {[0] * len(jobs)}" in first, first
    else:
        first = ""
        cwd = os.getcwd()
        os.chdir(directory)
        try:
            assert main(["md1.yaml"]) == 0
        finally:
            os.chdir(cwd)
    rc, out, _ = mpirun(2, MPI_DIR / "cli_jobs.py", directory, pythonpath=pythonpath)
    assert rc == 0 and f"cli jobs exit codes {[0] * (1 + len(decks))}" in out and "on 2 rank(s)" in out, out
    return md_comparison_errors(directory, decks), first + out


def md_comparison_errors(directory, decks) -> dict:
    """After ``write_md_comparison``'s runs: the largest position difference (Å, modulo the cell) of the
    2-rank mlip-md run from the one-process run ("md2") and of each deck's LAMMPS run from the 2-rank
    mlip-md run; "moved": the largest displacement of the one-process run from the start."""
    from ase.io import read

    directory = Path(directory)
    start = read(directory / "start.traj")
    one, two = (read(directory / name / "final.extxyz") for name in ("md1", "md2"))
    assert one.info["step"] == MD_STEPS
    def largest(a, b):  # modulo the cell: LAMMPS and mlip-md's final structure wrap atoms into it
        frac = (a - b) @ np.linalg.inv(two.cell[:])
        return float(np.abs((frac - np.round(frac)) @ two.cell[:]).max())

    errors = {"md2": largest(one.positions, two.positions), "moved": largest(one.positions, start.positions)}
    for name in decks:
        errors[name] = largest(np.loadtxt(directory / f"{name}.dump", skiprows=9)[:, 1:4], two.positions)
    return errors


# ------------------------------------------------------------------ fine-tuning (tests/test_finetune.py, tests/mpi/finetune.py)
def labelled_alloys(count: int, seed: int) -> list:
    """``count`` small Cu/Ag structures labelled by ASE's EMT (energy, forces; stress where periodic), in
    turn: an 8-atom orthorhombic cell, an 8-atom sheared (triclinic) cell, and two 4-atom clusters 12 Å apart,
    not periodic (a rank between them owns no atom)."""
    rng = np.random.default_rng(seed)
    frames = []
    for k in range(count):
        if k % 3 == 0:
            atoms = bulk("Cu", "fcc", a=3.65, cubic=True).repeat((2, 1, 1))
        elif k % 3 == 1:
            atoms = bulk("Cu", "fcc", a=3.62).repeat((2, 2, 2))
            atoms.set_cell(atoms.cell[:] @ np.array([[1.0, 0.0, 0.0], [0.12, 1.0, 0.0], [-0.08, 0.1, 1.0]]),
                           scale_atoms=True)
        else:
            blob = bulk("Cu", "fcc", a=3.61, cubic=True)
            atoms = Atoms(numbers=[29] * 8, positions=np.concatenate([blob.positions, blob.positions + [0.5, 0.3, 12.0]]),
                          cell=[20.0, 20.0, 30.0], pbc=False)  # (a cell, for packages that divide by its volume)
        if atoms.pbc.all():
            atoms.set_cell(atoms.cell[:] * rng.uniform(0.98, 1.03), scale_atoms=True)
        numbers = atoms.numbers.copy()
        numbers[rng.random(len(atoms)) < 0.35] = 47
        atoms.numbers = numbers
        atoms.rattle(0.08, seed=int(rng.integers(1 << 30)))
        frames.append(emt_labelled(atoms))
    return frames


def emt_labelled(atoms):
    """``atoms`` with ASE's EMT energy, forces and (periodic) stress held as fixed results (a SinglePointCalculator)."""
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms.calc = EMT()
    results = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if atoms.pbc.all():
        results["stress"] = atoms.get_stress()
    atoms.calc = SinglePointCalculator(atoms, **results)
    return atoms


def write_small_mace(path, seed: int = 0, interaction: str = "RealAgnosticResidualInteractionBlock",
                     first: str | None = None, interactions: int = 2) -> None:
    """A small random MACE (ScaleShiftMACE, Cu/Ag, L = 1 features, ``interactions`` interactions of class ``interaction``,
    the first ``first`` where given, float64) written as MACE's training writes one (``torch.save`` of the
    module), under this environment's e3nn."""
    from e3nn import o3
    from mace import modules

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = modules.ScaleShiftMACE(
                r_max=4.5, num_bessel=6, num_polynomial_cutoff=5, max_ell=2,
                interaction_cls=modules.interaction_classes[interaction],
                interaction_cls_first=modules.interaction_classes[first or interaction],
                num_interactions=interactions, num_elements=2, hidden_irreps=o3.Irreps("4x0e+4x1o"), MLP_irreps=o3.Irreps("8x0e"),
                gate=torch.nn.functional.silu, atomic_energies=np.array([-3.1, -2.2]), avg_num_neighbors=12.0,
                atomic_numbers=[29, 47], correlation=2, radial_MLP=[8, 8], atomic_inter_scale=1.2,
                atomic_inter_shift=0.1)
            with torch.no_grad():  # every weight away from its initial value (some start at zero)
                for p in model.parameters():
                    p.add_(0.2 * torch.randn_like(p))
    finally:
        torch.set_default_dtype(before)
    torch.save(model, path)


# the Allegro fixture with three layers, per-edge-type cutoffs (Ag-Cu 3.2 A, Ag-Ag 4.0 A: the pruner drops edges)
# and a ZBL pair potential (its readout reads the embedding's edge cutoff)
ALLEGRO_PRUNED = {"num_layers": 3, "per_edge_type_cutoff": {"Cu": 4.5, "Ag": {"Cu": 3.2, "Ag": 4.0}},
                  "pair_potential": {"_target_": "nequip.nn.pair_potential.ZBL", "units": "metal",
                                     "chemical_species": ["Cu", "Ag"]}}


def allegro_architecture(**model) -> dict:
    """The Allegro fixture's architecture (``framework_architecture``'s JSON) with ``model`` changed in its model
    config (also read by benchmarks/pipeline_memory.py)."""
    from potentials.adapters.nequip import framework_architecture

    architecture = framework_architecture(str(NEQUIP_DIR / "allegro.ckpt"), "sole_model")
    architecture["model"].update(model)
    return architecture


def write_framework_model(path, architecture: dict, seed: int = 0) -> None:
    """A nequip-framework model of ``architecture`` with random weights (torch seed ``seed``, the process's random
    state kept) as a framework checkpoint."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        potentials.NequIPFramework(architecture=architecture).save_native(path)


def write_small_sevennet(path, seed: int = 0) -> None:
    """A small random SevenNet (Cu/Ag, 8 channels, l ≤ 1, two convolutions) written as a sevenn checkpoint:
    SevenNet-0's model config with smaller sizes, built by sevenn's own model builder."""
    import sevenn
    import sevenn.util
    from sevenn.model_build import build_E3_equivariant_model

    config = dict(sevenn.util.load_checkpoint("7net-0").config)
    for key in ("shift_cp", "scale_cp", "avg_num_neigh_cp", "load_dataset_path", "load_validset_path", "continue"):
        config.pop(key, None)
    config.update(chemical_species=["Ag", "Cu"], _number_of_species=2, _type_map={47: 0, 29: 1},
                  _chemical_species_by_atomic_number=[47, 29], channel=8, lmax=1, num_convolution_layer=2,
                  irreps_manual=False, weight_nn_hidden_neurons=[16], avg_num_neigh=[20.0, 20.0],
                  conv_denominator=20.0, shift=[-2.5, -3.5], scale=[1.2, 1.4], cutoff=4.5,
                  cutoff_function={"cutoff_function_name": "XPLOR", "cutoff_on": 4.0}, version=sevenn.__version__,
                  _flash_lammps=False, use_oeq=False, device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_E3_equivariant_model(dict(config))
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.2 * torch.randn_like(p))
    torch.save({"config": config, "model_state_dict": model.state_dict()}, path)


# ------------------------------------------------------------------ fairchem fixtures (tests/data/fairchem)
FAIRCHEM_DIR = Path(__file__).parent / "data" / "fairchem"
# fixture -> the options it runs with (see make_fixtures.py): uma-dense's omol task with a charge and a spin
FAIRCHEM_FIXTURES = {"uma-moe": {"task": "omat"}, "uma-dense": {"task": "omol", "charge": 1, "spin": 2},
                     "esen": {"task": "omat"}}
_FAIRCHEM_UNITS: dict = {}


def cached_fairchem_reference(name: str, geometry: str, dtype=torch.float64) -> dict:
    """FAIRChemCalculator's result for the fixture ``name`` (with its options) on ``GEOMETRIES[geometry]``, as
    tests/data/fairchem/make_references.py saved it (checked against the calculator run anew in
    tests/test_fairchem.py); AssertionError where the geometry is no longer the one saved (make the file anew)."""
    prefix = f"{name}/{str(dtype).removeprefix('torch.')}/{geometry}"
    with np.load(FAIRCHEM_DIR / "references.npz") as data:
        saved = {key.removeprefix(prefix + "/"): data[key] for key in data.files if key.startswith(prefix + "/")}
    atoms = GEOMETRIES[geometry]()
    assert saved and np.array_equal(saved["positions"], atoms.positions) and np.array_equal(saved["numbers"],
                                                                                             atoms.numbers), \
        f"tests/data/fairchem/references.npz has no {prefix} of this geometry: run make_references.py"
    return {q: saved[q] if q != "energy" else float(saved[q]) for q in ("energy", "forces", "stress") if q in saved}


def fairchem_model(name: str, dtype=torch.float64, **changes):
    """The fixture ``name`` as our model, with its options (``changes`` replace them)."""
    return potentials.FAIRChem(str(FAIRCHEM_DIR / f"{name}.pt"), dtype=dtype, **{**FAIRCHEM_FIXTURES[name], **changes})


def fairchem_training_model(path, task: str, dtype=torch.float64):
    """fairchem's own training forward of the checkpoint at ``path``: (its HydraModel with the EMA weights, built by
    fairchem's ``load_inference_model`` as ``load_predict_unit`` builds it, in ``dtype``, in training mode;
    ``outputs(batch)``: ``task``'s outputs on a batch of fairchem's AtomicData, denormalised by fairchem's task
    normaliser and element references as ``MLIPPredictUnit`` applies them, {property: tensor})."""
    from fairchem.core.units.mlip_unit.utils import load_inference_model, load_tasks

    from potentials.exchange import default_dtype
    from potentials.adapters.fairchem import import_fairchem

    import_fairchem()
    with default_dtype(dtype):
        model = load_inference_model(str(path), overrides={"backbone": {"always_use_pbc": False}}, use_ema=True,
                                     return_checkpoint=False).module.train()
        tasks = [t for t in load_tasks(str(path)) if task in t.datasets]

    def outputs(batch) -> dict:
        out, result = model(batch), {}
        for t in tasks:
            value = t.normalizer.denorm(out[t.name if t.name in out else t.property][t.property])
            result[t.property] = value if t.element_references is None else t.element_references.undo_refs(batch, value)
        return result

    return model, outputs


def fairchem_reference(name: str, atoms, dtype=torch.float64, merge_mole: bool = False, path=None,
                       **changes) -> dict:
    """fairchem's own FAIRChemCalculator on ``atoms`` (energy, forces, and stress where the cell has a volume) with
    the fixture's task, charge and spin (``changes`` replace them), fairchem's inference settings in ``dtype``
    (no compilation; ``merge_mole``: experts merged for this composition, as fairchem's fast presets do). ``path``:
    another checkpoint than the fixture (one fine-tuned from it), built by fairchem in ``dtype`` (float64 weights
    load unrounded)."""
    import contextlib
    import logging

    from potentials.exchange import default_dtype

    from fairchem.core.calculate.ase_calculator import FAIRChemCalculator
    from fairchem.core.units.mlip_unit import load_predict_unit
    from fairchem.core.units.mlip_unit.api.inference import InferenceSettings

    options = {**FAIRCHEM_FIXTURES[name], **changes}
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        cached = not (merge_mole or path)  # (only the fixtures: a merged model serves one composition)
        unit = _FAIRCHEM_UNITS.get((name, dtype)) if cached else None
        if unit is None:
            settings = InferenceSettings(base_precision_dtype=dtype, merge_mole=merge_mole, compile=False, tf32=False)
            with default_dtype(dtype) if path else contextlib.nullcontext():
                unit = load_predict_unit(str(path or FAIRCHEM_DIR / f"{name}.pt"), inference_settings=settings,
                                         device="cpu")
            if cached:
                _FAIRCHEM_UNITS[(name, dtype)] = unit
        atoms = atoms.copy()
        for key_ in ("charge", "spin"):
            if key_ in options:
                atoms.info[key_] = options[key_]
        atoms.calc = FAIRChemCalculator(unit, task_name=options["task"])
        result = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
        if atoms.cell.rank == 3:
            result["stress"] = atoms.get_stress()
    finally:
        logging.disable(level)
    return result


def phonon_frequencies(unit, calculator, primitive_matrix=None, zero_modes: int = 3) -> np.ndarray:
    """phonopy's frequencies (THz) of ``unit`` (ASE Atoms) from ``calculator``'s forces: 2×2×2 ``unit`` cells,
    displacements of 0.01 Å, at Γ (its first ``zero_modes`` left out: the acoustic modes' zero carries the square root
    of rounding), X (0.5, 0, 0.5) and L (0.5, 0.5, 0.5) of ``primitive_matrix`` (phonopy's: None, "F", ...)."""
    from phonopy import Phonopy
    from phonopy.structure.atoms import PhonopyAtoms

    phonon = Phonopy(PhonopyAtoms(symbols=unit.get_chemical_symbols(), cell=unit.cell[:],
                                  scaled_positions=unit.get_scaled_positions()),
                     supercell_matrix=2 * np.eye(3, dtype=int), primitive_matrix=primitive_matrix)
    phonon.generate_displacements(distance=0.01)
    forces = []
    for supercell in phonon.supercells_with_displacements:
        atoms = Atoms(supercell.symbols, cell=supercell.cell, scaled_positions=supercell.scaled_positions, pbc=True)
        atoms.calc = calculator
        forces.append(atoms.get_forces().copy())
    phonon.forces = forces
    phonon.produce_force_constants()
    return np.concatenate([phonon.get_frequencies([0, 0, 0])[zero_modes:],
                           *(phonon.get_frequencies(q) for q in ([0.5, 0, 0.5], [0.5, 0.5, 0.5]))])


def copper_vacancy_hop() -> tuple:
    """(initial, final): fcc Cu of 2×2×1 cubic cells less atom 0, and with its nearest neighbour moved into the empty
    site (unrelaxed end points: the band's images relax between them)."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((2, 2, 1))
    site = atoms.positions[0].copy()
    neighbour = int(np.argsort(np.linalg.norm(atoms.positions - site, axis=1))[1])
    del atoms[0]
    final = atoms.copy()
    final.positions[neighbour - 1] = site
    return atoms, final


# ------------------------------------------------------------------ molecules and water (AIMNet2's tests)
def water_box():
    """8 randomly placed and turned waters in a sheared periodic cell (24 atoms)."""
    from ase.build import molecule

    rng = np.random.default_rng(2)
    box = Atoms(cell=np.diag([9.0, 9.5, 10.0]) + np.array([[0, 0, 0], [0.8, 0, 0], [0.3, -0.5, 0]]), pbc=True)
    for _ in range(8):
        water = molecule("H2O")
        water.rotate(rng.uniform(0, 360), rng.normal(size=3))
        water.translate(box.cell.cartesian_positions(rng.uniform(0, 1, 3)))
        box += water
    return box


def benzene_and_ethanol():
    """A benzene and an ethanol 3.6 Å above it, no cell (21 atoms)."""
    from ase.build import molecule

    ethanol = molecule("CH3CH2OH")
    ethanol.positions += [0.3, -0.2, 3.6]
    return molecule("C6H6") + ethanol
