"""``mlip-train CONFIG.yaml`` trains a potential; ``mlip-train eval MODEL DATA`` prints its errors.

Run it in one process, or under ``mpiexec -n P`` (or torchrun) for data parallelism: every rank
takes a share of each global batch and the gradients are summed with torch.distributed (gloo on CPU,
nccl on GPU), so P ranks follow the single-process trajectory. ``parallel: graph`` instead splits
every structure by space over the ranks (structures too large for one device); ``parallel: pipeline``
splits the model's blocks over stages, each rank building only its stage's parts (models too large
for one device), with data parallelism across pipeline replicas.

Writes OUTPUT/best.pt and OUTPUT/last.pt (potentials checkpoints: ``potentials.load`` reads them;
last.pt also holds the optimizer, schedule and EMA state for an exact ``resume``; in pipeline mode both
are assembled part by part and each stage's state goes to OUTPUT/pipeline/stageS.pt), OUTPUT/metrics.csv
and OUTPUT/learning_curve.png.
"""
from __future__ import annotations

import argparse
import csv
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

from .config import ConfigError, check_output_directory, config_parser, read_config, report_error, validate
from .errors import MLIPError

SCHEMA = {
    "data": {
        "train": (str, None, "training structures: any ASE-readable file with energy/forces/stress (extxyz, ASE db)"),
        "validation": (str, None, "validation file (default: validation_fraction of train)"),
        "test": (str, None, "test file (default: test_fraction of train), evaluated with best.pt at the end"),
        "validation_fraction": (float, 0.1, "share of train held out for validation when no validation file"),
        "test_fraction": (float, 0.0, "share of train held out for the test when no test file"),
    },
    "model": {
        "name": (str, "SchNet", "SchNet, PaiNN or NequIP"),
        "cutoff": (float, 5.0, "cutoff radius, Å"),
        "hyperparameters": (dict, {}, "further constructor arguments, e.g. {features: 64, layers: 3}"),
        "species": (list, None, "element symbols (default: those in the training data)"),
        "dtype": (str, "float32", "float32 or float64"),
        "checkpoint": (str, None, "start from this potentials checkpoint (e.g. an earlier best.pt; any number of "
                                  "pipeline stages): its architecture, species and weights replace the keys above"),
    },
    "loss": {
        "energy_weight": (float, 1.0, "weight of the energy-per-atom MSE (eV²)"),
        "forces_weight": (float, 10.0, "weight of the force-component MSE (eV²/Å²)"),
        "stress_weight": (float, 0.0, "weight of the stress-component MSE (eV²/Å⁶)"),
    },
    "optimizer": {
        "lr": (float, 1e-3, "AdamW learning rate"),
        "weight_decay": (float, 0.0, "AdamW weight decay"),
        "gradient_clip": (float, 10.0, "clip the gradient norm to this (0: no clipping)"),
    },
    "schedule": {
        "name": (str, "plateau", "plateau (reduce on validation loss), cosine, or none"),
        "patience": (int, 10, "plateau: epochs without improvement before reducing"),
        "factor": (float, 0.5, "plateau: learning-rate factor"),
        "min_lr": (float, 1e-5, "plateau/cosine: lowest learning rate"),
    },
    "ema_decay": (float, 0.99, "exponential moving average of the weights (0: none); best.pt/last.pt hold the average"),
    "epochs": (int, 100, "number of epochs"),
    "batch_size": (int, 8, "structures per global batch (split over the ranks in data parallel)"),
    "seed": (int, 0, "seed of the split, the shuffling and the initial weights"),
    "parallel": (str, "data", "data (each rank a share of every batch), graph (each structure split by space) "
                              "or pipeline (the model's blocks split over stages; see pipeline)"),
    "pipeline": {
        "stages": (int, 2, "pipeline: stages per pipeline; ranks = replicas × stages (data parallel across replicas)"),
        "microbatches": (int, 4, "pipeline: micro-batches per global batch and replica"),
        "schedule": (str, "1f1b", "pipeline: gpipe or 1f1b (at most stages micro-batches in flight per stage)"),
        "boundaries": (list, None, "pipeline: block index where each stage starts, plus the end, e.g. [0, 2, 6] "
                                   "(default: balance measured block costs)"),
        "two_bw": (bool, False, "pipeline: PipeDream-2BW one-step-stale weight updates"),
        "recompute": (bool, False, "pipeline: recompute each stage's forward before its backward sweeps"),
    },
    "resume": (bool, False, "continue from OUTPUT/last.pt when it exists (same config; epochs = the new total)"),
    "output": {
        "directory": (str, "train_output", "output directory (refused when it is not empty, unless overwrite or resume)"),
        "overwrite": (bool, False, "write into a non-empty output directory"),
    },
}
CHOICES = {"model.name": ("SchNet", "PaiNN", "NequIP"), "model.dtype": ("float32", "float64"),
           "schedule.name": ("plateau", "cosine", "none"), "parallel": ("data", "graph", "pipeline"),
           "pipeline.schedule": ("gpipe", "1f1b")}
