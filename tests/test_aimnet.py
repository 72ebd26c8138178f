"""AIMNet2 (potentials.adapters.aimnet: aimnet's own modules on our graph, its Coulomb energy our long_range term)
against aimnet's own forward and calculator; distributed == one process (tests/mpi/aimnet_models.py). Models are
built from the config shipped with aimnet with seeded random weights (its released weights download from the
internet)."""
import contextlib

import numpy as np
import pytest
import torch
from ase.build import molecule

import potentials
from comparison import assert_close
from conftest import MPI_DIR, needs
from systems import benzene_and_ethanol as molecules, water_box
from potentials.families import ModelSpecError
from potentials.predict import predict

pytestmark = needs("aimnet")  # pip install -e .[aimnet]


def model(method="ewald", accuracy=1e-8):
    return potentials.load_model("aimnet:aimnet2", dtype="float64", weights_seed=3,
                                 long_range={"method": method, "accuracy": accuracy})


@contextlib.contextmanager
def aimnet_in_float64():
    """aimnet's own forward in float64: it casts its inputs to the default dtype torch had when aimnet was imported
    (float32 in this process), its one setting of it."""
    from aimnet.models.base import AIMNet2Base

    saved = AIMNet2Base._required_keys_dtype, AIMNet2Base._optional_keys_dtype
    wide = [[torch.float64 if d.is_floating_point else d for d in dtypes] for dtypes in saved]
    AIMNet2Base._required_keys_dtype, AIMNet2Base._optional_keys_dtype = wide
    try:
        yield
    finally:
        AIMNet2Base._required_keys_dtype, AIMNet2Base._optional_keys_dtype = saved


def flat_neighbours(atoms, cutoff):
    """aimnet's flat neighbour matrix [n + 1, M] (padding n) and integer image shifts of ``atoms`` within ``cutoff``."""
    from vesin import NeighborList

    n = len(atoms)
    i, j, s = NeighborList(cutoff=cutoff, full_list=True).compute(points=atoms.positions, box=atoms.cell[:],
                                                                  periodic=True, quantities="ijS")
    order = np.argsort(i, kind="stable")
    i, j, s = i[order], j[order], s[order]
    counts = np.bincount(i, minlength=n)
    slot = np.arange(len(i)) - (np.cumsum(counts) - counts)[i]
    nbmat = torch.full((n + 1, counts.max()), n, dtype=torch.int32)
    nbmat[i, slot] = torch.tensor(j, dtype=torch.int32)
    shifts = torch.zeros((n + 1, counts.max(), 3), dtype=torch.float64)
    shifts[i, slot] = torch.tensor(s, dtype=torch.float64)
    return nbmat, shifts


def own_forward(net, atoms, charge):
    """Energy and forces of aimnet's own model ``net`` on ``atoms`` (float64): every pair of a molecule (its dense
    input), or for a periodic cell its flat input with a 5 Å and a 12 Å neighbour list."""
    n = len(atoms)
    if not atoms.pbc.any():
        coord = torch.tensor(atoms.positions).unsqueeze(0).requires_grad_(True)
        data = {"coord": coord, "numbers": torch.tensor(atoms.numbers).unsqueeze(0),
                "charge": torch.tensor([float(charge)], dtype=torch.float64)}
    else:
        (nbmat, shifts), (nbmat_lr, shifts_lr) = flat_neighbours(atoms, 5.0), flat_neighbours(atoms, 12.0)
        coord = torch.cat([torch.tensor(atoms.positions), torch.zeros((1, 3), dtype=torch.float64)])
        coord.requires_grad_(True)
        data = {"coord": coord, "numbers": torch.cat([torch.tensor(atoms.numbers), torch.zeros(1, dtype=torch.long)]),
                "charge": torch.tensor([float(charge)], dtype=torch.float64),
                "mol_idx": torch.zeros(n + 1, dtype=torch.long), "nbmat": nbmat, "shifts": shifts,
                "nbmat_lr": nbmat_lr, "shifts_lr": shifts_lr, "cell": torch.tensor(atoms.cell[:]),
                "pbc": torch.tensor([True, True, True])}
    with aimnet_in_float64():
        out = net(data)
    forces = -torch.autograd.grad(out["energy"].sum(), coord)[0].reshape(-1, 3)[:n]
    return out["energy"].item(), forces.numpy(), out["charges"].detach().reshape(-1)[:n].numpy()


