"""The long-range Coulomb term (potentials/coulomb.py) and the born_coulomb family: against torch-pme's own
calculators, NaCl's Madelung constant, finite differences and LAMMPS's born/coul/long + ewald; distributed == one
process (tests/mpi/long_range.py); every tool; bad input named in one line."""

import numpy as np
import pytest
import torch
import yaml
from ase.build import bulk

import potentials
from comparison import assert_close
from conftest import ROOT, importable, launch_sections, needs
from potentials.base import Potential
from potentials.coulomb import ChargeModel, ewald_kvectors
from potentials.families import ModelSpecError
from potentials.predict import periodic_graph, predict

FUMI_TOSI = {"Na-Na": [0.2637, 0.317, 2.340, 1.0486, -0.4993], "Na-Cl": [0.2110, 0.317, 2.755, 6.99055, -8.6758],
             "Cl-Cl": [0.1582, 0.317, 3.170, 72.40215, -145.4284]}
ZERO_PAIRS = {name: [0.0, 1.0, 0.0, 0.0, 0.0] for name in FUMI_TOSI}  # the Coulomb energy alone
MADELUNG_NACL = 1.747564594633182  # the rocksalt structure's, per nearest-neighbour distance


def born(method="ewald", accuracy=1e-8, pairs=FUMI_TOSI, cutoff=6.0):
    return potentials.load_model(("born_coulomb", {"charges": {"Na": 1.0, "Cl": -1.0}, "pairs": pairs,
                                                   "cutoff": cutoff}),
                                 long_range={"method": method, "accuracy": accuracy})


def born_with(**long_range):
    return potentials.load_model(("born_coulomb", {"charges": {"Na": 1.0, "Cl": -1.0}, "pairs": FUMI_TOSI,
                                                   "cutoff": 6.0}), long_range=long_range)


def nacl_box(repeat=(2, 2, 2), shear=True, seed=3):
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(repeat)
    if shear:
        atoms.set_cell(atoms.cell[:] + np.array([[0, 0, 0], [1.1, 0, 0], [0.4, -0.7, 0]]), scale_atoms=True)
    atoms.positions += np.random.default_rng(seed).normal(0.0, 0.15, atoms.positions.shape)
    return atoms


@pytest.mark.parametrize("method, accuracy, tolerance", [("ewald", 1e-10, 1e-10), ("pme", 1e-7, 1e-8),
                                                          ("p3m", 1e-7, 1e-7)])
def test_madelung_constant_of_rocksalt(method, accuracy, tolerance):
    """Unit charges on the rocksalt lattice: E/ion pair = −M e²/(4πε0 d)."""
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True)
    energy = predict(born(method, accuracy, ZERO_PAIRS, cutoff=5.0), atoms)["energy"]
    madelung = -energy / (len(atoms) / 2) * 2.82 / 14.399645478425667
    assert abs(madelung - MADELUNG_NACL) < tolerance, (method, madelung)


class GivenCharges(ChargeModel, Potential):
    """Charges given per atom (one process: the graph's rows are the atoms), no short-range energy."""

    layers = 1

    def __init__(self, charges, cutoff, long_range):
        super().__init__(species=None)
        self.cutoff, self.hyperparameters = cutoff, {}
        self.register_buffer("given", torch.as_tensor(charges, dtype=torch.float64))
        self.double()
        self.set_long_range(long_range)

    def charges(self, graph):
        return self.given[: graph.n_nodes]

    def forward(self, graph):
        return self.coulomb_energies(graph)


@pytest.mark.parametrize("method, mesh", [("ewald", "auto"), ("pme", "replicated"), ("pme", "distributed"),
                                          ("p3m", "replicated"), ("p3m", "distributed")])