METRIC_COLUMNS = ("epoch", "train_loss", "val_loss", "energy_mae", "energy_rmse", "forces_mae", "forces_rmse",
                  "stress_mae", "stress_rmse", "lr", "seconds")


# ----------------------------------------------------------------------------- processes
class Processes:
    """Rank, size and gradient/metric sums: torch.distributed for data parallel (set up from mpiexec's
    MPI world or torchrun's environment), the mlip_parallel MPI backend for graph parallel."""

    def __init__(self, parallel: str):
        from .backend import get_backend, launched_by_mpiexec

        self.parallel, self.dist = parallel, None
        self.backend = get_backend()
        torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not launched_by_mpiexec()
        self.rank = int(os.environ["RANK"]) if torchrun else self.backend.rank
        self.size = int(os.environ["WORLD_SIZE"]) if torchrun else self.backend.size
        if parallel == "graph" and torchrun:
            raise ConfigError("parallel: graph runs under mpiexec (it uses the MPI halo exchange), not torchrun")
        if parallel == "pipeline" or (parallel == "data" and self.size > 1):
            import torch
            import torch.distributed as dist

            if not dist.is_initialized():
                if torchrun:
                    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
                else:  # rank 0 picks the rendezvous; MPI tells everybody
                    hosts = self.backend.allgather(socket.gethostname())
                    address = None
                    if self.rank == 0:
                        try:
                            address = rendezvous(hosts)
                        except ConfigError as exc:
                            address = str(exc)
                    address = self.backend.bcast(address)
                    if isinstance(address, str):  # raised on every rank alike
                        raise ConfigError(address)
                    host, port = address
                    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                            init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.size)
            self.dist = dist

    def bcast(self, obj):
        """Rank 0's ``obj`` on every rank (a decision rank 0 takes alone, e.g. from its disk)."""
        if self.size == 1:
            return obj
        if self.dist is not None:
            holder = [obj]
            self.dist.broadcast_object_list(holder, src=0)
            return holder[0]
        return self.backend.bcast(obj)

    def allgather(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if self.size == 1:
            return [obj]
        if self.dist is not None:
            out = [None] * self.size
            self.dist.all_gather_object(out, obj)
            return out
        return self.backend.allgather(obj)

    def barrier(self) -> None:
        if self.size > 1:
            self.dist.barrier() if self.dist is not None else self.backend.barrier()

    def sum(self, array: np.ndarray) -> np.ndarray:
        """Element-wise sum over ranks (numpy float64)."""
        if self.size == 1:
            return np.asarray(array, dtype=np.float64)
        if self.dist is not None:
            import torch
            t = torch.as_tensor(np.asarray(array, dtype=np.float64))
            self.dist.all_reduce(t)
            return t.numpy()
        return self.backend.allreduce(np.asarray(array, dtype=np.float64))

    def sum_gradients(self, parameters) -> None:
        """Add every rank's parameter gradients (one flat message)."""
        if self.size == 1:
            return
        import torch

        from .training import sum_gradients

        def reduce(flat):
            if self.dist is not None:
                self.dist.all_reduce(flat)
                return flat
            return torch.as_tensor(self.backend.allreduce(flat.cpu().numpy()), dtype=flat.dtype, device=flat.device)

        sum_gradients(parameters, reduce)


def rendezvous(hosts) -> tuple:
    """(address, free port) of rank 0 that every rank can reach, given every rank's host name: loopback
    when all ranks share rank 0's host; else ``MASTER_ADDR`` if set, or the first non-loopback address of
    rank 0's host name (``gethostbyname`` may answer 127.0.1.1, which other nodes cannot reach)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    if len(set(hosts)) == 1:
        return "127.0.0.1", port
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"], port
    addresses = {info[4][0] for info in socket.getaddrinfo(hosts[0], None, socket.AF_INET)}
    routable = sorted(a for a in addresses if not a.startswith("127."))
    if not routable:
        raise ConfigError(f"rank 0's host {hosts[0]!r} resolves only to loopback addresses {sorted(addresses)}, "
                          "which the other nodes cannot reach: set MASTER_ADDR to an address of rank 0's node")
    return routable[0], port


# ----------------------------------------------------------------------------- training
def model_species(section, structures) -> list:
    """The model's element symbols: model.species, else those in ``structures``."""
    if section["species"] is not None:
        return section["species"]
    from ase.data import chemical_symbols
    return [chemical_symbols[z] for z in sorted({int(z) for s in structures for z in s.numbers})]


def build_model(section, species, seed, parts=None):
    """The configured model (``parts``: only these parts, a pipeline stage's), initialised from
    ``seed`` part by part, or read from ``model.checkpoint``."""
    import torch

    import potentials

    dtype = torch.float64 if section["dtype"] == "float64" else torch.float32
    if section["checkpoint"] is not None:
        try:
            return potentials.load(section["checkpoint"], parts=parts).to(dtype).train()
        except potentials.CheckpointError as exc:
            raise ConfigError(f"model.checkpoint: {exc}") from None
    cls = {"SchNet": potentials.SchNet, "PaiNN": potentials.PaiNN, "NequIP": potentials.NequIP}[section["name"]]
    try:
        model = cls(species=species, cutoff=section["cutoff"], **section["hyperparameters"], parts=parts, seed=seed)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model: cannot build {section['name']}: {exc}") from None
    return model.to(dtype)


def fit_scale_shift(model, structures) -> None:
    """Per-species reference energies by least squares and the force RMS as the energy scale, into the
    model's scale/shift (where it holds the readout)."""
    import torch
    from ase.data import atomic_numbers

    from .training import fit_reference_energies

    labelled = [s for s in structures if s.energy is not None]
    if not labelled or "readout" not in model.parts:
        return
    shift = fit_reference_energies(labelled, [atomic_numbers[x] for x in model.species])
    with_forces = [s.forces for s in structures if s.forces is not None]
    scale = float(np.sqrt(np.mean(np.concatenate(with_forces) ** 2))) if with_forces else 1.0
    model.scale_shift.shift.copy_(torch.as_tensor(shift))
    model.scale_shift.scale.fill_(max(scale, 1e-3))


def load_data(config):
    from .training import check_labels, read_structures, split

    d = config["data"]
    if d["train"] is None:
        raise ConfigError("data.train is required: a file of labelled structures")
    train = read_structures(d["train"])
    fractions = [0.0 if d["validation"] else d["validation_fraction"], 0.0 if d["test"] else d["test_fraction"]]
    if sum(fractions) >= 1:
        raise ConfigError(f"data.validation_fraction + data.test_fraction must be < 1, got {sum(fractions)}")
    train, validation, test = split(train, fractions, config["seed"])
    if d["validation"]:
        validation = read_structures(d["validation"])
    if d["test"]:
        test = read_structures(d["test"])
    if not train or not validation:
        raise ConfigError(f"need at least one training and one validation structure, got {len(train)} and "
                          f"{len(validation)} (set data.validation or a larger data.validation_fraction)")
    weights = {q: config["loss"][f"{q}_weight"] for q in ("energy", "forces", "stress")}
    for part in (train, validation, test):
        check_labels(part, weights)
    return train, validation, test, weights


def pipeline_trainer(config, procs, build, train_set, weights, resume_layout):
    """The ``PipelineTrainer`` of this rank (its stage's model: ``trainer.model``). On resume the stage
    layout of the interrupted run (``resume_layout``) is kept; a different one is refused."""
    from .pipeline import PipelineError, PipelineTrainer

    pc = config["pipeline"]
    boundaries = pc["boundaries"]
    if resume_layout is not None:
        if resume_layout["stages"] != pc["stages"] or boundaries not in (None, resume_layout["boundaries"]):
            raise ConfigError(f"resume: the run in {config['output']['directory']} has {resume_layout['stages']} "
                              f"stages with boundaries {resume_layout['boundaries']}; resume it with the same "
                              "pipeline.stages (and boundaries), or start a new run from its last.pt with "
                              "model.checkpoint")
        boundaries = resume_layout["boundaries"]
    layers = build(frozenset()).layers
    if not 1 <= pc["stages"] <= layers:
        raise ConfigError(f"pipeline.stages = {pc['stages']}: a stage holds at least one interaction block and the "
                          f"model has {layers} (model.hyperparameters.layers)")
    if pc["microbatches"] < 1:
        raise ConfigError(f"pipeline.microbatches must be at least 1, got {pc['microbatches']}")
    if procs.size % pc["stages"]:
        raise ConfigError(f"pipeline.stages = {pc['stages']} must divide the {procs.size} rank(s)")
    sweeps = "energy" if weights["forces"] == 0 and weights["stress"] == 0 else "forces"
    try:
        return PipelineTrainer(build, pc["stages"], pc["microbatches"], pc["schedule"], sweeps, boundaries=boundaries,
                               sample=train_set[:1], two_bw=pc["two_bw"], recompute=pc["recompute"])
    except PipelineError as exc:
        raise ConfigError(f"pipeline: {exc}") from None


def train(config) -> list:
    """Run the validated ``config``; return the metric rows (every rank)."""
    import json

    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    import potentials

    from .training import Batch, Counts, TrainingError, check_species, error_sums, error_table, graph_parallel_loss, \
        loss_terms, nonfinite_structures, predict_batch, total_loss

    directory = Path(config["output"]["directory"])
    if not config["resume"]:
        check_output_directory(directory, config["output"]["overwrite"])
    procs = Processes(config["parallel"])
    root = procs.rank == 0
    train_set, validation, test, weights = load_data(config)
    last_path, shards = directory / "last.pt", directory / "pipeline"
    resume = bool(procs.bcast(config["resume"] and last_path.exists()))  # rank 0's disk decides
    device = torch.device("cuda", procs.rank % torch.cuda.device_count()) if torch.cuda.is_available() else \
        torch.device("cpu")
    species = model_species(config["model"], train_set)

    def build(parts=None):
        return build_model(config["model"], species, config["seed"], parts).to(device)

    pipeline = None
    if procs.parallel == "pipeline":
        layout = None
        if resume:
            layout = procs.bcast(json.loads((shards / "layout.json").read_text()) if root else None)
        pipeline = pipeline_trainer(config, procs, build, train_set, weights, layout)
        model = pipeline.model  # this stage's parts only
        stage = pipeline.stage.stage
    else:
        model = build()
    for part, role in ((train_set, "training"), (validation, "validation"), (test, "test")):
        check_species(model, part, role, error=ConfigError)
    if not resume and config["model"]["checkpoint"] is None:
        fit_scale_shift(model, train_set)
    parameters = [p for p in model.parameters() if p.requires_grad]
    o, sch = config["optimizer"], config["schedule"]
    optimizer = torch.optim.AdamW(parameters, lr=o["lr"], weight_decay=o["weight_decay"])
    if sch["name"] == "plateau":
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=sch["factor"],
                                                               patience=sch["patience"], min_lr=sch["min_lr"])
    elif sch["name"] == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, config["epochs"]),
                                                               eta_min=sch["min_lr"])
    else:
        scheduler = None
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(config["ema_decay"]), use_buffers=True) \
        if config["ema_decay"] > 0 else None
    first_epoch, best, rows = 0, float("inf"), []

    def training_state(epoch):
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "best": best,
                "scheduler": scheduler.state_dict() if scheduler is not None else {},
                "ema": ema.state_dict() if ema is not None else {},
                "pipeline": pipeline.state_dict() if pipeline is not None else {}}

    if resume:  # one process / data / graph: last.pt's training state; pipeline: this stage's shard
        path = shards / f"stage{stage}.pt" if pipeline is not None else last_path
        try:
            payload = torch.load(path, map_location=device, weights_only=True)
        except (OSError, RuntimeError) as exc:
            raise ConfigError(f"resume: cannot read {path}: {exc}") from None
        state = payload["training"]
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if ema is not None:
            ema.load_state_dict(state["ema"])
        if pipeline is not None:
            pipeline.load_state_dict(state["pipeline"])
        first_epoch, best = int(state["epoch"]), float(state["best"])
        with open(directory / "metrics.csv") as f:
            rows = [{k: int(v) if k == "epoch" else float(v) for k, v in r.items()} for r in csv.DictReader(f)]
        rows = rows[:first_epoch]

    def evaluation_model():
        return ema.module if ema is not None else model

    def save(path, epoch):
        """Write ``path`` (collective in pipeline mode: assembled from the stages' parts, and each stage's
        resume shard beside it)."""
        if pipeline is None:
            potentials.save(evaluation_model(), path, extra={"training": training_state(epoch)})
            return
        if pipeline.replica == 0 and path == last_path:
            torch.save({"training": training_state(epoch)}, shards / f"stage{stage}.pt")
        pipeline.save_merged(path, evaluation_model())

    def errors_of(net, structures, when):
        """MAE/RMSE of ``net`` on ``structures``, each rank taking a share (graph parallel: rank 0 alone,
        since evaluation needs no gradient graph and only training is split by space; pipeline: a
        pipelined evaluation, ``net`` being this stage's parts). A non-finite prediction ends training."""
        if pipeline is not None:
            sums = pipeline.error_sums(structures, config["batch_size"], net)
        else:
            share = (structures if root else []) if procs.parallel == "graph" else structures[procs.rank::procs.size]
            sums = procs.sum(error_sums(net, share, config["batch_size"], device))
        bad = [q for k, q in enumerate(("energy", "forces", "stress"))
               if sums[3 * k + 2] > 0 and not np.all(np.isfinite(sums[3 * k: 3 * k + 2]))]
        if bad:
            raise TrainingError(f"{when}: non-finite predicted {', '.join(bad)} on the {len(structures)} "
                                "evaluation structures")
        return error_table(sums)

    count = procs.sum(np.array([float(sum(p.numel() for p in parameters))]))[0]
    if pipeline is not None:
        count /= pipeline.replicas
    if root:
        directory.mkdir(parents=True, exist_ok=True)
        if pipeline is not None:
            shards.mkdir(exist_ok=True)
            (shards / "layout.json").write_text(json.dumps({"stages": pipeline.stages,
                                                            "boundaries": pipeline.boundaries}))
        from tqdm import tqdm
        bar = tqdm(total=config["epochs"], initial=first_epoch, unit="epoch", file=sys.stderr, dynamic_ncols=True)
        layout = f", stages at blocks {pipeline.boundaries}" if pipeline is not None else ""
        print(f"mlip-train: {type(model).__name__} {model.species}, {int(count)} parameters, "
              f"{len(train_set)} training / {len(validation)} validation / {len(test)} test structures, "
              f"{procs.size} rank(s), {procs.parallel} parallel{layout}", flush=True)
    procs.barrier()  # the output directory exists before any rank writes into it
    batch_size = config["batch_size"]
    for epoch in range(first_epoch, config["epochs"]):
        start = time.perf_counter()
        model.train()
        order = np.random.default_rng([config["seed"], epoch]).permutation(len(train_set))
        loss_sum, batches = 0.0, 0
        for b in range(0, len(order), batch_size):
            global_batch = [train_set[k] for k in order[b:b + batch_size]]
            counts = Counts.of(global_batch)
            optimizer.zero_grad(set_to_none=False)
            if pipeline is not None:
                try:
                    value = pipeline.step(global_batch, weights, optimizer, o["gradient_clip"])
                except TrainingError as exc:
                    raise TrainingError(f"epoch {epoch + 1}: {exc}") from None
            else:
                if procs.parallel == "graph":
                    value = 0.0
                    for s in global_batch:
                        surrogate, terms = graph_parallel_loss(model, s, weights, counts, procs.backend)
                        surrogate.backward()
                        value += total_loss(terms, weights)
                        if not np.isfinite(total_loss(terms, weights)):  # terms are global: every rank agrees
                            raise TrainingError(f"epoch {epoch + 1}: the loss of {s.source} is not finite")
                else:
                    mine = global_batch[procs.rank::procs.size]
                    value, bad = 0.0, []
                    if mine:
                        batch = Batch(mine, model, device)
                        predictions = predict_batch(model, batch)
                        loss = total_loss(loss_terms(*predictions, batch, counts), weights)
                        loss.backward()
                        value = loss.item()
                        bad = [] if np.isfinite(value) else nonfinite_structures(batch, *predictions)
                    value = float(procs.sum(np.array([value]))[0])
                    if not np.isfinite(value):  # the global loss: every rank stops here
                        bad = [name for names in procs.allgather(bad) for name in names]
                        raise TrainingError(f"epoch {epoch + 1}: the loss is not finite; non-finite predictions for "
                                            f"{', '.join(bad) if bad else 'none of the structures (see the labels)'}")
                procs.sum_gradients(parameters)
                if o["gradient_clip"] > 0:
                    try:
                        torch.nn.utils.clip_grad_norm_(parameters, o["gradient_clip"], error_if_nonfinite=True)
                    except RuntimeError:
                        raise TrainingError(f"epoch {epoch + 1}: the gradient norm is not finite (batch of "
                                            f"{', '.join(s.source for s in global_batch)})") from None
                optimizer.step()
            if ema is not None:
                ema.update_parameters(model)
            loss_sum, batches = loss_sum + value, batches + 1
        model.eval()
        errors = errors_of(evaluation_model(), validation, f"epoch {epoch + 1}")
        val_loss = sum(weights[q] * errors[f"{q}_rmse"] ** 2 for q in ("energy", "forces", "stress")
                       if weights[q] > 0 and np.isfinite(errors[f"{q}_rmse"]))
        lr = optimizer.param_groups[0]["lr"]
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step(val_loss)
        elif scheduler is not None:
            scheduler.step()
        row = dict(epoch=epoch + 1, train_loss=loss_sum / max(batches, 1), val_loss=val_loss, lr=lr,
                   seconds=time.perf_counter() - start, **errors)
        rows.append(row)
        improved = val_loss < best
        best = min(best, val_loss)
        if root or pipeline is not None:
            save(last_path, epoch + 1)
            if improved:
                save(directory / "best.pt", epoch + 1)
        if root:
            write_metrics(directory, rows)
            bar.update(1)
            bar.set_postfix(val_loss=f"{val_loss:.3g}", F_mae=f"{errors['forces_mae'] * 1e3:.1f} meV/A")
        procs.barrier()
    if root:
        bar.close()
        plot_learning_curve(directory, rows)
    has_best = bool(procs.bcast((directory / "best.pt").exists()))
    if test and has_best:
        parts = None if pipeline is None else model.parts  # pipeline: each stage reads its own parts
        best_model = potentials.load(directory / "best.pt", map_location=device, parts=parts)
        errors = errors_of(best_model, test, "test set")
        if root:
            print("test set, best.pt:\n" + format_errors(errors), flush=True)
    if root:
        written = ["best.pt", "last.pt", "metrics.csv", "learning_curve.png"] + (["pipeline/"] if pipeline else [])
        print(f"mlip-train: output in {directory}: {', '.join(written)}", flush=True)
    return rows