@pytest.mark.parametrize("charge", [0, 1, -1])
def test_molecules_equal_aimnet_own_forward(charge):
    """Benzene and ethanol, no cell (the Coulomb energy of every pair): energy and forces equal aimnet's own forward
    of the same weights to 1e-12 and 1e-11 (float64)."""
    ours_model, atoms = model(), molecules()
    atoms.info["charge"] = charge
    ours = predict(ours_model, atoms)
    energy, forces, _ = own_forward(ours_model.aimnet, atoms, charge)
    assert abs(ours["energy"] - energy) < 1e-12 * abs(energy), (ours["energy"], energy)
    assert_close(ours["forces"], forces, 1e-11)


@pytest.mark.parametrize("charge", [0, 1])
def test_periodic_box_equals_aimnet_own_ewald(charge):
    """8 waters in a sheared cell: ours (torch-pme's Ewald) against aimnet's own forward with its own Ewald
    (nvalchemiops), both at accuracy 1e-8: energy within 2e-6 eV, forces within 2e-6 eV/Å (measured 3e-7)."""
    ours_model, atoms = model(), water_box()
    atoms.info["charge"] = charge
    ours = predict(ours_model, atoms)
    net = ours_model.aimnet
    net.outputs.lrcoulomb.method, net.outputs.lrcoulomb.ewald_accuracy = "ewald", 1e-8
    try:
        energy, forces, _ = own_forward(net, atoms, charge)
    finally:
        net.outputs.lrcoulomb.method = "simple"
    assert abs(ours["energy"] - energy) < 2e-6, (ours["energy"], energy)
    assert np.abs(ours["forces"] - forces).max() < 2e-6


def test_molecule_against_aimnet_calculator():
    """AIMNet2Calculator (aimnet's own, float32 coordinates) on the same model: energy within 1e-5 relative, forces
    within 1e-4 eV/Å."""
    from aimnet.calculators import AIMNet2Calculator

    ours_model, atoms = model(), molecules()
    atoms.info["charge"] = 1
    ours = predict(ours_model, atoms)
    theirs = AIMNet2Calculator(ours_model.aimnet, device="cpu").eval(
        {"coord": atoms.positions, "numbers": atoms.numbers, "charge": 1.0}, forces=True)
    energy = float(theirs["energy"].detach())
    assert abs(ours["energy"] - energy) < 1e-5 * abs(energy), (ours["energy"], energy)
    assert np.abs(ours["forces"] - theirs["forces"].detach().numpy().reshape(-1, 3)).max() < 1e-4


def test_bad_input_is_named(tmp_path):
    cases = [(lambda: potentials.load_model("aimnet:aimnet3"), "aimnet3: no such file, nor an AIMNet2 config"),
             (lambda: potentials.load_model("aimnet:aimnet2"), "needs long_range"),
             (lambda: potentials.load_model("aimnet:aimnet2_dftd3_wb97m", long_range={}),
              "are not supported yet (a DFTD3 dispersion term")]
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    cases.append((lambda: potentials.load_model(f"aimnet:{tmp_path / 'junk.pt'}", long_range={}),
                  "not an AIMNet2 v2 model file"))
    for make, message in cases:
        with pytest.raises((ModelSpecError, potentials.MLIPError)) as caught:
            make()
        assert message in str(caught.value) and "\n" not in str(caught.value), (message, str(caught.value))
    import mlip_parallel

    with pytest.raises(potentials.MLIPError, match="AIMNet2 runs in layerwise mode only"):
        mlip_parallel.evaluate(model(), water_box(), mode="wide", decompose=True)