@pytest.mark.parametrize("net_charge", [0.0, 1.5])
def test_equals_torch_pme_own_calculator(method, mesh, net_charge):
    """Uneven charges (as a model predicts them, net charge 0 or 1.5 e) on a sheared box: per-atom energies, forces
    and dE/dε equal torch-pme's own calculator with the same split (its Ewald given our k-vectors) to 1e-12, the mesh
    held whole or as the one slab of potentials.slab_mesh (its bricks, transposes and k-space filter on one rank)."""
    import torchpme
    from vesin import NeighborList

    atoms = nacl_box()
    charges = np.random.default_rng(1).normal(0.0, 0.7, len(atoms))
    charges += (net_charge - charges.sum()) / len(atoms)
    cutoff = 6.0
    model = GivenCharges(charges, cutoff, {"method": method, "accuracy": 1e-6, "mesh": mesh})
    x, graph = periodic_graph(model, atoms)
    ours = model(graph)
    dE_dpos, dE_dstrain = torch.autograd.grad(ours.sum(), [x.pos, x.strain])

    smearing, resolution = model.long_range.split(cutoff, x.cell, len(atoms), float((charges**2).sum()))
    potential = torchpme.CoulombPotential(smearing=smearing, prefactor=torchpme.prefactors.eV_A)
    if method == "ewald":
        calculator = torchpme.EwaldCalculator(potential, lr_wavelength=resolution, full_neighbor_list=True)
    else:
        kind = torchpme.PMECalculator if method == "pme" else torchpme.P3MCalculator
        calculator = kind(potential, mesh_spacing=resolution, full_neighbor_list=True)
    calculator = calculator.to(torch.float64)
    pos = torch.tensor(atoms.positions, requires_grad=True)
    strain = torch.zeros((3, 3), dtype=torch.float64, requires_grad=True)
    deform = torch.eye(3, dtype=torch.float64) + strain
    cell = torch.tensor(atoms.cell[:]) @ deform
    i, j, d = NeighborList(cutoff=cutoff, full_list=True).compute(points=atoms.positions, box=atoms.cell[:],
                                                                  periodic=True, quantities="ijS")
    shifts = torch.tensor(d, dtype=torch.float64)
    i, j = torch.tensor(i, dtype=torch.long), torch.tensor(j, dtype=torch.long)
    moved = pos @ deform
    distances = (moved[j] - moved[i] + shifts @ cell).norm(dim=1)
    q = torch.tensor(charges).reshape(-1, 1)
    kvectors = ewald_kvectors(cell, resolution) if method == "ewald" else None
    values = calculator(q, cell, moved, torch.stack([i, j], dim=1), distances, kvectors=kvectors)
    theirs = (q * values).reshape(-1)
    their_pos, their_strain = torch.autograd.grad(theirs.sum(), [pos, strain])
    assert_close(ours.detach().numpy(), theirs.detach().numpy(), 1e-12, label="per-atom energies")
    assert_close(dE_dpos.numpy(), their_pos.numpy(), 1e-12, label="forces")
    assert_close(dE_dstrain.numpy(), their_strain.numpy(), 1e-12, label="dE/dstrain")


def test_a_cluster_sums_every_pair():
    """A structure periodic in no direction (a charged NaCl cluster): ½ Σ_{i≠j} q_i q_j / r_ij, to 1e-12 of numpy's."""
    atoms = nacl_box(shear=False)
    atoms.pbc = False
    del atoms[3]
    q = np.where(atoms.numbers == 11, 1.0, -1.0)
    r = np.linalg.norm(atoms.positions[:, None] - atoms.positions[None], axis=2)
    np.fill_diagonal(r, np.inf)
    energy = predict(born(pairs=ZERO_PAIRS), atoms)["energy"]
    assert abs(energy - 0.5 * 14.399645478425667 * (q[:, None] * q[None] / r).sum()) < 1e-12 * abs(energy)


