"""Fine-tuning other packages' models with mlip-train, measured side by side in one run:

* ``step``: one training step (energy + force + stress loss, backward, AdamW) on a batch of ``--batch``
  64-atom rattled fcc Cu structures labelled by ASE's EMT, ours (``training.batch_gradients``, the step of
  mlip-train in one process: our graph, the package's modules through the adapter, our derivatives) against
  the package's own code path (its batched graph and its model's own forces and stress, the same loss
  and AdamW), alternating, median seconds per step; the ratio ours / theirs (target ≤ 1.1). Models: a
  MACE-MP-0-small-shaped MACE (random weights; 128x0e, max_ell 3, correlation 3, two interactions,
  r_max 6 Å, radial MLP [64, 64, 64], 89 elements; float64, as MACE fine-tunes) and SevenNet-0 (float32,
  as sevenn trains);
* ``data``: ``mlip-train`` with that MACE on ``--structures`` such structures, one process against
  ``parallel: data`` on 2 ranks, alternately, seconds per epoch after the first (target ≥ 1.8×);
* ``graph``: one training step of that MACE (float32) on one structure of ``--cells``³ × 4 atoms (8: 2,048)
  with ``parallel: graph`` on 1 and 2 ranks: each rank's peak resident memory above its resident size
  after start-up, the largest rank's against one process's (target ≤ 0.6), and the seconds of the step;
* ``trainers``: mlip-train against ``mace_run_train --foundation_model`` fine-tuning the same MACE file on the same
  data and settings: CPU seconds per epoch (start-up cancelled) and the validation force MAE of each written model
  through MACECalculator (target: ≤ 0.7× their time per epoch at equal or better error);
* ``sevenn``: the same against ``sevenn train`` (its fine-tuning preset) fine-tuning SevenNet-0: CPU seconds per
  epoch and the validation force MAE through SevenNetCalculator;
* ``lora``: ``model.lora`` (rank 4; MACE, SevenNet-0, the UMA-S shape) against full fine-tuning, one process: the
  training state's bytes (weights, gradients, AdamW's moments) and one step's seconds;
* ``fairchem``: a UMA-S-shaped model (``--uma-channels`` channels, 4 layers, 8 experts, float32, random weights):
  ``step`` against fairchem's own training forward (its HydraModel in training mode on its AtomicData batch, the
  task's denormalisation, the loss, backward, AdamW), then ``data`` and ``graph`` with it (a fairchem training step
  keeps ~7 KB per edge and channel, ~440 KB at 64 channels: ``--cells 4``, 256 atoms, fits this 24 GB host);
* ``fairchem-graph``: ``graph`` with the UMA-S shape at ``--uma-channels`` and fairchem's ``max_neighbors`` at
  ``--uma-max-neighbors`` (16 channels and 30 neighbours: 2,048 atoms fit this host in one process);
* ``stages``: a UMA-M-like model (``--stage-channels`` 128, ``--stage-layers`` 8, ``--stage-experts`` 32: 293 M
  parameters, float32; the parameters dominate) under a per-process memory limit (``--limit-gb``, GiB, set as
  ``ulimit -v`` on every process; the memory pre-flight reads it): mlip-train in one process is refused with one
  line, in 4 pipeline stages (1F1B) it trains; each process's peak above the same runs with a 16-channel model, the
  largest stage's against one process's (run without the limit; target ≤ 0.35).

    python benchmarks/finetune.py [step] [data] [graph] [trainers] [sevenn] [lora] [fairchem] [fairchem-graph]
                                  [stages] [--repeats 5] [--batch 4] [--pairs 2] [--epochs 3] [--structures 16]
                                  [--cells 8] [--uma-channels 64] [--uma-max-neighbors 300] [--stage-channels 128]
                                  [--stage-layers 8] [--stage-experts 32] [--limit-gb 6]
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from common import ROOT, cu_emt_frames, launcher_command, train_command

warnings.filterwarnings("ignore")
sys.path.insert(0, str(ROOT))
WEIGHTS = {"energy": 1.0, "forces": 10.0, "stress": 1.0}


def write_mace_mp0_small(path, dtype) -> None:
    """A MACE with MACE-MP-0 small's hyper-parameters and random weights, saved as MACE saves a model."""
    import torch
    from e3nn import o3

    from potentials.adapters.mace import import_mace

    import_mace()
    from mace import modules

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)
    model = modules.ScaleShiftMACE(
        r_max=6.0, num_bessel=10, num_polynomial_cutoff=5, max_ell=3,
        interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        interaction_cls_first=modules.interaction_classes["RealAgnosticInteractionBlock"], num_interactions=2,
        num_elements=89, hidden_irreps=o3.Irreps("128x0e"), MLP_irreps=o3.Irreps("16x0e"),
        gate=torch.nn.functional.silu, atomic_energies=np.full(89, -3.0), avg_num_neighbors=61.0,
        atomic_numbers=list(range(1, 90)), correlation=3, radial_MLP=[64, 64, 64], atomic_inter_scale=1.0,
        atomic_inter_shift=0.0)
    torch.set_default_dtype(before)
    torch.save(model, path)