def tip3p_clusters(count: int, seed: int = 0) -> list:
    """``count`` clusters of 2–4 rattled waters labelled by ASE's TIP3P (energy and forces)."""
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.calculators.tip3p import TIP3P

    rng, frames = np.random.default_rng(seed), []
    for k in range(count):
        atoms = molecule("H2O")
        for m in range(1, 2 + k % 3):
            water = molecule("H2O")
            water.rotate(rng.uniform(0, 360), rng.normal(size=3))
            water.translate(rng.normal(0.0, 0.3, 3) + [3.0 * m, 0.0, 0.0])
            atoms += water
        atoms.positions += rng.normal(0.0, 0.03, atoms.positions.shape)
        atoms.calc = TIP3P(rc=20.0)
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces)
        frames.append(atoms)
    return frames


LR = 3e-4  # (test_finetune's 3e-3 sends this random model's energies off to 1e11 eV in its first epoch)


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory, mpirun):
    """mlip-train's fine-tuning of the model (float64, Ewald 1e-6) on 9 water clusters labelled by ASE's TIP3P, with
    test_finetune's settings (2 epochs of batches of 3, AdamW, gradient clipping, EMA; the learning rate ``LR``): in
    this process, and data and graph parallel on 3 ranks, in tests/mpi/aimnet_models.py's launch after its distributed
    evaluations. Returns {"root", "rows", "rc", "out"} (the launch's status and output)."""
    import json

    import yaml
    from ase.io import write

    import test_finetune as ft
    from mlip_parallel.train.cli import RULES, SCHEMA, train, validate

    root = tmp_path_factory.mktemp("aimnet-finetune")
    write(root / "train.extxyz", tip3p_clusters(9))
    write(root / "validation.extxyz", tip3p_clusters(3, seed=1))

    def job(directory, **changes):
        return {"data": {"train": str(root / "train.extxyz"), "validation": str(root / "validation.extxyz")},
                "model": {"aimnet": "aimnet2", "weights_seed": 3, "dtype": "float64",
                          "long_range": {"method": "ewald", "accuracy": 1e-6}},
                "loss": {f"{q}_weight": w for q, w in ft.WEIGHTS.items()},
                "optimizer": {"lr": LR, "gradient_clip": ft.CLIP}, "schedule": {"name": "none"},
                "ema_decay": 0.9, "epochs": ft.EPOCHS, "batch_size": ft.BATCH, "seed": ft.SEED,
                "output": {"directory": str(root / directory)}, **changes}

    rows = train(validate(job("one"), SCHEMA, RULES))
    configs = []
    for parallel in ("data", "graph"):
        (root / f"{parallel}.yaml").write_text(yaml.safe_dump(job(parallel, parallel=parallel)))
        configs.append(str(root / f"{parallel}.yaml"))
    (root / "jobs.json").write_text(json.dumps(configs))
    rc, out, _ = mpirun(3, MPI_DIR / "aimnet_models.py", root / "jobs.json")  # (with the distributed evaluations)
    return {"root": root, "rows": rows, "rc": rc, "out": out}


def aimnet_own(net):
    """(aimnet's model, its forward on each structure of a batch of molecules: energies [B], forces [N, 3], zero
    stress), in float64 and training mode, for test_finetune's own_training_losses."""
    net.train()

    def predict(frames):
        energies, forces = [], []
        for atoms in frames:
            coord = torch.tensor(atoms.positions).unsqueeze(0).requires_grad_(True)
            with aimnet_in_float64():
                out = net({"coord": coord, "numbers": torch.tensor(atoms.numbers).unsqueeze(0),
                           "charge": torch.tensor([0.0], dtype=torch.float64)})
            energy = out["energy"].reshape(())
            forces.append(-torch.autograd.grad(energy, coord, create_graph=True)[0][0])
            energies.append(energy)
        return torch.stack(energies), torch.cat(forces), torch.zeros((len(frames), 3, 3), dtype=torch.float64)

    return net, predict