def test_forces_and_stress_are_the_energy_derivatives():
    """Central differences (h = 1e-5 Å, and 1e-6 strain) of the energy: forces and stress to 1e-7 relative; the split
    given (the one from the accuracy follows the cell, and moves the energy by up to the accuracy)."""
    model, atoms = born(), nacl_box((2, 2, 1))
    model.set_long_range({"method": "ewald", "smearing": 1.3, "resolution": 1.0})
    result = predict(model, atoms)
    h = 1e-5
    for atom, axis in ((0, 0), (5, 1), (11, 2)):
        plus, minus = atoms.copy(), atoms.copy()
        plus.positions[atom, axis] += h
        minus.positions[atom, axis] -= h
        numeric = -(predict(model, plus)["energy"] - predict(model, minus)["energy"]) / (2 * h)
        assert abs(numeric - result["forces"][atom, axis]) < 1e-7 * np.abs(result["forces"]).max()
    eps = 1e-6
    for (a, b), voigt in (((0, 0), 0), ((1, 2), 3)):
        strain = np.zeros((3, 3))
        strain[a, b] = strain[b, a] = eps
        energies = []
        for sign in (1, -1):
            strained = atoms.copy()
            strained.set_cell(atoms.cell[:] @ (np.eye(3) + sign * strain), scale_atoms=True)
            energies.append(predict(model, strained)["energy"])
        numeric = (energies[0] - energies[1]) / (2 * eps * (2 if a != b else 1)) / atoms.cell.volume
        assert abs(numeric - result["stress"][voigt]) < 1e-7 * np.abs(result["stress"]).max(), (voigt, numeric)


def test_batch_checkpoint_calculator_and_committee_agree_with_predict(tmp_path):
    """predict_many over boxes of several shapes and a charged one, a checkpoint written and read back, and the ASE
    calculator: each equals predict of the structure alone to 1e-12; a committee of an Ewald and a PME model gives
    their mean forces and their deviation."""
    import mlip_parallel
    from md.calculator import MLIPCalculator

    model = born("ewald", 1e-7)
    charged = nacl_box((2, 1, 1), seed=5)
    del charged[1]
    structures = [nacl_box(), nacl_box((1, 2, 1), shear=False, seed=4), charged]
    alone = [predict(model, a) for a in structures]
    for got, want in zip(potentials.predict_many(model, structures), alone):
        assert_close({k: got[k] for k in ("energy", "forces", "stress")},
                     {k: want[k] for k in ("energy", "forces", "stress")}, 1e-12)
    potentials.save(model, tmp_path / "born.pt")
    loaded = potentials.load(tmp_path / "born.pt")
    assert loaded.long_range.settings == model.long_range.settings
    assert_close(predict(loaded, structures[0])["forces"], alone[0]["forces"], 1e-12, label="checkpoint")
    atoms = structures[0].copy()
    atoms.calc = MLIPCalculator(model)
    assert_close(atoms.get_forces(), alone[0]["forces"], 1e-12, label="calculator")
    assert abs(atoms.get_potential_energy() - alone[0]["energy"]) < 1e-12 * abs(alone[0]["energy"])
    other = born("pme", 1e-4)
    committee = mlip_parallel.evaluate([model, other], structures[0])
    theirs = predict(other, structures[0])["forces"]
    assert_close(committee["forces"], (alone[0]["forces"] + theirs) / 2, 1e-12, label="committee")
    assert_close(committee["devi_f"], np.linalg.norm(alone[0]["forces"] - theirs, axis=1) / 2, 1e-9, label="σ_F")


def test_mlip_md_runs_the_example(tmp_path):
    """examples/md_nacl_ewald.yaml (born_coulomb beside long_range), shortened to 60 steps of 64 ions with PME: the
    total energy stays within 1e-4 eV per atom (3e-5 measured)."""
    from md.cli import main

    config = yaml.safe_load((ROOT / "examples" / "md_nacl_ewald.yaml").read_text())
    config["model"]["long_range"]["method"] = "pme"
    config.update(steps=60, output={"directory": str(tmp_path / "out"), "thermo_every": 10})
    config["structure"]["repeat"] = [2, 2, 2]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    assert main([str(tmp_path / "job.yaml"), "--no-progress"]) == 0
    table = np.genfromtxt(tmp_path / "out" / "thermo.csv", delimiter=",", names=True)
    assert np.ptp(table["etot_eV"]) < 1e-4 * 64, table["etot_eV"]