def cu64(count):
    """``count`` 64-atom fcc Cu cells (4 x 2 x 2 cubic cells, rattled), with EMT's labels."""
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    from common import cu_crystal

    frames = []
    for k in range(count):
        atoms = cu_crystal((4, 2, 2))
        atoms.rattle(0.1, seed=k)
        atoms.calc = EMT()
        results = dict(energy=atoms.get_potential_energy(), forces=atoms.get_forces(), stress=atoms.get_stress())
        atoms.calc = SinglePointCalculator(atoms, **results)
        frames.append(atoms)
    return frames


def loss(energy, forces, stress, frames):
    """mlip-train's loss of a batch (energy per atom, force components, stress components: MSEs)."""
    import torch
    from ase.stress import voigt_6_to_full_3x3_stress

    atoms = torch.tensor([len(a) for a in frames], dtype=energy.dtype)
    e = torch.tensor([a.get_potential_energy() for a in frames], dtype=energy.dtype)
    f = torch.tensor(np.concatenate([a.get_forces() for a in frames]), dtype=forces.dtype)
    s = torch.tensor(np.array([voigt_6_to_full_3x3_stress(a.get_stress()) for a in frames]), dtype=stress.dtype)
    return (WEIGHTS["energy"] * (((energy - e) / atoms) ** 2).mean() + WEIGHTS["forces"] * ((forces - f) ** 2).mean()
            + WEIGHTS["stress"] * ((stress - s) ** 2).mean())


