"""mlip-train fine-tunes the models other packages train — MACE, the nequip framework's NequIP and Allegro,
SevenNet — through their own modules, and writes them back in their own formats.

The oracle of each family is the package's own code path: its model called as its calculator calls it
(MACE: ``model(batch, training=True, compute_force=True, compute_stress=True)`` on MACE's own graph;
nequip: the framework's model with its force/stress output on its calculator's data; SevenNet: sevenn's
model on its calculator's graph), the loss written out here, and torch's AdamW over the same batches:
the same ``train_loss`` every epoch (float64). Data and graph parallel on 2 ranks (torchrun) and 3 ranks
(mpiexec) equal one process in the trained weights; the written files load in the packages' own
calculators and equal our evaluation; resume is exact; freeze, refit and bad input are tested.

Models: a small MACE written here under this environment's e3nn (``systems.write_small_mace``), the
nequip-framework fixtures (tests/data/nequip), a small SevenNet (``systems.write_small_sevennet``), and
MACE's multi-head fixture written under e3nn 0.4.4. Data: Cu/Ag structures labelled by ASE's EMT, among
them triclinic cells and a pair of clusters with empty space between them (a rank of the 3 owns no atom).
"""
import functools
import json
import re
import warnings

import numpy as np
import pytest
import torch
import yaml
from ase.io import read, write
from ase.stress import voigt_6_to_full_3x3_stress

import potentials
from comparison import assert_beyond, assert_close
from conftest import MPI_DIR, missing as missing_modules, needs as needs_modules
from mlip_parallel.train.cli import RULES, SCHEMA, main, train, validate
from potentials.exchange import default_dtype
from test_training import trained_parameters  # (last.pt's state, or the pipeline stages' shards)
from systems import (ALLEGRO_PRUNED, FAIRCHEM_DIR, FAIRCHEM_FIXTURES, MACE_DIR, NEQUIP_DIR, allegro_architecture,
                     fairchem_reference, fairchem_training_model, labelled_alloys, write_framework_model,
                     write_small_mace, write_small_sevennet)

# the packages' own warnings (deprecations in their code) are not this suite's to read
pytestmark = [pytest.mark.filterwarnings("ignore:::(mace|e3nn|nequip|allegro|sevenn|lightning|torch_geometric|fairchem)"),
              pytest.mark.slow]  # (training other packages' models: left out of the quick tier)

SEED, EPOCHS, BATCH, LR, CLIP = 1, 2, 3, 0.003, 1.0
FAIRCHEM = ("esen", "uma-moe", "uma-dense")  # tests/data/fairchem's checkpoints, run with systems.FAIRCHEM_FIXTURES
# The omol fixture trains on structures with their own total charge and spin multiplicity (atoms.info; the others
# at the run's model.charge and model.spin): {structure: (charge, spin)}, None where the structure has none
CHARGED = ("uma-dense",)
CHARGES = {1: (0, 2), 2: (1, 3), 4: (-1, None), 5: (2, 1), 7: (None, 3), 8: (-1, 2)}
FAMILIES = ("mace", "nequip", "allegro", "sevennet") + FAIRCHEM
PARALLEL = tuple(f for f in FAMILIES if f != "esen")  # (eSEN's code is UMA's without experts: UMA's runs cover it)
# data parallel wraps any model alike (each rank its share of the batch, the gradients summed): one family runs it;
# graph parallel (the halo inside each family's own layers, differentiated twice) runs every family on 3 ranks
# (mpiexec: an odd grid, a rank without atoms), and that one family also on 2 under torchrun (the backend)
DATA_PARALLEL = ("mace",)
PACKAGES = {"mace": ("mace",), "nequip": ("nequip",), "allegro": ("nequip", "allegro"), "sevennet": ("sevenn",),
            "mace3": ("mace",), "mace-lora": ("mace",), "allegro3": ("nequip", "allegro"),
            **{name: ("fairchem",) for name in FAIRCHEM}}  # the modules each family's tests need


def installed(family: str) -> bool:
    return not missing_modules(*PACKAGES[family])


def needs(family: str):
    """A test of ``family`` alone needs its package (``conftest.needs``: the other families still run)."""
    return needs_modules(*PACKAGES[family])


def each_family(families=FAMILIES):
    return [pytest.param(family, marks=needs(family)) for family in families]


@pytest.fixture(autouse=True)
def keep_environment(mace_environment):
    """MACE's own code (its calculator, its training, in some of these tests) in the environment it expects, put back
    after (conftest's mace_environment)"""
WEIGHTS = {"energy": 1.0, "forces": 10.0, "stress": 1.0}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Training and validation data and the starting model of each family: {"train", "validation", family: spec}."""
    root = tmp_path_factory.mktemp("finetune")
    write(root / "train.extxyz", labelled_alloys(9, seed=0))
    write(root / "validation.extxyz", labelled_alloys(3, seed=1))
    charged = labelled_alloys(9, seed=0)  # train.extxyz's structures, most with their own charge and spin
    for k, (charge, spin) in CHARGES.items():
        charged[k].info.update({key: v for key, v in (("charge", charge), ("spin", spin)) if v is not None})
    write(root / "charged.extxyz", charged)
    if installed("mace"):
        write_small_mace(root / "small.model")
        write_small_mace(root / "small3.model", seed=3, interactions=3)  # three blocks: three pipeline stages
    if installed("sevennet"):
        write_small_sevennet(root / "small-sevennet.pth")
    if installed("allegro3"):  # three layers, edges pruned by type pair, ZBL: three stages
        write_framework_model(root / "allegro3.ckpt", allegro_architecture(**ALLEGRO_PRUNED))
    return {"root": root, "train": root / "train.extxyz", "validation": root / "validation.extxyz",
            "charged": root / "charged.extxyz",
            "mace": ("mace", root / "small.model"), "mace3": ("mace", root / "small3.model"), "nequip": ("nequip", NEQUIP_DIR / "nequip-zbl.ckpt"),
            "allegro": ("nequip", NEQUIP_DIR / "allegro.nequip.zip"), "allegro3": ("nequip", root / "allegro3.ckpt"),
            "sevennet": ("sevennet", root / "small-sevennet.pth"),
            **{name: ("fairchem", FAIRCHEM_DIR / f"{name}.pt") for name in FAIRCHEM}}


def training_file(files, family):
    """The training structures of ``family``: those with their own charges and spins for the omol fixture."""
    return files["charged" if family in CHARGED else "train"]


def job(files, family, directory, **changes) -> dict:
    key, path = files[family]
    config = {"data": {"train": str(training_file(files, family)), "validation": str(files["validation"])},
              "model": {key: str(path), "dtype": "float64", **FAIRCHEM_FIXTURES.get(family, {})},
              "loss": {f"{q}_weight": w for q, w in WEIGHTS.items()},
              "optimizer": {"lr": LR, "gradient_clip": CLIP}, "schedule": {"name": "none"}, "ema_decay": 0.9,
              "epochs": EPOCHS, "batch_size": BATCH, "seed": SEED, "output": {"directory": str(directory)}}
    for key, value in changes.items():
        config[key] = dict(config[key], **value) if isinstance(value, dict) and key in config else value
    return config


@pytest.fixture(scope="module")
def one_process(files):
    """Each family trained in this process: {family: (output directory, metric rows)}."""
    runs = {}
    for family in filter(installed, FAMILIES):
        directory = files["root"] / f"one-{family}"
        runs[family] = directory, train(validate(job(files, family, directory), SCHEMA, RULES))
    return runs


def assert_same_weights(weights, reference, tolerance, what) -> None:
    assert set(weights) == set(reference), (what, set(weights) ^ set(reference))
    floating = [key for key, value in reference.items() if value.numel() and value.is_floating_point()]
    for key in set(reference) - set(floating):
        assert torch.equal(weights[key], reference[key]), (what, key)
    assert_close({key: weights[key] for key in floating}, {key: reference[key] for key in floating}, tolerance,
                 label=str(what))


# ------------------------------------------------------------------ the packages' own code paths
def mace_own(path):
    """MACE's model (``torch.load``, as MACE loads it) and its forward on MACE's own batched graph."""
    from potentials.adapters.mace import import_mace

    import_mace()
    from mace import data
    from mace.tools import AtomicNumberTable, torch_geometric

    model = torch.load(path, weights_only=False)

    def predict(frames):
        graphs = [data.AtomicData.from_config(data.config_from_atoms(a), z_table=AtomicNumberTable([29, 47]),
                                              cutoff=float(model.r_max), heads=model.heads) for a in frames]
        batch = next(iter(torch_geometric.dataloader.DataLoader(graphs, batch_size=len(graphs)))).to_dict()
        out = model(batch, training=True, compute_force=True, compute_stress=True)
        return out["energy"], out["forces"], out["stress"]

    return model, predict


def nequip_calculator(path):
    """The framework's ASE calculator for ``path``; the global state its loading sets (e3nn's code generation
    settings, the default dtype, seeds) put back afterwards, as potentials.NequIPFramework does."""
    from nequip.integrations.ase import NequIPCalculator

    from potentials.adapters.nequip import process_state_kept

    with process_state_kept():
        return NequIPCalculator._from_saved_model(str(path), device="cpu", chemical_species_to_atom_type_map=True)


def nequip_own(path):
    """The framework's model with its force/stress output (as its ASE calculator loads it), in training mode,
    on a batch of its calculator's data."""
    from nequip.data import AtomicDataDict

    calc = nequip_calculator(path)
    model = calc.model.train()

    def predict(frames):
        batch = AtomicDataDict.batched_from_list([calc.atoms_to_data(a.copy()) for a in frames])  # (no labels)
        out = model(batch)
        return (out[AtomicDataDict.TOTAL_ENERGY_KEY].reshape(-1), out[AtomicDataDict.FORCE_KEY],
                out[AtomicDataDict.STRESS_KEY].reshape(-1, 3, 3))

    return model, predict