@needs("lammps")
def test_mlip_lammps_runs_the_example(mpirun, tmp_path):
    """examples/lammps/in.nacl_born with the model file examples/lammps/nacl_born.yaml (born_coulomb:FILE), 216 ions,
    100 steps on 2 ranks: the total energy LAMMPS prints stays within 1e-4 eV per atom (3e-5 measured); a model file
    that is not there is named in one line."""
    script = ("import os, sys; os.chdir(sys.argv[1]); from mlip_parallel.lammps.cli import main; "
              "sys.exit(main(sys.argv[2:]))")
    rc, out, _ = mpirun(2, "-c", script, tmp_path, "-in", ROOT / "examples" / "lammps" / "in.nacl_born",
                        "--model", f"born_coulomb:{ROOT / 'examples' / 'lammps' / 'nacl_born.yaml'}",
                        "-var", "steps", "100")
    assert rc == 0, out
    log = (tmp_path / "log.lammps").read_text().splitlines()
    start = next(k for k, line in enumerate(log) if line.split()[:2] == ["Step", "Temp"])
    etot = np.array([float(line.split()[3]) for line in log[start + 1:start + 4]])
    assert len(etot) == 3 and np.ptp(etot) < 1e-4 * 216, log[start:start + 4]
    rc, out, _ = mpirun(2, "-c", script, tmp_path, "-in", ROOT / "examples" / "lammps" / "in.nacl_born",
                        "--model", f"born_coulomb:{tmp_path / 'missing.yaml'}")
    assert rc == 2 and "cannot read it as a YAML mapping" in out, out


def test_mlip_train_trains_a_painn_with_charges(tmp_path, capsys):
    """mlip-train builds a new PaiNN with a charge head (examples/charges/train_painn_charges.yaml's model section:
    model.hyperparameters.charges, model.long_range) and trains it on NaCl boxes labelled by the Fumi–Tosi model: the
    training loss falls, the charges of each structure add up to its total, best.pt reads back with its long-range
    term; long_range on a PaiNN without charges is named."""
    import yaml
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from mlip_parallel.train.cli import main

    labeller, rng, frames = born("ewald", 1e-6), np.random.default_rng(0), []
    for _ in range(8):
        atoms = bulk("NaCl", "rocksalt", a=5.64 * rng.uniform(0.97, 1.05), cubic=True).repeat((2, 2, 1))
        atoms.positions += rng.normal(0.0, 0.2, atoms.positions.shape)
        labels = predict(labeller, atoms)
        atoms.calc = SinglePointCalculator(atoms, energy=labels["energy"], forces=labels["forces"])
        frames.append(atoms)
    write(tmp_path / "nacl.extxyz", frames)
    model = yaml.safe_load((ROOT / "examples" / "charges" / "train_painn_charges.yaml").read_text())["model"]
    model["hyperparameters"]["features"], model["dtype"] = 16, "float64"
    config = {"data": {"train": str(tmp_path / "nacl.extxyz"), "validation_fraction": 0.25}, "model": model,
              "loss": {"energy_weight": 1.0, "forces_weight": 10.0}, "optimizer": {"lr": 0.005}, "epochs": 6,
              "batch_size": 3, "output": {"directory": str(tmp_path / "out")}}
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(config))
    assert main([str(tmp_path / "q.yaml"), "--no-progress"]) == 0
    losses = np.genfromtxt(tmp_path / "out" / "metrics.csv", delimiter=",", names=True)["train_loss"]
    assert losses[-1] < 0.5 * losses[0], losses
    trained = potentials.load(tmp_path / "out" / "best.pt")
    assert trained.long_range.settings["method"] == "ewald" and trained.predicts_charges
    atoms = frames[0].copy()
    atoms.info["charge"] = 2
    x, graph = periodic_graph(trained, atoms)
    h = trained.embed(graph, None)
    for k in range(trained.n_blocks):
        h = trained.block(k, h, graph, None)
    assert abs(float(trained.predicted_charges(h, graph).detach().sum()) - 2.0) < 1e-12
    model["hyperparameters"].pop("charges")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(dict(config, output={"directory": str(tmp_path / "bad")})))
    assert main([str(tmp_path / "bad.yaml"), "--no-progress"]) == 2
    assert not (tmp_path / "bad").exists()
    assert "long_range is given, but a PaiNN predicts no charges" in capsys.readouterr().err