def test_fine_tuning_equals_aimnets_own_training(fine_tuned, monkeypatch):
    """train_loss of both epochs == aimnet's own forward (every pair of each molecule, its own Coulomb) + the
    loss + AdamW over the same batches (test_finetune's oracle), float64, 1e-8 relative; the loss falls."""
    import test_finetune as ft

    model = potentials.load_model("aimnet:aimnet2", dtype="float64", weights_seed=3, long_range={"method": "ewald"})
    monkeypatch.setitem(ft.OWN, "aimnet", lambda path: aimnet_own(model.aimnet))
    monkeypatch.setattr(ft, "LR", LR)
    ours = [row["train_loss"] for row in fine_tuned["rows"]]
    theirs = ft.own_training_losses("aimnet", None, fine_tuned["root"] / "train.extxyz")
    assert len(ours) == ft.EPOCHS and ours[-1] < ours[0], ours
    assert_close(ours, theirs, 1e-8, scale="each", label="train_loss vs aimnet's own")


def test_data_and_graph_parallel_fine_tuning_equal_one_process(fine_tuned):
    """The trained weights data and graph parallel on 3 ranks (graph: the molecules split over the ranks, the charge
    equilibration's and the Coulomb's sums over ranks differentiated twice) equal one process's to 1e-10."""
    from test_finetune import assert_same_weights
    from test_training import trained_parameters

    assert fine_tuned["rc"] == 0 and "aimnet training runs done 2" in fine_tuned["out"], fine_tuned["out"]
    reference = trained_parameters(fine_tuned["root"] / "one")
    for parallel in ("data", "graph"):
        assert_same_weights(trained_parameters(fine_tuned["root"] / parallel), reference, 1e-10, parallel)


def test_fine_tuned_model_is_written_back_in_aimnets_format(fine_tuned):
    """best_aimnet.pt (aimnet's exporter: float32 weights, as its files hold them) loads in aimnet's own load_model
    and AIMNet2Calculator, which give best.pt's energy within 1e-6 relative and forces within 1e-5 eV/Å; and as
    aimnet:FILE here."""
    from aimnet.calculators import AIMNet2Calculator
    from aimnet.models.base import load_model as aimnets_load_model

    out, atoms = fine_tuned["root"] / "one", molecules()
    ours = predict(potentials.load(out / "best.pt"), atoms)
    net, metadata = aimnets_load_model(str(out / "best_aimnet.pt"))
    assert metadata["needs_coulomb"] and metadata["coulomb_mode"] == "sr_embedded", metadata
    theirs = AIMNet2Calculator(net, device="cpu").eval({"coord": atoms.positions, "numbers": atoms.numbers,
                                                         "charge": 0.0}, forces=True)
    assert abs(ours["energy"] - float(theirs["energy"].detach())) < 1e-6 * abs(ours["energy"])
    assert np.abs(ours["forces"] - theirs["forces"].detach().numpy().reshape(-1, 3)).max() < 1e-5
    again = predict(potentials.load_model(f"aimnet:{out / 'best_aimnet.pt'}", dtype="float64",
                                          long_range={"method": "ewald"}), atoms)
    assert abs(ours["energy"] - again["energy"]) < 1e-6 * abs(ours["energy"])


def test_distributed_equals_one_process(fine_tuned):
    """tests/mpi/aimnet_models.py on 3 ranks (the launch the fine-tuning fixture makes)."""
    rc, out = fine_tuned["rc"], fine_tuned["out"]
    assert rc == 0 and "aimnet P=3: 0 failures" in out and "faults caught 6 of 6" in out, out