def sevenn_own(path):
    """sevenn's model built from its checkpoint by sevenn, on a batch of its calculator's graphs, in float64
    (its one-hot output cast to float64, as our adapter casts it)."""
    import sevenn.util
    from sevenn.atom_graph_data import AtomGraphData
    from sevenn.train.dataload import unlabeled_atoms_to_graph
    from sevenn.util import dtype_correct
    from torch_geometric.data import Batch

    checkpoint = sevenn.util.load_checkpoint(str(path))
    model = checkpoint.build_model().double().train()
    model.load_state_dict(checkpoint.model_state_dict)  # (built in float32: float64 weights were rounded)
    model.set_is_batch_data(True)

    def as_float64(module, inputs, data):
        for key in list(data.keys()):
            if torch.is_tensor(data[key]) and data[key].dtype == torch.float32:
                data[key] = data[key].double()

    model._modules["onehot_idx_to_onehot"].register_forward_hook(as_float64)
    cutoff = checkpoint.config["cutoff"]

    def predict(frames):
        # sevenn's graphs, converted as AtomGraphData.from_numpy_dict does but to float64, not float32
        batch = Batch.from_data_list([AtomGraphData(**{
            k: torch.as_tensor(v, dtype=torch.float64) if k == "cell_shift" else dtype_correct(v, torch.float64)
            for k, v in unlabeled_atoms_to_graph(a, cutoff).items()}) for a in frames])
        out = model(batch)
        s = -out["inferred_stress"]  # sevenn's order xx yy zz xy yz zx, the negative of ASE's stress
        stress = torch.stack([torch.stack([s[:, 0], s[:, 3], s[:, 5]], -1), torch.stack([s[:, 3], s[:, 1], s[:, 4]], -1),
                              torch.stack([s[:, 5], s[:, 4], s[:, 2]], -1)], 1)
        return out["inferred_total_energy"].reshape(-1), out["inferred_force"], stress

    return model, predict


def fairchem_own(path, task, charge=None, spin=None):
    """fairchem's HydraModel built by fairchem from the checkpoint with its EMA weights (``load_inference_model``,
    as ``load_predict_unit`` builds it, in float64) in training mode, on a batch of fairchem's own AtomicData (its
    charge and spin read from atoms.info, ``charge`` and ``spin`` where a structure has none; its graph built by the
    backbone); the task's outputs denormalised by
    fairchem's own task normaliser and element references (as ``MLIPPredictUnit`` applies them)."""
    from fairchem.core.datasets.atomic_data import AtomicData, atomicdata_list_to_batch

    model, outputs = fairchem_training_model(path, task)
    info = {k: v for k, v in (("charge", charge), ("spin", spin)) if v is not None}

    def predict(frames):
        data = []
        for atoms in frames:
            atoms = atoms.copy()
            atoms.info = {**info, **atoms.info}
            data.append(AtomicData.from_ase(atoms, task_name=task, r_edges=False, radius=model.backbone.cutoff,
                                            max_neigh=model.backbone.max_neighbors, target_dtype=torch.float64,
                                            r_data_keys=["charge", "spin"]))
        batch = atomicdata_list_to_batch(data)
        batch.pos, batch.cell = batch.pos.double(), batch.cell.double()
        result = outputs(batch)
        return result["energy"].reshape(-1), result["forces"], result["stress"].reshape(-1, 3, 3)

    return model, predict


OWN = {"mace": mace_own, "nequip": nequip_own, "allegro": nequip_own, "sevennet": sevenn_own,
       **{name: functools.partial(fairchem_own, **FAIRCHEM_FIXTURES[name]) for name in FAIRCHEM}}


def loss(energy, forces, stress, frames, huber_delta=None):
    """mlip-train's documented loss of one batch: weights × (MSE of the energy per atom, of the force
    components, of the stress components of the periodic structures); with ``huber_delta``, torch's
    ``HuberLoss(delta=huber_delta)`` in place of each mean squared error (loss.type: huber)."""
    if huber_delta is None:
        def mean(x, y):
            return torch.nn.functional.mse_loss(x, y, reduction="mean")
    else:
        mean = torch.nn.HuberLoss(reduction="mean", delta=huber_delta)
    atoms = torch.tensor([len(a) for a in frames], dtype=torch.float64)
    e_ref = torch.tensor([a.get_potential_energy() for a in frames])
    f_ref = torch.tensor(np.concatenate([a.get_forces() for a in frames]))
    periodic = [k for k, a in enumerate(frames) if a.pbc.all()]
    s_ref = torch.tensor(np.array([voigt_6_to_full_3x3_stress(frames[k].get_stress()) for k in periodic]))
    stress_term = mean(stress[periodic], s_ref) if periodic else torch.zeros((), dtype=torch.float64)
    return (WEIGHTS["energy"] * mean(energy / atoms, e_ref / atoms) + WEIGHTS["forces"] * mean(forces, f_ref)
            + WEIGHTS["stress"] * stress_term)