def test_bad_input_is_named():
    cases = [
        (lambda: potentials.load_model(("born_coulomb", {"charges": {"Na": 1.0, "Cl": -1.0}, "pairs": FUMI_TOSI,
                                                         "cutoff": 6.0})), "needs long_range"),
        (lambda: potentials.load_model(("lj", {"epsilon": 0.01, "sigma": 3.4, "cutoff": 8.0}),
                                       long_range={"method": "ewald"}), "a LennardJones predicts no charges"),
        (lambda: born("fmm"), "long_range.method 'fmm': one of ewald, pme, p3m"),
        (lambda: born("ewald", 0.0), "long_range.accuracy 0.0: a number in (0, 1)"),
        (lambda: potentials.load_model(("born_coulomb", {"charges": {"Na": 1.0, "Cl": -1.0}, "pairs": FUMI_TOSI,
                                                         "cutoff": 6.0}), long_range={"method": "ewald", "grid": 1}),
         "long_range: unknown key(s) ['grid']"),
        (lambda: born_with(method="pme", mesh=1), "long_range.mesh 1: one of auto, replicated, distributed"),
        (lambda: born_with(method="ewald", mesh="distributed"), "long_range.mesh 'distributed' is for pme and p3m"),
        (lambda: potentials.load_model(("born_coulomb", {"charges": {"Na": 1.0, "Cl": -1.0},
                                                         "pairs": {"Na-Cl": FUMI_TOSI["Na-Cl"]}, "cutoff": 6.0}),
                                       long_range={}), "pairs: no parameters for Na-Na, Cl-Cl"),
    ]
    for make, message in cases:
        with pytest.raises(ModelSpecError, match=None) as caught:
            make()
        assert message in str(caught.value) and "\n" not in str(caught.value), (message, str(caught.value))
    slab = nacl_box(shear=False)
    slab.pbc = (True, True, False)
    with pytest.raises(potentials.LongRangeError, match="needs a cell periodic in all three directions, or none"):
        predict(born(), slab)
    with pytest.raises(potentials.LongRangeError, match="cannot reach accuracy 1e-12 with a 1.5 Å real-space cutoff"):
        predict(born("pme", 1e-12, cutoff=1.5), nacl_box())


def test_a_reciprocal_part_that_does_not_fit_is_named(monkeypatch):
    """Ewald's memory grows as k-vectors × atoms (estimated 9.8 GiB at 8,000 NaCl ions, 9.6 GB measured), a mesh's
    as its points: with 100 MB free, a 512-ion box is refused by name (183 MB) and pointed to a mesh; the mesh (69 MB)
    then runs."""
    import potentials.messages

    monkeypatch.setattr(potentials.messages, "available_bytes", lambda device: 100e6)
    atoms = nacl_box((4, 4, 4), shear=False)
    with pytest.raises(potentials.LongRangeError, match=r"ewald over 512 atoms would need about .* GiB on a rank for "
                                                        r"its reciprocal part, more than is free on 1 rank\(s\): use "
                                                        r"pme or p3m"):
        predict(born("ewald", 1e-5, pairs=ZERO_PAIRS), atoms)
    assert np.isfinite(predict(born("p3m", 1e-4, pairs=ZERO_PAIRS), atoms)["energy"])


@pytest.fixture(scope="module")
def on_four_ranks(mpirun):
    """``on_four_ranks(name)`` → (exit status, output) of tests/mpi/long_range.py ("long_range") and, where LAMMPS is
    installed, tests/mpi/lammps_born.py ("lammps_born"), in one 4-rank launch (``conftest.launch_sections``)."""
    scripts = [("long_range", ["long_range.py"])] + ([("lammps_born", ["lammps_born.py"])] if importable("lammps")
                                                      else [])
    return launch_sections(mpirun, 4, scripts)


@pytest.mark.parametrize("ranks", [4])  # (the meshes on 4, 3 and 2 ranks in this launch)
def test_distributed_equals_one_process(on_four_ranks, ranks):
    rc, out = on_four_ranks("long_range")
    assert rc == 0 and f"long range P={ranks}: 0 failures" in out, out


@needs("lammps")
@pytest.mark.parametrize("ranks", [4])  # (one process == 2–4 ranks: test_distributed_equals_one_process)
def test_equals_lammps_born_coul_long_with_ewald(on_four_ranks, ranks):
    rc, out = on_four_ranks("lammps_born")
    assert rc == 0 and f"lammps born P={ranks}: 0 failures" in out, out