def write_metrics(directory: Path, rows) -> None:
    with open(directory / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=METRIC_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row[k] for k in METRIC_COLUMNS})


def plot_learning_curve(directory: Path, rows) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.semilogy(epochs, [r["train_loss"] for r in rows], label="train")
    left.semilogy(epochs, [r["val_loss"] for r in rows], label="validation")
    left.set_xlabel("epoch"), left.set_ylabel("loss"), left.legend()
    right.semilogy(epochs, [1e3 * r["forces_mae"] for r in rows], label="forces (meV/Å)")
    right.semilogy(epochs, [1e3 * r["energy_mae"] for r in rows], label="energy (meV/atom)")
    right.set_xlabel("epoch"), right.set_ylabel("validation MAE"), right.legend()
    fig.tight_layout()
    fig.savefig(directory / "learning_curve.png", dpi=100)
    plt.close(fig)


def format_errors(errors: dict) -> str:
    units = {"energy": ("meV/atom", 1e3), "forces": ("meV/Å", 1e3), "stress": ("meV/Å³", 1e3)}
    lines = [f"{'quantity':10s} {'MAE':>12s} {'RMSE':>12s}  unit"]
    for q, (unit, factor) in units.items():
        lines.append(f"{q:10s} {factor * errors[f'{q}_mae']:12.4g} {factor * errors[f'{q}_rmse']:12.4g}  {unit}")
    return "\n".join(lines)