def own_training_losses(family, path, train_file, huber_delta=None, amsgrad=False, lr_factors=None) -> list:
    """The train_loss of each epoch of the package's own forward + this loss + AdamW (gradient clipping as
    mlip-train's), over mlip-train's batches: the structures shuffled by the seed, then each epoch's order."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as the packages' calculators run float64 models
    try:
        model, predict = OWN[family](path)
        frames = read(train_file, ":")
        frames = [frames[k] for k in np.random.default_rng(SEED).permutation(len(frames))]
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": params, "lr": LR}]
        if lr_factors:  # a group per glob over the package's own parameter names (the first glob that matches)
            from fnmatch import fnmatchcase

            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if not any(fnmatchcase(n, g) for g in lr_factors)], "lr": LR}]
            for k, (glob, factor) in enumerate(lr_factors.items()):
                groups.append({"params": [p for n, p in named if fnmatchcase(n, glob) and not any(
                    fnmatchcase(n, g) for g in list(lr_factors)[:k])], "lr": LR * factor})
            assert all(group["params"] for group in groups), [len(g["params"]) for g in groups]
        optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=0.0, amsgrad=amsgrad)
        losses = []
        for epoch in range(EPOCHS):
            order = np.random.default_rng([SEED, epoch]).permutation(len(frames))
            total = []
            for start in range(0, len(order), BATCH):
                batch = [frames[k] for k in order[start:start + BATCH]]
                optimizer.zero_grad()
                value = loss(*predict(batch), batch, huber_delta)
                value.backward()
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                optimizer.step()
                total.append(value.item())
            losses.append(float(np.mean(total)))
    finally:
        torch.set_default_dtype(before)
    return losses


@pytest.mark.parametrize("family", each_family())
def test_one_process_equals_the_packages_own_training(files, one_process, family):
    """train_loss of every epoch == the package's own forward + the loss + AdamW, float64, 1e-8 relative; for the
    omol fixture each structure at its own charge and spin (fairchem's AtomicData reading them from atoms.info) or,
    lacking them, the run's, and at the run's alone the losses differ."""
    directory, rows = one_process[family]
    ours = [row["train_loss"] for row in rows]
    theirs = own_training_losses(family, files[family][1], training_file(files, family))
    assert len(ours) == len(theirs) == EPOCHS and ours[-1] < ours[0], ours
    assert_close(ours, theirs, 1e-8, scale="each", label="train_loss vs the package's own")
    if family in CHARGED:  # each structure's own charge and spin were read: at the run's alone the losses differ
        alike = own_training_losses(family, files[family][1], files["train"])
        assert_beyond(ours, alike, 1e-6, scale="each", label="train_loss vs the run's charge and spin alone")


@needs("nequip")
def test_huber_loss_amsgrad_and_lr_factors_equal_torchs(files):
    """loss.type huber (delta 0.02), optimizer.amsgrad and optimizer.lr_factors (the first interaction fixed at
    factor 0, the readout at 3×): the train_loss of every epoch equals the nequip framework's own forward +
    torch.nn.HuberLoss in place of each mean squared error + torch's AdamW(amsgrad=True) over parameter groups at
    those learning rates, float64, to 1e-8 relative (without the factors, and with the MSE, the losses differ);
    last.pt holds AMSGrad's state."""
    directory, factors = files["root"] / "huber", {"*layer0_convnet*": 0.0, "*readout*": 3.0}
    rows = train(validate(job(files, "nequip", directory, loss={"type": "huber", "huber_delta": 0.02},
                              optimizer={"lr": LR, "gradient_clip": CLIP, "amsgrad": True, "lr_factors": factors}),
                          SCHEMA, RULES))
    ours = [row["train_loss"] for row in rows]
    theirs = own_training_losses("nequip", files["nequip"][1], files["train"], huber_delta=0.02, amsgrad=True,
                                 lr_factors=factors)
    assert_close(ours, theirs, 1e-8, scale="each", label="train_loss vs torch's")
    alike = own_training_losses("nequip", files["nequip"][1], files["train"], huber_delta=0.02, amsgrad=True)
    assert_beyond(ours, alike, 1e-6, scale="each", label="train_loss vs without lr_factors")
    start, end = potentials.NequIPFramework(files["nequip"][1]), potentials.load(directory / "last.pt")
    fixed = dict(start.named_weights())
    for name, weight in end.named_weights():
        moved = not torch.equal(weight.detach().cpu(), fixed[name].detach().cpu())
        assert moved != ("layer0_convnet" in name), name  # factor 0: unchanged (the EMA of a constant)
    state = torch.load(directory / "last.pt", weights_only=True)["training"]["optimizer"]["state"].values()
    assert all((s["max_exp_avg_sq"] >= s["exp_avg_sq"]).all() for s in state)  # AMSGrad's running maximum, kept
    assert any((s["max_exp_avg_sq"] > s["exp_avg_sq"]).any() for s in state)  # and used
    mse = own_training_losses("nequip", files["nequip"][1], files["train"], amsgrad=True)
    assert_beyond(ours, mse, 1e-3, scale="each", label="train_loss vs the MSE's")


# ------------------------------------------------------------------ data, graph and pipeline parallel
# Pipeline runs, by rank count: (family, its pipeline section). A fixed schedule and fixed boundaries where a resumed
# run is compared bit for bit (auto's schedule and cost-balanced boundaries depend on timings, so two runs may
# differ in the last bits). mace3: a three-interaction MACE (its reference energies refit first: under pipeline, by
# the whole model on rank 0); allegro3: a three-layer Allegro with per-edge-type cutoffs and ZBL.
ONE_F_ONE_B = {"stages": 2, "microbatches": 3, "schedule": "1f1b", "boundaries": [0, 1, 2]}
PIPELINES = {2: [("mace-lora", ONE_F_ONE_B), ("sevennet", ONE_F_ONE_B), ("allegro", ONE_F_ONE_B),
                 ("uma-moe", dict(ONE_F_ONE_B, boundaries=[0, 2, 3])),
                 ("uma-dense", {"stages": 2, "microbatches": 3})],
             3: [("mace3", {"stages": 3, "microbatches": 3}),
                 ("nequip", {"stages": 3, "microbatches": 3, "schedule": "1f1b"}),
                 ("allegro3", {"stages": 3, "microbatches": 3, "schedule": "1f1b"}),
                 ("uma-moe", {"stages": 3, "microbatches": 3})]}
# each also stopped after epoch 1 and resumed: MACE (with LoRA's updates), SevenNet (its radial coefficients held by
# both stages), the nequip framework (Allegro) on 3 (a middle stage); fairchem's experts are resumed in one process
RESUMED = ((2, "mace-lora"), (2, "sevennet"), (3, "allegro3"))
LORA = {"lora": {"targets": ["interactions.*.linear.weight", "interactions.*.conv_tp_weights.*"], "rank": 2,
                 "alpha": 4.0}}  # mace-lora: MACE with these updates, one process and 2 stages (and resumed)
REFIT = {"reference_energies": "refit"}


@pytest.fixture(scope="module")
def parallel(files, one_process, mpirun, torchrun):
    """Every installed family trained data and graph parallel on 2 ranks (torchrun: the torch.distributed backend,
    no MPI) and 3 ranks (mpiexec; the clusters leave a rank without atoms), and in the pipeline stages of
    ``PIPELINES`` (``RESUMED`` also stopped after epoch 1 and resumed), all in two launches; the one-process runs
    they are compared with (mace3, allegro3 trained here). Returns {"root", "references": {family: directory}}."""
    from mlip_parallel.domain import Domain
    from mlip_parallel.grid import Grid

    root = files["root"]
    clusters = read(files["train"], 2)
    domain = Domain.from_positions(clusters.positions, clusters.cell, clusters.pbc)
    owners = Grid.for_ranks(3, domain).owner(domain.wrapped_fractional(domain.wrap(clusters.positions)[0]))
    assert sorted(set(owners.tolist())) == [0, 2], owners  # the middle rank of 3 owns none of the clusters' atoms
    references = {family: one_process[family][0] for family in one_process}
    for family, changes in (("mace3", {"model": REFIT}), ("allegro3", {}), ("mace-lora", {"model": LORA})):
        if installed(family):
            references[family] = root / f"one-{family}"
            train(validate(job(files, family.removesuffix("-lora"), references[family], **changes), SCHEMA, RULES))
    for ranks, launcher in ((2, torchrun), (3, mpirun)):
        configs = []
        for family in filter(installed, PARALLEL if ranks == 3 else DATA_PARALLEL):
            for parallel in ("data", "graph") if family in DATA_PARALLEL else ("graph",):
                path = root / f"{ranks}-{family}-{parallel}.yaml"
                streamed = {"data": {"stream": True, "workers": int(parallel == "data")}} if ranks == 3 else {}
                path.write_text(yaml.safe_dump(job(files, family, root / f"{ranks}-{family}-{parallel}",
                                                   parallel=parallel, **streamed)))
                configs.append(str(path))
        for family, pipeline in PIPELINES[ranks]:
            if not installed(family):
                continue
            for name in ("pipeline", "pipeline-resumed")[: 1 + ((ranks, family) in RESUMED)]:
                config = job(files, family.removesuffix("-lora"), root / f"{ranks}-{family}-{name}",
                             parallel="pipeline", pipeline=pipeline,
                             **({"model": {"mace3": REFIT, "mace-lora": LORA}[family]}
                                if family in ("mace3", "mace-lora") else {}),
                             **({"data": {"stream": True}} if ranks == 3 else {}))
                for k, epochs in enumerate([1, EPOCHS] if name == "pipeline-resumed" else [EPOCHS]):
                    path = root / f"{ranks}-{family}-{name}-{k}.yaml"
                    path.write_text(yaml.safe_dump(dict(config, epochs=epochs, resume=k > 0)))
                    configs.append(str(path))
        (root / f"jobs{ranks}.json").write_text(json.dumps(configs))
        rc, out, _ = launcher(ranks, MPI_DIR / "finetune.py", root / f"jobs{ranks}.json")
        assert rc == 0 and f"finetune runs done {len(configs)}" in out, out
        assert f"{ranks} rank(s) x 1 thread(s), graph parallel" in out, out
        assert f"{ranks} rank(s) x 1 thread(s), pipeline parallel, stages at blocks" in out, out
    return {"root": root, "references": references}


@pytest.mark.parametrize("family, strategy, ranks", [
    pytest.param(family, strategy, ranks, marks=needs(family), id=f"{family}-{strategy}-{ranks}")
    for family in PARALLEL for strategy in ("data", "graph") for ranks in (2, 3)
    if family in DATA_PARALLEL or (strategy, ranks) == ("graph", 3)])
def test_data_and_graph_parallel_equal_one_process(parallel, family, strategy, ranks):
    """The trained weights after 2 epochs (6 steps, gradient clipping), graph parallel on 3 ranks (every family;
    mpiexec, a rank without atoms, the data streamed from disk), and data and graph parallel of ``DATA_PARALLEL`` on 2
    (torchrun) and 3 ranks (data parallel read ahead by a worker process per rank there), equal one process's (the
    data held) to 1e-10 relative (float64)."""
    assert_same_weights(trained_parameters(parallel["root"] / f"{ranks}-{family}-{strategy}"),
                        trained_parameters(parallel["references"][family]), 1e-10, (ranks, family, strategy))


@pytest.mark.parametrize("ranks, family", [pytest.param(ranks, family, marks=needs(family), id=f"{family}-{ranks}")
                                           for ranks, cases in PIPELINES.items() for family, _ in cases])
def test_pipeline_stages_equal_one_process(parallel, ranks, family):
    """Each family in pipeline stages, each stage holding only its parts: a three-interaction MACE in 3 (schedule auto,
    reference energies refit; every weight trained) and MACE with LoRA updates in 2 (below), SevenNet in 2 (its radial
    coefficients, read by every block, held by both stages, their gradients summed), the nequip framework's NequIP
    in 3 (1F1B; its type embedding's node attributes travelling beside the features), Allegro in 2 and the
    three-layer Allegro with per-edge-type cutoffs and ZBL in 3 (its per-edge state travelling), fairchem's
    UMA-S-shaped model with experts in 2 (1F1B) and 3 and the UMA-S-1.2-shaped one (max_neighbors, the omol task) in 2
    (schedule auto, cost-balanced boundaries; the node embeddings travelling; the system embeddings and the experts'
    routing held by every stage, each micro-batch's structures routed by their own compositions), MACE with LoRA
    updates (``LORA``) in 2 (each stage adapting its own parts, each weight's A drawn from its name as one process
    draws it): the trained weights (LoRA's: the updates, the fixed originals) equal one process's to 1e-10. The
    3-stage runs stream their data from disk (data.stream), the one-process reference holds it."""
    assert_same_weights(trained_parameters(parallel["root"] / f"{ranks}-{family}-pipeline"),
                        trained_parameters(parallel["references"][family]), 1e-10, (ranks, family, "pipeline"))


@pytest.mark.parametrize("ranks, family", [pytest.param(ranks, family, marks=needs(family), id=f"{family}-{ranks}")
                                           for ranks, family in RESUMED])
def test_resumed_pipeline_equals_the_uninterrupted_one(parallel, ranks, family):
    """A 1F1B pipeline run stopped after its first epoch and resumed ends with the uninterrupted run's weights, bit
    for bit."""
    root = parallel["root"]
    assert_same_weights(trained_parameters(root / f"{ranks}-{family}-pipeline-resumed"),
                        trained_parameters(root / f"{ranks}-{family}-pipeline"), 0.0, (family, "resumed"))


@pytest.mark.parametrize("run", [pytest.param("3-mace3", marks=needs("mace")),
                                 pytest.param("2-mace-lora", marks=needs("mace")),
                                 pytest.param("2-sevennet", marks=needs("sevennet")),
                                 pytest.param("3-nequip", marks=needs("nequip")),
                                 pytest.param("2-allegro", marks=needs("allegro")),
                                 pytest.param("3-allegro3", marks=needs("allegro3")),
                                 pytest.param("3-uma-moe", marks=needs("uma-moe"))])
def test_files_assembled_from_the_stages_load_in_the_packages_own_code(files, parallel, run):
    """The files in the packages' formats, assembled from the pipeline stages (best.model, checkpoint_best.pth,
    best.ckpt), equal our evaluation of best.pt in MACECalculator (a three-interaction MACE from 3 stages, its
    reference energies refit), sevenn's own model and NequIPCalculator to 1e-9 (float64); the MACE trained with LoRA
    updates in 2 stages writes them added into its weights."""
    directory = parallel["root"] / f"{run}-pipeline"
    atoms = read(files["validation"], 0 if run == "3-mace3" else 1)
    ours = ours_on(potentials.load(directory / "best.pt"), atoms)
    theirs = packages_own(run.split("-", 1)[1].removesuffix("-lora").removesuffix("3"), directory, atoms)
    assert_close(ours, theirs, 1e-9, label=run)


def packages_own(family: str, directory, atoms) -> dict:
    """Energy, forces and stress of the package's own file that mlip-train wrote in ``directory`` (best.model,
    checkpoint_best.pth, else best.ckpt), through the package's own code, float64: MACECalculator, sevenn's own
    model, the nequip framework's NequIPCalculator; inference_ckpt.pt through FAIRChemCalculator."""
    atoms = atoms.copy()
    if family in FAIRCHEM:
        return fairchem_reference(family, atoms, path=directory / "inference_ckpt.pt")
    if family == "mace":
        from mace.calculators import MACECalculator

        atoms.calc = MACECalculator(model_paths=str(directory / "best.model"), device="cpu", default_dtype="float64")
        theirs = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
        torch.set_default_dtype(torch.float32)  # (MACE's calculator sets it for the process)
        return theirs
    if family == "sevennet":
        energy, forces, stress = sevenn_own(directory / "checkpoint_best.pth")[1]([atoms])
        return {"energy": energy.item(), "forces": forces.detach().numpy(), "stress": ase_voigt(stress[0])}
    atoms.calc = nequip_calculator(directory / "best.ckpt")
    with default_dtype(torch.float64):  # (the framework's calculator runs in its global dtype, float64)
        return {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}


def ase_voigt(stress: torch.Tensor) -> np.ndarray:
    """A [3, 3] stress tensor (ASE's sign, as ``sevenn_own`` returns it) in ASE's Voigt order xx yy zz yz xz xy."""
    return stress.detach().numpy()[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]


# ------------------------------------------------------------------ the files written back
def ours_on(model, atoms) -> dict:
    result = potentials.predict(model, atoms)
    result.pop("energies")
    return result


@pytest.mark.parametrize("family", each_family())
def test_written_file_loads_in_the_packages_own_calculator(files, one_process, family):
    """best.model / best.ckpt / checkpoint_best.pth, loaded by MACECalculator / the framework's
    NequIPCalculator / sevenn's own model builder (float64), equal our evaluation of best.pt to 1e-9 on a
    structure outside the training set; SevenNetCalculator (float32 only) to 1e-5. Our loaders read them
    too, without running a pickle where the package allows it (MACE); ``nequip-package build`` packages
    best.ckpt; mlip-train eval scores best.pt."""
    directory = one_process[family][0]
    best = potentials.load(directory / "best.pt")
    assert main(["eval", str(directory / "best.pt"), str(files["validation"])]) == 0
    atoms = labelled_alloys(2, seed=7)[1]  # the triclinic cell
    atoms.calc = None
    ours = ours_on(best, atoms)
    if family == "mace":
        from mace.calculators import MACECalculator

        native = directory / "best.model"
        calc = MACECalculator(model_paths=str(native), device="cpu", default_dtype="float64")
        torch.set_default_dtype(torch.float32)  # (MACE's calculator sets it for the process)
        assert_close(ours_on(potentials.MACE(native), atoms), ours, 1e-12, label="potentials.MACE(best.model)")
        with pytest.raises(potentials.CheckpointError, match="a MACE model file, not a potentials checkpoint"):
            potentials.load(native)
    elif family in ("nequip", "allegro"):
        native = directory / "best.ckpt"
        calc = nequip_calculator(native)
        assert_close(ours_on(potentials.NequIPFramework(native), atoms), ours, 1e-12, label="best.ckpt")
        if family == "nequip":  # the framework's packager takes it (an example structure from data.train)
            import subprocess
            import sys
            from pathlib import Path

            packaged = directory / "best.nequip.zip"
            run = subprocess.run([str(Path(sys.executable).parent / "nequip-package"), "build", str(native),
                                  str(packaged)], capture_output=True, text=True)
            assert run.returncode == 0, run.stderr[-2000:]
            assert_close(ours_on(potentials.NequIPFramework(packaged), atoms), ours, 1e-12,
                         label="NequIPFramework(best.nequip.zip)")
    elif family in FAIRCHEM:  # fairchem's load_predict_unit and FAIRChemCalculator, on the fixture's task
        native = directory / "inference_ckpt.pt"
        assert_close(ours_on(potentials.load_model(f"fairchem:{native}", dtype="float64", **FAIRCHEM_FIXTURES[family]),
                             atoms), ours, 1e-12, label="fairchem:inference_ckpt.pt")
        theirs = packages_own(family, directory, atoms)
        assert_close(ours, theirs, 1e-9, label="FAIRChemCalculator")
        start = fairchem_reference(family, atoms)  # (the fixture's own: training changed the predictions)
        assert_beyond(start, theirs, 1e-4, label="the fixture's own vs the trained")
        return
    else:
        from sevenn.calculator import SevenNetCalculator

        native = directory / "checkpoint_best.pth"
        model, predict = sevenn_own(native)
        energy, forces, stress = predict([atoms])
        theirs = {"energy": energy.item(), "forces": forces.detach().numpy(), "stress": ase_voigt(stress[0])}
        assert_close(ours, theirs, 1e-9, label="sevenn's own model")
        calc = SevenNetCalculator(model=str(native))
        single = potentials.load_model(f"sevennet:{native}")
        assert single.dtype == torch.float32
        assert_close(ours_on(single, atoms), ours, 1e-5, label="sevennet:checkpoint_best.pth (float32)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with default_dtype(torch.float64 if family in ("nequip", "allegro") else torch.get_default_dtype()):
            atoms.calc = calc  # (the framework's calculator runs in its global dtype, float64)
            theirs = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    tolerance = 1e-5 if family == "sevennet" else 1e-9
    assert_close(ours, theirs, tolerance, label="the package's own calculator")


LORA_TARGETS = {"mace": ["interactions.*.linear.weight", "interactions.*.conv_tp_weights.*"],
                "nequip": ["*.conv.linear_*.weight", "*.edge_mlp.*"],
                "sevennet": ["*_self_interaction_*.linear.weight", "*.weight_nn.*"],
                # fairchem: its experts' stacked weights (one update per expert), the SO(3) linear layers' (one per
                # degree) and a plain Linear
                "uma-moe": ["*.so2_conv_1.fc_m0.weights", "*.atom_wise.so3_linear_1.weight", "*.scalar_mlp.0.weight"]}


@pytest.mark.parametrize("family", [pytest.param(f, marks=needs(f)) for f in LORA_TARGETS])
def test_lora_trains_its_updates_alone_and_the_merged_file_loads_in_the_packages_own_code(files, family, tmp_path):
    """model.lora (rank 2, alpha 4) on e3nn Linear layers (per-path blocks) and radial MLPs (matrices), fairchem's
    experts and SO(3) linear layers (stacks of matrices) and a Linear, 2 epochs
    (and 1 resumed to 2: equal bit for bit): every weight and buffer of the model stays the starting file's and every
    update trains; last.pt's model is the
    EMA of the adapted model with each update merged, W + (alpha/rank) B A: its predictions equal the adapted model's
    (the starting model, updates added again, the EMA state loaded) to 1e-12; the package's own file (best.model,
    best.ckpt, checkpoint_best.pth, inference_ckpt.pt) loads in the package's own code and equals our evaluation of
    best.pt to 1e-9."""
    from potentials.lora import add_lora

    key, path = files[family]
    # (fairchem built in float64, as the run builds it: its Wigner buffers are computed in the model's dtype)
    options = {**FAIRCHEM_FIXTURES[family], "dtype": "float64"} if family in FAIRCHEM else {}
    settings = {"targets": LORA_TARGETS[family], "rank": 2, "alpha": 4.0}
    directory = tmp_path / family
    train(validate(job(files, family, directory, epochs=2, model={"lora": settings}), SCHEMA, RULES))
    state = torch.load(directory / "last.pt", weights_only=True)["training"]
    cut = tmp_path / f"{family}-resumed"  # 1 epoch, then resumed to 2: the same updates, bit for bit
    train(validate(job(files, family, cut, epochs=1, model={"lora": settings}), SCHEMA, RULES))
    train(validate(job(files, family, cut, epochs=2, model={"lora": settings}, resume=True), SCHEMA, RULES))
    resumed = torch.load(cut / "last.pt", weights_only=True)["training"]
    for part in ("model", "ema"):
        assert all(torch.equal(resumed[part][k], v) for k, v in state[part].items()), part
    start = potentials.load_model(f"{key}:{path}", **options).double().state_dict()
    marker, trained = re.compile(r"\.parametrizations\.(\w+)\."), {}  # (module).parametrizations.(weight).…
    for name, value in state["model"].items():
        found = marker.search(name)
        if found is None:
            assert torch.equal(value, start[name].to(value.dtype)), name  # fixed
        elif name.endswith(".original"):
            assert torch.equal(value, start[f"{name[:found.start()]}.{found.group(1)}"]), name
        elif ".B." in name:  # (a path whose output nothing reads keeps its zero block)
            weight = name[:found.end()]
            trained[weight] = trained.get(weight, False) or bool(value.abs().max() > 0)
    assert trained and all(trained.values()), trained  # each adapted weight's update trained from zero
    atoms = labelled_alloys(2, seed=7)[1]
    atoms.calc = None
    adapted = potentials.load_model(f"{key}:{path}", **options).double()
    add_lora(adapted, **settings)
    adapted.load_state_dict({k.removeprefix("module."): v for k, v in state["ema"].items() if k != "n_averaged"})
    merged_last = potentials.load(directory / "last.pt")
    assert_close(ours_on(merged_last, atoms), ours_on(adapted, atoms), 1e-12, label="merged last.pt vs adapted")
    ours = ours_on(potentials.load(directory / "best.pt"), atoms)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = packages_own(family, directory, atoms)
    assert_close(ours, theirs, 1e-9, label="the package's own file")


@pytest.mark.parametrize("family", each_family(("mace", "nequip", "allegro", "sevennet", "uma-moe")))
def test_resumed_after_the_first_epoch_equals_the_uninterrupted_run(files, one_process, family):
    """A run stopped after epoch 1 and resumed (resume: true, epochs EPOCHS) ends with the uninterrupted run's
    weights, optimizer state, EMA and metrics, bit for bit (nequip with refit reference energies: the
    resumed run rebuilds its per-type shifts before reading its state)."""
    directory = files["root"] / f"resumed-{family}"
    changes = {"model": {"reference_energies": "refit"}} if family == "nequip" else {}
    straight = one_process[family][0]
    if changes:
        straight = files["root"] / f"straight-{family}"
        train(validate(job(files, family, straight, **changes), SCHEMA, RULES))
    train(validate(job(files, family, directory, epochs=1, **changes), SCHEMA, RULES))
    train(validate(job(files, family, directory, resume=True, **changes), SCHEMA, RULES))
    a, b = (torch.load(d / "last.pt", weights_only=True)["training"] for d in (straight, directory))
    for part in ("model", "ema"):
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), (part, key)
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys() and a["optimizer"]["state"]
    for key, state_a in a["optimizer"]["state"].items():
        state_b = b["optimizer"]["state"][key]
        assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    rows = [[line.split(",")[:2] for line in (d / "metrics.csv").read_text().splitlines()] for d in (straight, directory)]
    assert len(rows[0]) == 1 + EPOCHS and rows[0] == rows[1], rows  # the header, then epoch and train_loss of each


@needs("sevennet")
def test_fine_tuned_checkpoint_starts_another_run(files, one_process, tmp_path):
    """model.checkpoint: the best.pt of a fine-tuned SevenNet starts a new run (its architecture rebuilt from the
    checkpoint's JSON, no pickle), which writes a sevenn checkpoint again; its first epoch starts from the
    weights of that best.pt (the trainer's model before the first step holds them, bit for bit)."""
    from mlip_parallel.train.trainer import Trainer

    start = one_process["sevennet"][0] / "best.pt"
    config = job(files, "sevennet", tmp_path / "run", epochs=1, model={"sevennet": None, "checkpoint": str(start)})
    config["model"] = {k: v for k, v in config["model"].items() if v is not None}
    trainer = Trainer(validate(config, SCHEMA, RULES))
    saved = potentials.load(start).state_dict()
    assert isinstance(trainer.model, potentials.SevenNet) and trainer.model.state_dict().keys() == saved.keys()
    assert all(torch.equal(value, saved[key]) for key, value in trainer.model.state_dict().items())
    rows = trainer.fit()
    assert np.isfinite(rows[0]["train_loss"]) and (tmp_path / "run" / "checkpoint_best.pth").exists()
    assert isinstance(potentials.load(tmp_path / "run" / "best.pt"), potentials.SevenNet)


@needs("mace")
def test_freeze_keeps_the_matched_weights(files, capsys):
    """model.freeze: every MACE weight but the readouts' stays as the file has it; the readouts train; the log
    says how many are trained; best.pt and best.model hold the result."""
    directory = files["root"] / "frozen"
    frozen = ["node_embedding.*", "interactions.*", "products.*"]
    train(validate(job(files, "mace", directory, epochs=1, model={"freeze": frozen}), SCHEMA, RULES))
    start = potentials.MACE(files["mace"][1]).mace.state_dict()
    end = potentials.MACE(directory / "best.model").mace.state_dict()
    trained = {k for k in start if not torch.equal(start[k], end[k])}
    assert trained and all(k.startswith("readouts.") for k in trained), sorted(trained)
    readouts = sum(p.numel() for n, p in potentials.MACE(files["mace"][1]).named_weights() if n.startswith("readouts."))
    total = sum(p.numel() for _, p in potentials.MACE(files["mace"][1]).named_weights())
    assert f"{readouts} of {total} parameters trained (model.freeze {frozen})" in capsys.readouterr().out


@needs("nequip")
def test_refit_reference_energies_is_least_squares_of_the_residual(files):
    """model.reference_energies: refit sets each element's reference energy (the nequip model's per-type
    shifts, shared by both types in the file) to the file's plus the least-squares fit of the training set's
    residual (EMT energy − the framework calculator's energy) to the element counts; the log's line shows both."""
    from mlip_parallel.train.trainer import Trainer

    path = files["nequip"][1]
    frames = read(files["train"], ":")
    calc = nequip_calculator(path)
    residual = []
    with default_dtype(torch.float64):  # the framework's global dtype, as its calculator runs
        for atoms in frames:
            energy = atoms.get_potential_energy()
            atoms.calc = calc
            residual.append(energy - atoms.get_potential_energy())
    counts = np.array([[np.sum(a.numbers == 29), np.sum(a.numbers == 47)] for a in frames], dtype=float)
    before = potentials.NequIPFramework(path).reference_energies()
    expected = before + np.linalg.lstsq(counts, np.array(residual), rcond=None)[0]
    trainer = Trainer(validate(job(files, "nequip", files["root"] / "refit", model={"reference_energies": "refit"}),
                               SCHEMA, RULES))
    assert_close(trainer.model.reference_energies(), expected, 1e-10, scale="absolute", label="reference energies")
    assert before[0] == before[1] and expected[0] != expected[1]
    assert f"Cu {expected[0]:.6g} (was {before[0]:.6g}), Ag {expected[1]:.6g}" in trainer.reference_note


@needs("nequip")
def test_fit_reference_energies_is_least_squares_of_the_labels(files):
    """model.reference_energies: fit (MACE's E0s average) sets each element's reference energy to numpy's least
    squares of the training set's energy labels on its element counts, before any training; the log shows both."""
    from mlip_parallel.train.trainer import Trainer

    frames = read(files["train"], ":")
    counts = np.array([[np.sum(a.numbers == 29), np.sum(a.numbers == 47)] for a in frames], dtype=float)
    expected = np.linalg.lstsq(counts, np.array([a.get_potential_energy() for a in frames]), rcond=None)[0]
    before = potentials.NequIPFramework(files["nequip"][1]).reference_energies()
    trainer = Trainer(validate(job(files, "nequip", files["root"] / "fit", model={"reference_energies": "fit"}),
                               SCHEMA, RULES))
    assert_close(trainer.model.reference_energies(), expected, 1e-10, scale="absolute", label="reference energies")
    assert_beyond(expected, before, 1e-3, scale="absolute", label="fitted vs the file's")  # not the file's
    assert f"fitted by least squares to the labels of {len(frames)} training structures" in trainer.reference_note
    assert f"Cu {expected[0]:.6g} (was {before[0]:.6g}), Ag {expected[1]:.6g}" in trainer.reference_note


@needs("mace")
def test_multi_head_mace_written_under_e3nn_044_fine_tunes(files, tmp_path):
    """MACE's two-head fixture (saved under e3nn 0.4.4, as every MACE foundation model): head "pbe" fine-tuned
    for one epoch; its best.model (this environment's e3nn) in MACECalculator with that head equals best.pt."""
    from mace.calculators import MACECalculator

    config = job(files, "mace", tmp_path / "run", epochs=1, model={"mace": str(MACE_DIR / "mace-heads-f64.model"),
                                                                  "head": "pbe"})
    rows = train(validate(config, SCHEMA, RULES))
    assert np.isfinite(rows[0]["train_loss"])
    best = potentials.load(tmp_path / "run" / "best.pt")
    assert best.head == "pbe"
    atoms = labelled_alloys(2, seed=7)[1]
    ours = ours_on(best, atoms)
    atoms.calc = MACECalculator(model_paths=str(tmp_path / "run" / "best.model"), device="cpu",
                                default_dtype="float64", head="pbe")
    theirs = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    torch.set_default_dtype(torch.float32)
    assert_close(ours, theirs, 1e-9, label="MACECalculator(best.model, head pbe)")


# ------------------------------------------------------------------ bad input
@needs("mace")
@needs("allegro")
def test_bad_fine_tuning_input_is_one_line_and_writes_nothing(files, tmp_path, capsys):
    """Each mistake: exit status 2, one line naming it, no output directory."""
    silver_iron = tmp_path / "fe.extxyz"
    frames = labelled_alloys(3, seed=3)
    frames[1].numbers[0] = 26
    write(silver_iron, frames)
    compiled = tmp_path / "model.nequip.pth"
    compiled.write_bytes(b"compiled")
    cases = [
        ({"data": {"train": str(silver_iron)}}, r"fe\.extxyz:1 \(training\): element\(s\) \['Fe'\] not known to MACE; "
                                                r"it knows \['Cu', 'Ag'\]"),
        ({"model": {"freeze": ["readout.*"]}}, r"model.freeze: pattern 'readout.\*' matches none of the MACE's weights; its "
                                               r"parameter groups are .*readouts.0.\*"),
        ({"model": {"nequip": str(compiled), "mace": None}}, r"model.nequip: .*a compiled nequip model .* pass the "
                                                             r"\.nequip\.zip package or the \.ckpt checkpoint"),
        ({"model": {"head": "omat"}}, r"model.mace: .*no head 'omat'; the model's heads are \['Default'\]"),
        ({"model": {"name": "SchNet"}}, r"model.name describes a new model, but model.mace starts from a trained one"),
        ({"parallel": "pipeline", "pipeline": {"stages": 3}, "model": {"nequip": str(NEQUIP_DIR / "allegro.ckpt"),
                                                                       "mace": None}},
         r"pipeline.stages = 3: a stage holds at least one interaction block and the model has 2"),
        ({"model": {"checkpoint": str(files["mace"][1]), "mace": None}},
         r"model.checkpoint: .*a MACE model file, not a potentials checkpoint: name it with the key mace"),
        ({"model": {"reference_energies": "estimated"}}, r"model.reference_energies must be one of \('keep', 'refit', 'fit'\)"),
    ]
    for k, (changes, message) in enumerate(cases):
        output = tmp_path / f"out{k}"
        config = job(files, "mace", output, **changes)
        config["model"] = {key: value for key, value in config["model"].items() if value is not None}
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
        assert main([str(tmp_path / "bad.yaml")]) == 2, changes
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(message, err[0]), (message, err)
        assert not output.exists(), changes


@needs("mace")
@needs("allegro")
@needs("sevennet")
def test_another_packages_file_as_a_checkpoint_is_named(files):
    """A MACE, nequip (.ckpt, .nequip.zip) or SevenNet file, or a "mace:FILE" spec, given where a potentials
    checkpoint is expected: one line that says what it is and which model key reads it (nothing unpickled)."""
    cases = {files["mace"][1]: ("a MACE model file", "mace"),
             NEQUIP_DIR / "nequip-zbl.ckpt": ("a nequip-framework checkpoint", "nequip"),
             NEQUIP_DIR / "allegro.nequip.zip": (r"a nequip-framework package \(\.nequip\.zip\)", "nequip"),
             files["sevennet"][1]: ("a SevenNet checkpoint", "sevennet")}
    for path, (what, key) in cases.items():
        with pytest.raises(potentials.CheckpointError, match=rf"{re.escape(str(path))}: {what}, not a potentials "
                                                             rf"checkpoint: name it with the key {key} "):
            potentials.load(path)
    spec = f"mace:{files['mace'][1]}"
    with pytest.raises(potentials.CheckpointError, match=rf"a mace model spec, not a checkpoint path: .*key mace "
                                                         rf"\(model: \{{mace: {re.escape(str(files['mace'][1]))}\}}\)"):
        potentials.load(spec)


@needs("uma-moe")
def test_bad_fairchem_fine_tuning_input_is_one_line_and_writes_nothing(files, tmp_path, capsys, monkeypatch):
    """fairchem checkpoints mlip-train refuses, each in one line before anything is written: a direct-force model,
    merged experts (fairchem's merge_mole of the fixture for one composition, saved with its config), experts routed
    with dropout, a task without
    a stress output while the loss weighs stress, more pipeline stages than blocks; and fairchem not installed (the
    extra named)."""
    from fairchem.core.datasets.atomic_data import AtomicData, atomicdata_list_to_batch
    from fairchem.core.units.mlip_unit.api.inference import MLIPInferenceCheckpoint
    from fairchem.core.units.mlip_unit.utils import load_inference_model

    saved = torch.load(FAIRCHEM_DIR / "uma-moe.pt", weights_only=False)
    config, tasks = saved.model_config, saved.tasks_config

    def checkpoint(name, model_config=config, tasks_config=tasks, ema=saved.ema_state_dict):
        path = tmp_path / f"{name}.pt"
        torch.save(MLIPInferenceCheckpoint(model_config=model_config, model_state_dict=saved.model_state_dict,
                                           ema_state_dict=ema, tasks_config=tasks_config), path)
        return str(path)

    model = load_inference_model(str(FAIRCHEM_DIR / "uma-moe.pt"), use_ema=True, return_checkpoint=False)
    copper = read(files["train"], 0)
    data = atomicdata_list_to_batch([AtomicData.from_ase(copper, task_name="omat", radius=5.0, max_neigh=300)])
    model.module.backbone = model.module.backbone.merge_MOLE_model(data)
    direct = dict(config, backbone=dict(config["backbone"], direct_forces=True))
    dropout = dict(config, backbone=dict(config["backbone"], moe_dropout=0.1))
    no_stress = [t for t in tasks if not (t["property"] == "stress" and "omat" in t["datasets"])]
    cases = [
        ({"model": {"fairchem": checkpoint("direct", direct)}}, r"model.fairchem: .*direct-force model"),
        ({"model": {"fairchem": checkpoint("merged", ema=model.state_dict())}},
         r"model.fairchem: .*its experts are merged \(backbone.blocks.0.edge_wise.so2_conv_1.fc_m0.weight where the "
         r"config has the experts' weights.*cannot be fine-tuned"),
        ({"model": {"fairchem": checkpoint("dropout", dropout)}},
         r"dropout.pt: its experts are routed with dropout \(moe_dropout 0.1, composition_dropout 0.0\), which "
         r"fine-tuning here does not draw .*: set both to 0"),
        ({"model": {"fairchem": checkpoint("no-stress", tasks_config=no_stress)}},
         r"loss.stress_weight is 1.0, but the fairchem checkpoint's task omat has no stress output \(its outputs: "
         r"energy, forces; .*set loss.stress_weight: 0"),
        ({"parallel": "pipeline", "pipeline": {"stages": 4}},
         r"pipeline.stages = 4: a stage holds at least one interaction block and the model has 3"),
    ]
    for k, (changes, message) in enumerate(cases):
        output = tmp_path / f"out{k}"
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(job(files, "uma-moe", output, **changes)))
        assert main([str(tmp_path / "bad.yaml")]) == 2, changes
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(message, err[0]), (message, err)
        assert not output.exists(), changes
    from importlib.metadata import PackageNotFoundError

    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr("importlib.metadata.version", missing)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(job(files, "uma-moe", tmp_path / "out-missing")))
    assert main([str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"model.fairchem: fairchem models need fairchem-core: pip install -e "
                                       r"\.\[fairchem\]", err[0]), err
    assert not (tmp_path / "out-missing").exists()


@needs("uma-dense")
def test_fairchem_refit_reference_energies_are_written_back(files, tmp_path):
    """model.reference_energies: refit on a fairchem model changes its task's element references of the training
    set's elements by the least squares of the residual (EMT energy − FAIRChemCalculator's, on the element counts),
    the others kept; best.pt rebuilds them, and inference_ckpt.pt's tasks config holds them: FAIRChemCalculator
    on it equals our evaluation of best.pt (1e-9, float64)."""
    from ase.data import atomic_numbers

    from mlip_parallel.train.trainer import Trainer

    frames = read(training_file(files, "uma-dense"), ":")  # (each structure at its own charge and spin)
    residual = [a.get_potential_energy() - fairchem_reference("uma-dense", a, **{
        key: a.info[key] for key in ("charge", "spin") if key in a.info})["energy"] for a in frames]
    counts = np.array([[np.sum(a.numbers == 29), np.sum(a.numbers == 47)] for a in frames], dtype=float)
    before = potentials.FAIRChem(files["uma-dense"][1], dtype=torch.float64,
                                 **FAIRCHEM_FIXTURES["uma-dense"]).reference_energies()
    cu, ag = atomic_numbers["Cu"] - 1, atomic_numbers["Ag"] - 1  # (the species are the elements 1, 2, ...)
    expected = before.copy()
    expected[[cu, ag]] += np.linalg.lstsq(counts, np.array(residual), rcond=None)[0]
    trainer = Trainer(validate(job(files, "uma-dense", tmp_path, epochs=1, model=REFIT), SCHEMA, RULES))
    assert_close(trainer.model.reference_energies(), expected, 1e-10, scale="absolute", label="reference energies")
    assert_beyond(expected, before, 1e-2, scale="absolute", label="refit vs the file's")
    trainer.fit()
    best = potentials.load(tmp_path / "best.pt")
    assert np.array_equal(best.reference_energies(), trainer.model.reference_energies())
    atoms = labelled_alloys(2, seed=7)[1]
    atoms.calc = None
    theirs = fairchem_reference("uma-dense", atoms, path=tmp_path / "inference_ckpt.pt")
    assert_close(ours_on(best, atoms), theirs, 1e-9, label="FAIRChemCalculator(inference_ckpt.pt)")


@needs("uma-moe")
def test_training_state_beyond_a_rank_is_refused_naming_pipeline(files, tmp_path, monkeypatch, capsys):
    """The memory pre-flight counts what training adds to a starting model's weights (a gradient and AdamW's two
    moments per trained weight, the EMA's copy of every weight): with a rank's memory set below that (here for the
    UMA-S-shaped fixture, float64), mlip-train refuses in one line naming the state and the ways out (pipeline
    stages, model.freeze or model.lora) before writing anything; the state's count equals the parameters' bytes."""
    from mlip_parallel.train.trainer import training_state_bytes

    model = potentials.FAIRChem(files["uma-moe"][1], dtype=torch.float64, **FAIRCHEM_FIXTURES["uma-moe"])
    weights = sum(p.numel() for p in model.parameters()) * 8
    trained = [p for _, p in model.named_weights()]
    assert training_state_bytes(model, trained, True) == 3 * sum(p.numel() for p in trained) * 8 + weights
    monkeypatch.setattr("mlip_parallel.preflight.rank_memory", lambda device, ranks: 3.0 * weights)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job(files, "uma-moe", tmp_path / "out")))
    assert main([str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"not enough memory: .* and the weights' training state \(gradients, optimizer "
                                       r"moments, average\) [\d.]+ GB, but a rank has .*parallel: pipeline splits the "
                                       r"weights over stages\), model.freeze or model.lora", err[0]), err
    assert not (tmp_path / "out").exists()


@needs("uma-moe")
def test_fairchem_freeze_matches_fairchems_parameter_names(files, tmp_path):
    """model.freeze over fairchem's own names: with the backbone's blocks frozen, one epoch changes no block weight
    of the UMA-S-shaped fixture (best.pt and inference_ckpt.pt's weights equal the file's EMA weights there) and
    changes the others (the embeddings, the routing, the head)."""
    directory = tmp_path / "run"
    train(validate(job(files, "uma-moe", directory, epochs=1, model={"freeze": ["backbone.blocks.*"]}), SCHEMA, RULES))
    start = dict(potentials.FAIRChem(files["uma-moe"][1], dtype=torch.float64, **FAIRCHEM_FIXTURES["uma-moe"])
                 .named_weights())
    end = dict(potentials.load(directory / "best.pt").named_weights())
    written = torch.load(directory / "inference_ckpt.pt", weights_only=False).model_state_dict
    moved = {name for name in start if not torch.equal(start[name].detach(), end[name].detach())}
    assert moved and not any(name.startswith("backbone.blocks.") for name in moved), sorted(moved)
    assert {"backbone.sphere_embedding.weight", "backbone.routing_mlp.0.weight"} <= moved, sorted(moved)
    assert all(torch.equal(written[name], end[name].detach()) for name in end)