def mace_theirs(path, frames):
    """MACE's own step: its batched graph (precomputed per structure, collated per step), its forward with
    training=True, its forces and stress, the loss, backward, AdamW."""
    import torch
    from mace import data
    from mace.tools import AtomicNumberTable, torch_geometric

    model = torch.load(path, weights_only=False)
    table = AtomicNumberTable(list(range(1, 90)))
    torch.set_default_dtype(model.r_max.dtype)
    graphs = [data.AtomicData.from_config(data.config_from_atoms(a), z_table=table, cutoff=float(model.r_max),
                                          heads=model.heads) for a in frames]
    torch.set_default_dtype(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        batch = torch_geometric.batch.Batch.from_data_list(graphs).to_dict()
        optimizer.zero_grad()
        out = model(batch, training=True, compute_force=True, compute_stress=True)
        loss(out["energy"], out["forces"], out["stress"], frames).backward()
        optimizer.step()

    return step


def sevenn_theirs(frames):
    """sevenn's own step on SevenNet-0: its calculator's graphs (precomputed, batched per step), its model's
    forces and stress in training mode, the loss, backward, AdamW."""
    import sevenn.util
    import torch
    from sevenn.atom_graph_data import AtomGraphData
    from sevenn.train.dataload import unlabeled_atoms_to_graph
    from torch_geometric.data import Batch

    checkpoint = sevenn.util.load_checkpoint("7net-0")
    model = checkpoint.build_model().train()
    model.set_is_batch_data(True)
    graphs = [AtomGraphData.from_numpy_dict(unlabeled_atoms_to_graph(a, checkpoint.config["cutoff"])) for a in frames]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        out = model(Batch.from_data_list(graphs))
        optimizer.zero_grad()
        s = -out["inferred_stress"]  # xx yy zz xy yz zx, ASE's negative
        stress = torch.stack([torch.stack([s[:, 0], s[:, 3], s[:, 5]], -1), torch.stack([s[:, 3], s[:, 1], s[:, 4]], -1),
                              torch.stack([s[:, 5], s[:, 4], s[:, 2]], -1)], 1)
        loss(out["inferred_total_energy"].reshape(-1), out["inferred_force"], stress, frames).backward()
        optimizer.step()

    return step


def ours(spec, frames, dtype, lora=None, **options):
    """mlip-train's one-process step (``training.batch_gradients`` + AdamW) on the adapter of ``spec``; with ``lora``
    ({targets, rank, alpha}: model.lora) only the low-rank updates train. ``step.state_bytes()``: the bytes of the
    weights, their gradients and AdamW's moments after a step."""
    import torch

    import potentials
    from mlip_parallel.train.training import Batch, Counts, LossRule, batch_gradients
    from mlip_parallel.train.structures import Structure
    from potentials.lora import add_lora

    model = potentials.load_model(spec, dtype=dtype, **options).train()
    params = potentials.base.select_weights(model)
    if lora:
        add_lora(model, **lora)
        params = [p for p in model.parameters() if p.requires_grad]
    structures = [Structure(a.numbers, a.positions, a.cell[:], a.pbc, a.get_potential_energy(), a.get_forces(),
                            a.get_stress(voigt=False), f"cu:{k}") for k, a in enumerate(frames)]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step():
        optimizer.zero_grad()
        batch = Batch(structures, model, model.device)
        batch_gradients(model, batch, Counts.of(structures), LossRule(**WEIGHTS), params)
        optimizer.step()

    def state_bytes() -> int:
        tensors = list(model.parameters()) + [p.grad for p in params if p.grad is not None] + \
            [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()]
        return sum(t.numel() * t.element_size() for t in tensors)

    step.state_bytes = state_bytes
    return step


LORA = {"MACE-MP-0-small shape, float64": {"targets": ["interactions.*.linear*.weight",
                                                       "interactions.*.conv_tp_weights.*", "products.*.linear.weight"],
                                           "rank": 4, "alpha": 4.0},
        "SevenNet-0, float32": {"targets": ["*_self_interaction_*.linear.weight", "*.weight_nn.*"], "rank": 4,
                                "alpha": 4.0},
        # fairchem: the experts' stacked weights (an update per expert), the SO(3) linear layers' (per degree) and
        # the scalar MLPs
        "UMA-S shape, float32": {"targets": ["*.so2_conv_*.fc_m0.weights", "*.so2_m_conv.*.fc.weights",
                                             "*.atom_wise.so3_linear_*.weight", "*.scalar_mlp.0.weight"],
                                 "rank": 4, "alpha": 4.0}}


def part_lora(args, work):
    """model.lora against full fine-tuning: the training state (weights, gradients, AdamW moments) and one step's
    median seconds, alternating, in one process."""
    frames, path = step_setup(args, work)
    print(f"LoRA (rank 4) against full fine-tuning: one step on {args.batch} x 64-atom Cu, 1 thread, median of "
          f"{args.repeats}, alternating; the training state's bytes")
    uma = work / "uma-lora.pt"
    write_uma(uma, args.uma_channels, 4, 8)
    for name, (spec, dtype, options) in {"MACE-MP-0-small shape, float64": (f"mace:{path}", "float64", {}),
                                         "SevenNet-0, float32": ("sevennet:7net-0", "float32", {}),
                                         "UMA-S shape, float32": (f"fairchem:{uma}", "float32", {"task": "omat"})
                                         }.items():
        steps = {"full": ours(spec, frames, dtype, **options), "lora": ours(spec, frames, dtype, LORA[name], **options)}
        seconds = alternate(steps, args.repeats)
        size = {k: step.state_bytes() / 2 ** 20 for k, step in steps.items()}
        time_ratio, size_ratio = seconds["lora"] / seconds["full"], size["lora"] / size["full"]
        print(f"  {name}: step {seconds['lora']:.3f} s with LoRA, {seconds['full']:.3f} s full ({time_ratio:.2f}x); "
              f"training state {size['lora']:.1f} MB against {size['full']:.1f} MB ({size_ratio:.2f}x)", flush=True)


def alternate(steps: dict, repeats: int) -> dict:
    """Median seconds of each step function, called in turn ``repeats`` times after one warm-up call each."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def step_setup(args, work):
    """One torch thread, ``--batch`` 64-atom Cu structures and the MACE-MP-0-small-shaped file (float64):
    (frames, path)."""
    import torch

    torch.set_num_threads(1)
    path = work / "mace-mp0-small-f64.model"
    write_mace_mp0_small(path, torch.float64)
    return cu64(args.batch), path


def part_step(args, work):
    frames, path = step_setup(args, work)
    print(f"one training step, {args.batch} x 64-atom Cu, energy + force + stress loss, AdamW, 1 thread; median of "
          f"{args.repeats}, alternating")
    for name, (theirs, spec, dtype) in {
            "MACE-MP-0-small shape, float64": (lambda: mace_theirs(path, frames), f"mace:{path}", "float64"),
            "SevenNet-0, float32": (lambda: sevenn_theirs(frames), "sevennet:7net-0", "float32")}.items():
        seconds = alternate({"ours": ours(spec, frames, dtype), "theirs": theirs()}, args.repeats)
        print(f"  {name}: ours {seconds['ours']:.3f} s, the package's own {seconds['theirs']:.3f} s per step: "
              f"ratio {seconds['ours'] / seconds['theirs']:.2f}", flush=True)


def epoch_seconds(directory) -> list:
    with open(Path(directory) / "metrics.csv") as f:
        return [float(row["seconds"]) for row in csv.DictReader(f)]


def part_data(args, work, model=None, name="MACE-MP-0-small shape (float64)"):
    """``model``: the model section (default: the MACE-MP-0-small-shaped file, float64)."""
    import torch
    import yaml
    from ase.io import write

    if model is None:
        path = work / "mace-mp0-small-f64.model"
        if not path.exists():
            write_mace_mp0_small(path, torch.float64)
        model = {"mace": str(path)}
    write(work / "cu64.extxyz", cu64(args.structures + 2))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    print(f"mlip-train, {name}, {args.structures} training structures of 64 atoms, batch 4, "
          f"{args.epochs} epochs: seconds per epoch after the first")
    for pair in range(args.pairs):
        seconds = {}
        for ranks in (1, 2):
            job = work / f"data{ranks}.yaml"
            directory = work / f"data{ranks}"
            job.write_text(yaml.safe_dump({
                "data": {"train": str(work / "cu64.extxyz"), "validation_fraction": 2 / (args.structures + 2)},
                "model": model, "loss": {f"{q}_weight": w for q, w in WEIGHTS.items()},
                "schedule": {"name": "none"}, "epochs": args.epochs, "batch_size": 4, "parallel": "data",
                "output": {"directory": str(directory), "overwrite": True}}))
            subprocess.run(train_command(ranks, job), env=env, check=True, capture_output=True)
            seconds[ranks] = float(np.mean(epoch_seconds(directory)[1:]))
        print(f"  pair {pair + 1}: one process {seconds[1]:.2f} s, data parallel on 2 ranks {seconds[2]:.2f} s per "
              f"epoch: {seconds[1] / seconds[2]:.2f}x", flush=True)


def write_labelled(path, frames) -> None:
    """``frames`` as extxyz with MACE's label names (REF_energy, REF_forces, REF_stress), which both trainers read."""
    from ase.io import write

    out = []
    for atoms in frames:
        copy = atoms.copy()
        copy.info["REF_energy"] = atoms.get_potential_energy()
        copy.arrays["REF_forces"] = atoms.get_forces()
        copy.info["REF_stress"] = atoms.get_stress(voigt=True)
        out.append(copy)
    write(path, out, format="extxyz")


def cpu_seconds(command, cwd, env) -> float:
    """CPU seconds (user + system) of ``command`` and its children, run to completion in ``cwd``."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(map(str, command[:4]))} ... failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def force_mae(calc, frames) -> float:
    """Force MAE (eV/Å) of the ASE calculator ``calc`` on ``frames`` (EMT's forces)."""
    errors = []
    for atoms in frames:
        copy = atoms.copy()
        copy.calc = calc
        errors.append(np.abs(copy.get_forces() - atoms.get_forces()).ravel())
    return float(np.concatenate(errors).mean())


def mlip_train_cpu(work, name, config, env, written: str) -> tuple:
    """(CPU seconds, OUTPUT/``written``) of one-process ``mlip-train`` on ``config`` (output in ``work``/``name``)."""
    import yaml

    job = work / f"{name}.yaml"
    job.write_text(yaml.safe_dump(dict(config, output={"directory": str(work / name), "overwrite": True,
                                                       "progress": False})))
    return cpu_seconds(train_command(1, job), work, env), work / name / written


def side_by_side(args, package: str, theirs, ours, calculator, frames) -> None:
    """``args.pairs`` times: ``theirs(epochs)`` then ``ours(epochs)`` (each (CPU seconds, written model)) for 1 and
    ``args.epochs`` epochs; prints CPU seconds per epoch (start-up cancels) and each model's force MAE on ``frames``
    through ``calculator(model file)``."""
    for pair in range(args.pairs):
        result = {}
        for name, run in ((package, theirs), ("mlip-train", ours)):
            one, _ = run(1)
            many, model_file = run(args.epochs)
            result[name] = ((many - one) / (args.epochs - 1), force_mae(calculator(model_file), frames))
        (a, fa), (b, fb) = result["mlip-train"], result[package]
        print(f"  pair {pair + 1}: mlip-train {a:.2f} s/epoch, F MAE {fa * 1e3:.1f} meV/A; {package} {b:.2f} "
              f"s/epoch, F MAE {fb * 1e3:.1f} meV/A; time ratio {a / b:.2f}", flush=True)


def part_trainers(args, work):
    """mlip-train against ``mace_run_train --foundation_model`` on the same data and settings: fine-tuning a MACE
    that mace_run_train wrote here (32x0e + 32x1o, correlation 3, two interactions, float32) on EMT-labelled 32-atom
    Cu, 56 training and 14 validation structures, batch 4, lr 0.003, weights 1 / 10 / 1, E0s fitted to the labels
    (``average``; ours ``reference_energies: fit``), no EMA, one thread each. CPU seconds per epoch = (CPU of a ``--epochs`` run − CPU of a 1-epoch run) / (epochs − 1), so
    start-up cancels; the validation force MAE of each written model through MACE's own calculator."""
    from mace.calculators import MACECalculator

    frames = cu_emt_frames(70, 32)
    train, valid = work / "train.extxyz", work / "valid.extxyz"
    write_labelled(train, frames[:56]), write_labelled(valid, frames[56:])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    keys = {"energy": "REF_energy", "forces": "REF_forces", "stress": "REF_stress"}
    mace_train = [sys.executable, "-c", "from mace.cli.run_train import main; main()", "--train_file", str(train),
                  "--valid_file", str(valid), "--E0s", "average", "--energy_key", keys["energy"], "--forces_key",
                  keys["forces"], "--stress_key", keys["stress"], "--device", "cpu", "--default_dtype", "float32",
                  "--seed", "1", "--batch_size", "4", "--valid_batch_size", "4"]
    # the starting model: a MACE that mace_run_train writes in this environment (1 epoch from scratch)
    (work / "start").mkdir(exist_ok=True)
    cpu_seconds(mace_train + ["--name", "start", "--model", "MACE", "--hidden_irreps", "32x0e + 32x1o", "--r_max",
                              "5.0", "--num_interactions", "2", "--correlation", "3", "--max_L", "1",
                              "--max_num_epochs", "1"], work / "start", env)
    start = work / "start" / "start.model"

    def theirs(epochs):
        directory = work / f"mace{epochs}"
        directory.mkdir(exist_ok=True)
        command = mace_train + ["--name", "ft", "--foundation_model", str(start), "--multiheads_finetuning", "False",
                                "--loss", "stress", "--energy_weight", "1", "--forces_weight", "10", "--stress_weight",
                                "1", "--compute_stress", "True", "--lr", "0.003", "--max_num_epochs", str(epochs),
                                "--eval_interval", "1"]
        seconds = cpu_seconds(command, directory, env)
        return seconds, directory / "ft.model"

    def ours(epochs):
        return mlip_train_cpu(work, f"ours{epochs}", {
            "data": {"train": str(train), "validation": str(valid), "keys": keys},
            "model": {"mace": str(start), "reference_energies": "fit"},
            "loss": {f"{q}_weight": w for q, w in WEIGHTS.items()}, "optimizer": {"lr": 0.003}, "ema_decay": 0.0,
            "epochs": epochs, "batch_size": 4, "seed": 1, "training_errors": 0}, env, "best.model")

    print(f"fine-tuning a MACE of mace_run_train (float32) on 56 + 14 EMT Cu structures of 32 atoms, batch 4, one "
          f"thread: CPU seconds per epoch (from runs of 1 and {args.epochs} epochs) and the validation force MAE through "
          f"MACECalculator", flush=True)
    side_by_side(args, "mace_run_train", theirs, ours, lambda path: MACECalculator(
        model_paths=str(path), device="cpu", default_dtype="float32"), frames[56:])


def part_sevenn(args, work):
    """mlip-train against ``sevenn train`` (sevenn's fine-tuning preset) fine-tuning SevenNet-0 on the same data and
    settings: 56 + 14 EMT Cu structures of 32 atoms, float32, batch 4, Adam(W) at lr 3e-4 held constant, the Huber
    loss (delta 0.01) on energy per atom and forces (weights 1 and 1; no stress: the two weigh its units differently),
    SevenNet-0's shift and scale fixed, no EMA, one thread. CPU seconds per epoch as ``trainers``; the validation
    force MAE of each written checkpoint_best.pth through SevenNetCalculator."""
    import yaml
    from ase.io import write
    from sevenn.calculator import SevenNetCalculator

    frames = cu_emt_frames(70, 32)
    train, valid = work / "train7.extxyz", work / "valid7.extxyz"
    write(train, frames[:56]), write(valid, frames[56:])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    preset = yaml.safe_load(subprocess.run([str(Path(sys.executable).parent / "sevenn_preset"), "fine_tune"],
                                           capture_output=True, text=True, check=True).stdout)

    def theirs(epochs):
        directory = work / f"sevenn{epochs}"
        directory.mkdir(exist_ok=True)
        config = dict(preset)
        config["train"] = dict(preset["train"], epoch=epochs, is_train_stress=False, force_loss_weight=1.0,
                               optim_param={"lr": 3e-4}, scheduler="exponentiallr", scheduler_param={"gamma": 1.0},
                               per_epoch=epochs, error_record=[["Energy", "RMSE"], ["Force", "RMSE"],
                                                               ["TotalLoss", "None"]])
        config["data"] = dict(preset["data"], batch_size=4, load_trainset_path=[str(train)],
                              load_validset_path=[str(valid)])
        config["data"].pop("load_testset_path", None)
        (directory / "input.yaml").write_text(yaml.safe_dump(config))
        seconds = cpu_seconds([str(Path(sys.executable).parent / "sevenn"), "train", "input.yaml"], directory, env)
        return seconds, directory / "checkpoint_best.pth"

    def ours(epochs):
        return mlip_train_cpu(work, f"ours7-{epochs}", {
            "data": {"train": str(train), "validation": str(valid)}, "model": {"sevennet": "7net-0"},
            "loss": {"energy_weight": 1.0, "forces_weight": 1.0, "stress_weight": 0.0, "type": "huber",
                     "huber_delta": 0.01},
            "optimizer": {"lr": 3e-4, "gradient_clip": 0.0}, "schedule": {"name": "none"}, "ema_decay": 0.0,
            "epochs": epochs, "batch_size": 4, "seed": 1, "training_errors": 0}, env, "checkpoint_best.pth")

    print(f"fine-tuning SevenNet-0 (float32) on 56 + 14 EMT Cu structures of 32 atoms, batch 4, one thread: CPU "
          f"seconds per epoch (from runs of 1 and {args.epochs} epochs) and the validation force MAE through "
          f"SevenNetCalculator", flush=True)
    side_by_side(args, "sevenn", theirs, ours, lambda path: SevenNetCalculator(model=str(path)), frames[56:])


WORKER = """
import json, resource, sys, time
sys.path.insert(0, {benchmarks!r})
from common import status_mb
from mlip_parallel.config import read_config
from mlip_parallel.train.cli import RULES, SCHEMA, validate
from mlip_parallel.train.trainer import Trainer
trainer = Trainer(validate(read_config({job!r}), SCHEMA, RULES))
start_mb = status_mb("VmRSS")
start = time.perf_counter()
rows = trainer.fit()
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RESULT", json.dumps({{"rank": trainer.procs.rank, "above_start_mb": peak_mb - start_mb, "peak_mb": peak_mb,
                           "seconds": time.perf_counter() - start}}), flush=True)
"""


def part_graph(args, work, model=None, name="the MACE-MP-0-small shape (float32)"):
    """``model``: the model section (default: the MACE-MP-0-small-shaped file, float32)."""
    import torch
    import yaml
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from common import cu_crystal

    if model is None:
        path = work / "mace-mp0-small-f32.model"
        write_mace_mp0_small(path, torch.float32)
        model = {"mace": str(path)}
    big = cu_crystal(args.cells)
    big.rattle(0.1, seed=1)
    big.calc = EMT()
    big.calc = SinglePointCalculator(big, energy=big.get_potential_energy(), forces=big.get_forces(),
                                     stress=big.get_stress())
    write(work / "big.extxyz", [big])
    write(work / "small.extxyz", cu_emt_frames(1, 4))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    results = {}
    for ranks in (1, 2):
        job = work / f"graph{ranks}.yaml"
        job.write_text(yaml.safe_dump({
            "data": {"train": str(work / "big.extxyz"), "validation": str(work / "small.extxyz")},
            "model": model, "loss": {f"{q}_weight": w for q, w in WEIGHTS.items()},
            "schedule": {"name": "none"}, "ema_decay": 0, "epochs": 1, "batch_size": 1, "parallel": "graph",
            "output": {"directory": str(work / f"graph{ranks}"), "overwrite": True}}))
        script = work / "worker.py"
        script.write_text(WORKER.format(benchmarks=str(Path(__file__).parent), job=str(job)))
        command = ([sys.executable] if ranks == 1 else launcher_command(ranks)) + [str(script)]
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
        results[ranks] = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("RESULT")]
    one = results[1][0]
    largest = max(r["above_start_mb"] for r in results[2])
    two = max(r["seconds"] for r in results[2])
    above = " / ".join(f"{r['above_start_mb']:.0f}" for r in results[2])
    peaks = " / ".join(f"{r['peak_mb']:.0f}" for r in results[2])
    print(f"graph parallel, one training step of {name} on {len(big)} Cu atoms "
          f"(energy + force + stress loss): peak resident memory above start-up per rank")
    print(f"  one process {one['above_start_mb']:.0f} MB ({one['peak_mb']:.0f} MB peak), {one['seconds']:.1f} s; "
          f"2 ranks {above} MB ({peaks} MB peak), {two:.1f} s")
    print(f"  largest rank / one process: {largest / one['above_start_mb']:.2f}; time one process / 2 ranks: "
          f"{one['seconds'] / two:.2f}", flush=True)


def write_uma(path, channels: int, layers: int, experts: int, max_neighbors: int = 300) -> None:
    """A random UMA-S-shaped model (tests/data/fairchem/make_fixtures.py's: lmax = mmax = 2, experts routed by
    composition, charge, spin and task; cutoff 6 Å) of ``channels`` sphere/hidden/edge channels, ``layers`` layers,
    ``experts`` experts and fairchem's ``max_neighbors``, float32 weights, tasks omat, omol, oc20."""
    sys.path.insert(0, str(ROOT / "tests" / "data" / "fairchem"))
    import make_fixtures as fixtures

    config = {"_target_": "fairchem.core.models.base.HydraModel", "pass_through_head_outputs": True,
              "model_id": "UMA-S-1.1",
              "backbone": fixtures.moe(sphere_channels=channels, hidden_channels=channels, edge_channels=channels,
                                       num_distance_basis=64, num_layers=layers, num_experts=experts, cutoff=6.0,
                                       max_neighbors=max_neighbors),
              "heads": {"energyandforcehead": {
                  "module": "fairchem.core.models.uma.escn_moe.DatasetSpecificMoEWrapper",
                  "head_cls": "fairchem.core.models.uma.escn_md.MLP_EFS_Head",
                  "dataset_mapping": {d: d for d in fixtures.DATASETS}, "head_kwargs": {"wrap_property": False}}}}
    fixtures.write(Path(path).stem, config, fixtures.tasks(fixtures.DATASETS, rmsd=1.0, mean=0.0, seed=4), seed=4,
                   directory=Path(path).parent)


def fairchem_theirs(path, frames):
    """fairchem's own step: its HydraModel (``load_inference_model``, EMA weights, float32) in training mode on a
    batch of its AtomicData (built once; the backbone builds the graph each step), the omat task's outputs
    denormalised as MLIPPredictUnit does, the loss, backward, AdamW."""
    import torch
    from fairchem.core.datasets.atomic_data import AtomicData, atomicdata_list_to_batch

    sys.path.insert(0, str(ROOT / "tests"))
    from systems import fairchem_training_model

    model, outputs = fairchem_training_model(path, "omat", torch.float32)
    data = [AtomicData.from_ase(a, task_name="omat", r_edges=False, radius=model.backbone.cutoff,
                                max_neigh=model.backbone.max_neighbors) for a in frames]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        batch = atomicdata_list_to_batch(data)
        optimizer.zero_grad()
        result = outputs(batch)
        loss(result["energy"].reshape(-1), result["forces"], result["stress"].reshape(-1, 3, 3), frames).backward()
        optimizer.step()

    return step


def part_fairchem(args, work):
    """A UMA-S-shaped model of ``--uma-channels`` channels (4 layers, 8 experts, float32): one step against fairchem's
    own (``step``'s structures), data parallel on 2 ranks against one process (``data``'s), graph parallel memory on
    2,048 atoms (``graph``'s)."""
    import torch

    torch.set_num_threads(1)
    path = work / "uma.pt"
    write_uma(path, args.uma_channels, 4, 8)
    frames = cu64(args.batch)
    name = f"a UMA-S-shaped model ({args.uma_channels} channels, 4 layers, 8 experts, float32)"
    print(f"fairchem: one training step of {name}, {args.batch} x 64-atom Cu, energy + force + stress loss, AdamW, "
          f"1 thread; median of {args.repeats}, alternating")
    seconds = alternate({"ours": ours(f"fairchem:{path}", frames, "float32", task="omat"),
                         "theirs": fairchem_theirs(path, frames)}, args.repeats)
    print(f"  ours {seconds['ours']:.3f} s, fairchem's own {seconds['theirs']:.3f} s per step: ratio "
          f"{seconds['ours'] / seconds['theirs']:.2f}", flush=True)
    model = {"fairchem": str(path), "task": "omat", "dtype": "float32"}
    part_data(args, work, model, name)
    part_graph(args, work, model, name)


def part_fairchem_graph(args, work):
    """``graph`` with a UMA-S-shaped model of ``--uma-channels`` channels (4 layers, 8 experts) and fairchem's
    ``max_neighbors`` cut at ``--uma-max-neighbors``: a fairchem training step keeps ~7 KB per edge and channel, so
    that a 2,048-atom structure fits this 24 GB host in one process at 16 channels and 30 neighbours."""
    path = work / "uma-graph.pt"
    write_uma(path, args.uma_channels, 4, 8, args.uma_max_neighbors)
    part_graph(args, work, {"fairchem": str(path), "task": "omat", "dtype": "float32"},
               f"a UMA-S-shaped model ({args.uma_channels} channels, 4 layers, 8 experts, max_neighbors "
               f"{args.uma_max_neighbors}, float32)")


def stage_run(work, name, model, ranks, limit_gb=None) -> dict:
    """``mlip-train`` with ``model`` on ``ranks`` processes (``parallel: pipeline`` of that many stages, 1F1B, or one
    process), every process under an address-space limit of ``limit_gb`` (``ulimit -v``; the memory pre-flight reads
    it); 4-atom Cu structures, batch 2, 2 micro-batches, AdamW + EMA, E+F+S, 1 epoch. {"peaks": each process's
    VmHWM in MB (rank 0 first), "tensor_mb": the tensors each holds at the end, "error": the run's last line of
    standard error when it failed}."""
    from pipeline_memory import train_run

    stem = work / f"{name}.S{ranks}"
    run = train_run({
        "data": {"train": str(work / "cu4.extxyz"), "validation_fraction": 0.25}, "model": model,
        "loss": {f"{q}_weight": w for q, w in WEIGHTS.items()}, "optimizer": {"lr": 1e-4}, "ema_decay": 0.99,
        "epochs": 1, "batch_size": 2, "seed": 0, "parallel": "pipeline" if ranks > 1 else "data",
        "pipeline": {"stages": ranks, "microbatches": 2, "schedule": "1f1b"},
        "output": {"directory": str(stem) + "_out", "overwrite": True}}, stem, ranks, limit_gb)
    records = run["ranks"]
    return {"peaks": [r["hwm_mb"] for r in records], "vm_peaks": [r.get("vm_peak_mb") for r in records],
            "tensor_mb": [r.get("tensor_mb") for r in records], "error": run["error"]}


def part_stages(args, work):
    """A UMA-M-like model (many experts: the parameters dominate) whose training state does not fit a per-process
    memory limit: refused by the pre-flight in one process under the limit, trained in 4 pipeline stages under the
    same limit; each process's peak above the same run with a 16-channel model (what a process holds whatever the
    model), the largest stage against one process's (run without the limit)."""
    from ase.io import write

    from common import cu_emt_frames

    write(work / "cu4.extxyz", cu_emt_frames(8, 4), format="extxyz")
    shape = f"{args.stage_channels} channels, {args.stage_layers} layers, {args.stage_experts} experts"
    models = {}
    for channels in (args.stage_channels, 16):
        path = work / f"uma-m-like-{channels}.pt"
        write_uma(path, channels, args.stage_layers, args.stage_experts)
        models[channels] = {"fairchem": str(path), "task": "omat", "dtype": "float32"}
    import torch

    parameters = sum(t.numel() for t in torch.load(work / f"uma-m-like-{args.stage_channels}.pt",
                                                     weights_only=False, mmap=True).model_state_dict.values())
    limit = args.limit_gb
    print(f"fairchem, a UMA-M-like model ({shape}, {parameters / 1e6:.0f} M parameters, float32: weights "
          f"{parameters * 4 / 1e9:.2f} GB, training state with gradients, AdamW's moments and the EMA "
          f"{5 * parameters * 4 / 1e9:.2f} GB), mlip-train on 6 x 4-atom Cu, batch 2, 1 epoch; every process under "
          f"ulimit -v {limit:g} GiB")
    refused = stage_run(work, "limited", models[args.stage_channels], 1, limit)
    print(f"  one process under the limit: {refused['error'] or 'trained (not refused)'}")
    staged = stage_run(work, "limited", models[args.stage_channels], 4, limit)
    print(f"  4 pipeline stages under the limit: {staged['error'] or 'trained'}")
    one, tiny1 = stage_run(work, "big", models[args.stage_channels], 1), stage_run(work, "tiny", models[16], 1)
    tiny4 = stage_run(work, "tiny", models[16], 4)
    for run in (one, tiny1, tiny4):
        if run["error"]:
            print(f"  (a reference run failed: {run['error']})")
            return
    if staged["error"]:
        return
    above1 = one["peaks"][0] - tiny1["peaks"][0]
    above4 = [b - t for b, t in zip(staged["peaks"], tiny4["peaks"])]
    print(f"  peak MB above the same run with 16 channels: one process (no limit) {above1:.0f}; 4 stages "
          f"{', '.join(f'{a:.0f}' for a in above4)} (rank 0 first): largest / one process {max(above4) / above1:.2f}")
    print(f"  torch tensors held at the end: one process {one['tensor_mb'][0]:.0f} MB; 4 stages "
          f"{', '.join(f'{t:.0f}' for t in staged['tensor_mb'])} MB", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ["step", "data", "graph", "trainers", "sevenn", "lora", "fairchem", "fairchem-graph", "stages"]
    parser.add_argument("parts", nargs="*", default=parts, choices=parts)
    parser.add_argument("--uma-channels", type=int, default=64)
    parser.add_argument("--uma-max-neighbors", type=int, default=300)
    parser.add_argument("--stage-channels", type=int, default=128)
    parser.add_argument("--stage-layers", type=int, default=8)
    parser.add_argument("--stage-experts", type=int, default=32)
    parser.add_argument("--limit-gb", type=float, default=6.0, help="stages: each process's address-space limit, GiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--structures", type=int, default=16)
    parser.add_argument("--cells", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts:
            {"step": part_step, "data": part_data, "graph": part_graph, "trainers": part_trainers,
             "sevenn": part_sevenn, "lora": part_lora, "fairchem": part_fairchem,
             "fairchem-graph": part_fairchem_graph, "stages": part_stages}[part](args, Path(tmp))


if __name__ == "__main__":
    main()