def evaluate_model(model_path: str, data_path: str, batch_size: int = 8, progress: bool = False) -> dict:
    """MAE/RMSE of a checkpoint (or bundled model name) on every structure of a labelled file (one
    process); ``progress`` prints a header and a progress bar."""
    import potentials
    from .training import check_species, error_sums, error_table, read_structures

    model = potentials.load(model_path)
    structures = read_structures(data_path)
    check_species(model, structures, "evaluation", error=ConfigError)
    if progress:
        atoms = sum(len(s.numbers) for s in structures)
        print(f"mlip-train eval: {type(model).__name__} {model.species} (cutoff {model.cutoff:g} Å) from {model_path}\n"
              f"scoring every structure of {data_path}: {len(structures)} structures, {atoms} atoms", flush=True)
    from tqdm import tqdm

    sums = np.zeros(9)
    with tqdm(total=len(structures), unit="structure", file=sys.stderr, disable=not progress, leave=False) as bar:
        for start in range(0, len(structures), batch_size):
            chunk = structures[start:start + batch_size]
            sums += error_sums(model, chunk, batch_size, model.device)
            bar.update(len(chunk))
    return error_table(sums)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:
        parser = argparse.ArgumentParser(prog="mlip-train eval", description="errors of a model on every structure "
                                         "of a labelled file")
        parser.add_argument("model", help="checkpoint path (best.pt) or bundled model name (cu-emt)")
        parser.add_argument("data", help="ASE-readable file with energy/forces/stress")
        args = parser.parse_args(argv[1:])
        try:
            print(format_errors(evaluate_model(args.model, args.data, progress=True)))
        except MLIPError as exc:
            report_error("mlip-train", exc)
            return 2
        return 0
    args = config_parser("mlip-train", __doc__.splitlines()[0], SCHEMA).parse_args(argv)
    try:
        train(validate(read_config(args.config), SCHEMA, CHOICES))
    except MLIPError as exc:  # bad config or data: raised alike on every rank, before any collective
        report_error("mlip-train", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
