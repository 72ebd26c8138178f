"""The Trainer of ``mlip-train`` (docs/architecture.md §5): built from a validated config, it owns the
model (a pipeline stage's parts, in pipeline mode), the AdamW optimizer, the learning-rate schedule and
the EMA, and runs epochs through one of three strategies with one interface —

* ``DataParallel``: every rank a share of each global batch (one process is the case of one rank);
* ``GraphParallel``: every structure decomposed by space over the ranks, the loss back-propagated
  through the halo;
* ``PipelineParallel``: the model's blocks over stages (``pipeline.PipelineTrainer``).

A strategy's ``step(global_batch, optimizer, epoch)`` computes the gradients, clips them and takes the
optimizer step, returning the loss; ``error_sums(net, structures)`` scores a model (summed over ranks);
``state_dict`` / ``load_state_dict`` carry its own resume state (2BW's stale weights). The Trainer
writes checkpoints and metrics.
"""
from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import numpy as np

from ..config import ConfigError, check_output_directory
from ..preflight import check_parameter_memory, check_training_memory
from .training import QUANTITIES


# ----------------------------------------------------------------------------- processes
class Processes:
    """Rank, size and sums over ranks, through the job's halo backend (``backend_kind``: MPI under
    mpiexec, torch.distributed under torchrun or ``MLIP_PARALLEL_BACKEND=torch``). Pipeline and
    data-parallel training also talk torch.distributed directly, on the process group that the torch
    halo backend uses too (``backend.init_process_group``)."""

    def __init__(self, parallel: str):
        from ..backend import get_backend, init_process_group

        self.parallel, self.dist = parallel, None
        self.backend = get_backend()
        self.rank, self.size = self.backend.rank, self.backend.size
        if parallel == "pipeline" or (parallel == "data" and self.size > 1):
            import torch.distributed as dist

            init_process_group()
            self.dist = dist

    def bcast(self, obj):
        """Rank 0's ``obj`` on every rank (a decision rank 0 takes alone, e.g. from its disk)."""
        return self.backend.bcast(obj)

    def allgather(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        return self.backend.allgather(obj)

    def barrier(self) -> None:
        self.backend.barrier()

    def sum(self, array: np.ndarray) -> np.ndarray:
        """Element-wise sum over ranks (numpy float64)."""
        return self.backend.allreduce(np.asarray(array, dtype=np.float64))

    def sum_gradients(self, parameters) -> None:
        """Add every rank's parameter gradients (one flat message; on the device through
        torch.distributed in data-parallel training)."""
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


# ----------------------------------------------------------------------------- the model and the data
NEW_MODEL_KEYS = ("name", "cutoff", "hyperparameters", "species")  # model keys describing a new model


def starting_model(section) -> str | None:
    """The model family whose key names the model training starts from (None: a new model); ConfigError for
    keys that contradict each other (two starting models, a new model's keys beside one, an option of another
    family)."""
    from ..model_section import chosen_family

    given = chosen_family(section, trainable=True, conflict="model: start from one of")
    if given is not None and given != "checkpoint":  # (a checkpoint's architecture replaces these keys, as it always did)
        described = [k for k in NEW_MODEL_KEYS if section[k] is not None]
        if described:
            raise ConfigError(f"model.{described[0]} describes a new model, but model.{given} starts from a trained "
                              f"one, whose architecture, cutoff and species are its own: remove model.{described[0]}")
    return given


def model_species(section, structures) -> list:
    """A new model's element symbols: model.species, else those in ``structures``."""
    if section["species"] is not None:
        return section["species"]
    from ase.data import chemical_symbols
    return [chemical_symbols[z] for z in sorted({int(z) for s in structures for z in s.numbers})]


def new_model_class(section):
    """The class of the new model ``model.name`` names (SchNet where none is named)."""
    from potentials.families.checkpoint import architecture

    return architecture(section["name"] or "SchNet")


def build_model(section, species, seed, parts=None):
    """The configured model: a new one (``parts``: only these parts, a pipeline stage's) initialised from
    ``seed`` part by part, or the starting model its family's key names (only ``parts`` of it), in
    ``model.dtype`` (default: its own)."""
    import torch

    from ..model_section import load_section_model

    key = starting_model(section)
    if key is not None:
        return load_section_model(section, key, parts=parts).train()
    cls = new_model_class(section)
    cutoff = 5.0 if section["cutoff"] is None else section["cutoff"]
    try:
        model = cls(species=species, cutoff=cutoff, **(section["hyperparameters"] or {}), parts=parts, seed=seed)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model: cannot build {section['name'] or 'SchNet'}: {exc}") from None
    dtype = {"float32": torch.float32, "float64": torch.float64, None: torch.float32}[section["dtype"]]
    return model.to(dtype)


def check_new_model_size(section, species, config, procs, device) -> None:
    """MemoryLimitError (every rank) when the new model's weights would not fit a rank for training
    (``preflight.check_parameter_memory``; counted on small builds of the same class)."""
    import inspect

    hyperparameters = section["hyperparameters"] or {}

    def construct(**size):
        return build_model(dict(section, hyperparameters={**hyperparameters, **size}), species, 0)

    cls = new_model_class(section)
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    stages = config["pipeline"]["stages"] if procs.parallel == "pipeline" else 1
    itemsize = {"float64": 8}.get(section["dtype"], 4)
    check_parameter_memory(procs.backend, cls.__name__, construct, hyperparameters, defaults, device, itemsize, stages)


def check_freeze(model, freeze, procs) -> None:
    """ConfigError naming a ``model.freeze`` pattern that matches no weight of the model on any rank
    (pipeline stages each hold some parts), with the model's parameter groups (collective)."""
    from fnmatch import fnmatchcase

    from potentials.base import weight_groups

    names = [name for held in procs.allgather([name for name, _ in model.named_weights()]) for name in held]
    for pattern in freeze:
        if not any(fnmatchcase(name, pattern) for name in names):
            raise ConfigError(f"model.freeze: pattern {pattern!r} matches none of the {type(model).__name__}'s "
                              f"weights; its parameter groups are {', '.join(weight_groups(names))}")


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
    weights = {q: config["loss"][f"{q}_weight"] for q in QUANTITIES}
    if not any(weights.values()):
        raise ConfigError(f"loss: every weight is 0 ({', '.join(f'{q}_weight' for q in QUANTITIES)}): nothing to fit")
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
    blocks = build(frozenset()).n_blocks
    if not 1 <= pc["stages"] <= blocks:
        raise ConfigError(f"pipeline.stages = {pc['stages']}: a stage holds at least one interaction block and the "
                          f"model has {blocks}")
    if procs.size % pc["stages"]:
        raise ConfigError(f"pipeline.stages = {pc['stages']} must divide the {procs.size} rank(s)")
    sweeps = "energy" if weights["forces"] == 0 and weights["stress"] == 0 else "forces"
    try:
        return PipelineTrainer(build, pc["stages"], pc["microbatches"], pc["schedule"], sweeps, boundaries=boundaries,
                               sample=train_set[:1], two_bw=pc["two_bw"], recompute=pc["recompute"],
                               merge=pc["merge"])
    except PipelineError as exc:
        raise ConfigError(f"pipeline: {exc}") from None



# ----------------------------------------------------------------------------- strategies
class DataParallel:
    """Each rank takes structures rank, rank + P, … of every global batch; gradients are summed over ranks
    (one process: P = 1). Validation and test: each rank scores its share."""

    def __init__(self, procs, model, device, config, weights):
        self.procs, self.model, self.device = procs, model, device
        self.weights, self.clip, self.batch_size = weights, config["optimizer"]["gradient_clip"], config["batch_size"]
        self.parameters = [p for p in model.parameters() if p.requires_grad]

    def gradients(self, global_batch, epoch) -> float:
        from .training import Batch, Counts, TrainingError, batch_gradients, nonfinite_structures

        procs = self.procs
        mine = global_batch[procs.rank::procs.size]
        value, bad = 0.0, []
        if mine:
            batch = Batch(mine, self.model, self.device)
            loss, predictions = batch_gradients(self.model, batch, Counts.of(global_batch), self.weights,
                                                self.parameters)
            value = loss.item()
            bad = [] if np.isfinite(value) else nonfinite_structures(batch, *predictions)
        value = float(procs.sum(np.array([value]))[0])
        if not np.isfinite(value):  # the global loss: every rank stops here
            bad = [name for names in procs.allgather(bad) for name in names]
            raise TrainingError(f"epoch {epoch}: the loss is not finite; non-finite predictions for "
                                f"{', '.join(bad) if bad else 'none of the structures (see the labels)'}")
        return value

    def step(self, global_batch, optimizer, epoch) -> float:
        """Gradients of the global batch's loss, summed over ranks, clipped; one optimizer step. Returns the loss."""
        import torch

        from .training import TrainingError

        value = self.gradients(global_batch, epoch)
        self.procs.sum_gradients(self.parameters)
        if self.clip > 0:
            try:
                torch.nn.utils.clip_grad_norm_(self.parameters, self.clip, error_if_nonfinite=True)
            except RuntimeError:
                raise TrainingError(f"epoch {epoch}: the gradient norm is not finite (batch of "
                                    f"{', '.join(s.source for s in global_batch)})") from None
        optimizer.step()
        return value

    def share(self, structures) -> list:
        return structures[self.procs.rank::self.procs.size]

    def energies(self, net, structures) -> np.ndarray:
        """``net``'s energies of ``structures`` [len(structures)] (eV; each rank its share, summed over ranks)."""
        from .training import predicted_energies

        mine = self.share(list(range(len(structures))))
        out = np.zeros(len(structures))
        out[mine] = predicted_energies(net, [structures[k] for k in mine], self.batch_size, self.device)
        return self.procs.sum(out)

    def error_sums(self, net, structures) -> np.ndarray:
        from .training import error_sums

        return self.procs.sum(error_sums(net, self.share(structures), self.batch_size, self.device))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state) -> None:
        pass


class GraphParallel(DataParallel):
    """Every structure of a global batch split by space over all ranks (``graph_parallel_loss``); the
    gradients summed over ranks. Validation and test run on rank 0 alone (no gradient graph is needed
    there, and only training is split by space)."""

    def gradients(self, global_batch, epoch) -> float:
        from .training import Counts, TrainingError, graph_parallel_loss, total_loss

        value, counts = 0.0, Counts.of(global_batch)
        for s in global_batch:
            surrogate, terms = graph_parallel_loss(self.model, s, self.weights, counts, self.procs.backend)
            surrogate.backward(inputs=self.parameters)
            loss = total_loss(terms, self.weights)
            if not np.isfinite(loss):  # terms are global: every rank agrees
                raise TrainingError(f"epoch {epoch}: the loss of {s.source} is not finite")
            value += loss
        return value

    def share(self, structures) -> list:
        return structures if self.procs.rank == 0 else []


class PipelineParallel:
    """The model's blocks over pipeline stages (``pipeline.PipelineTrainer``; ``model`` holds this stage's
    parts), data parallel across replicas; validation and test are pipelined evaluations. Once the
    trainer has measured its sweep costs, rank 0 prints the schedule of a full global batch once, with
    its predicted step time."""

    def __init__(self, pipeline, config, weights):
        self.pipeline, self.model = pipeline, pipeline.model
        self.weights, self.clip, self.batch_size = weights, config["optimizer"]["gradient_clip"], config["batch_size"]
        self.parameters = pipeline.parameters
        self.reported = False

    def step(self, global_batch, optimizer, epoch) -> float:
        from .training import TrainingError

        try:
            loss = self.pipeline.step(global_batch, self.weights, optimizer, self.clip)
        except TrainingError as exc:
            raise TrainingError(f"epoch {epoch}: {exc}") from None
        if not self.reported and self.pipeline.costs is not None:
            self.reported = True
            name, _, timeline = self.pipeline.plan(self.pipeline.microbatches, self.pipeline.sweeps)
            if self.pipeline.replica == 0 and self.pipeline.stage.first:
                print(f"mlip-train: pipeline schedule {name}: predicted {timeline['time']:.3g} s per global "
                      f"batch, bubble {timeline['bubble_fraction']:.2f}, stages' work "
                      f"{' / '.join(f'{w:.3g}' for w in timeline['stage_busy'])} s (measured sweep costs)", flush=True)
        return loss

    def error_sums(self, net, structures) -> np.ndarray:
        return self.pipeline.error_sums(structures, self.batch_size, net)

    def state_dict(self) -> dict:
        return self.pipeline.state_dict()

    def load_state_dict(self, state) -> None:
        self.pipeline.load_state_dict(state)


# ----------------------------------------------------------------------------- the trainer
class Trainer:
    """Everything one ``mlip-train`` run holds (see the module docstring); ``Trainer(config)`` builds it
    (collective), ``fit()`` runs the epochs and returns the metric rows (every rank)."""

    def __init__(self, config):
        import torch
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        from ..backend import rank_device
        from .training import check_species

        self.config = config
        self.directory = Path(config["output"]["directory"])
        if not config["resume"]:
            check_output_directory(self.directory, config["output"]["overwrite"])
        section = config["model"]
        self.starting = starting_model(section)  # (the config alone: before any process group exists)
        self.procs = procs = Processes(config["parallel"])
        self.root = procs.rank == 0
        self.train_set, self.validation, self.test, self.weights = load_data(config)
        self.last_path, self.shards = self.directory / "last.pt", self.directory / "pipeline"
        self.resume = bool(procs.bcast(config["resume"] and self.last_path.exists()))  # rank 0's disk decides
        self.device = device = rank_device(procs.backend)
        species = model_species(section, self.train_set)

        def build(parts=None):
            from potentials.base import select_weights

            model = build_model(section, species, config["seed"], parts).to(device)
            select_weights(model, section["freeze"], require_match=False)  # checked below, over every stage
            return model

        self.build = build
        if self.starting is None:  # a new model: its size comes from the config alone (a starting model's: its file)
            check_new_model_size(section, species, config, procs, device)
        self.pipeline = None
        if procs.parallel == "pipeline":
            layout = None
            if self.resume:
                layout = procs.bcast(json.loads((self.shards / "layout.json").read_text()) if self.root else None)
            self.pipeline = pipeline_trainer(config, procs, build, self.train_set, self.weights, layout)
            self.strategy = PipelineParallel(self.pipeline, config, self.weights)
        else:
            model = build()
            kind = GraphParallel if procs.parallel == "graph" else DataParallel
            self.strategy = kind(procs, model, device, config, self.weights)
        self.model = model = self.strategy.model
        check_freeze(model, section["freeze"], procs)
        if not self.strategy.parameters:
            raise ConfigError(f"model.freeze {section['freeze']} keeps every weight of the model fixed: nothing to train")
        for part, role in ((self.train_set, "training"), (self.validation, "validation"), (self.test, "test")):
            check_species(model, part, role, error=ConfigError)
        batch = min(config["batch_size"], len(self.train_set))  # structures a step's graphs hold, per rank:
        per_step = {"data": -(-batch // procs.size), "graph": 1,
                    "pipeline": -(-batch // config["pipeline"]["microbatches"])}[procs.parallel]
        check_training_memory(procs.backend, model, self.train_set + self.validation + self.test, per_step,
                              procs.parallel == "graph")
        self.reference_note = None  # the log's line on a starting model's reference energies
        if self.starting is None:
            if not self.resume:
                fit_scale_shift(model, self.train_set)
        elif section["reference_energies"] == "refit":  # also on resume: the saved state may hold their shape
            self.refit_reference_energies()
        else:
            energies = model.reference_energies()
            if self.pipeline is not None:  # the stage that holds them (the readout's, for most models)
                energies = next((e for e in procs.allgather(energies) if e is not None), None)
            self.reference_note = self.reference_energies_line("kept", energies)
        o, sch = config["optimizer"], config["schedule"]
        self.optimizer = torch.optim.AdamW(self.strategy.parameters, lr=o["lr"], weight_decay=o["weight_decay"])
        if sch["name"] == "plateau":
            self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
                self.optimizer, factor=sch["factor"], patience=sch["patience"], min_lr=sch["min_lr"])
        elif sch["name"] == "cosine":
            self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
                self.optimizer, T_max=max(1, config["epochs"]), eta_min=sch["min_lr"])
        else:
            self.scheduler = None
        # the parameters only: buffers are constants (reference energies, MACE's atomic numbers, whose integers an
        # average would round down: 29 -> 28)
        self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(config["ema_decay"]), use_buffers=False) \
            if config["ema_decay"] > 0 else None
        self.first_epoch, self.best, self.rows = 0, float("inf"), []
        if self.resume:
            self.load_state()
        self.last_written = f"{self.last_path} (epoch {self.first_epoch})" if self.resume else "none yet"

    # ------------------------------------------------------------------ reference energies
    def reference_energies_line(self, what: str, energies, before=None) -> str | None:
        """The log's line of the per-element reference energies of the training set's elements (None: none)."""
        if energies is None:
            return None
        from ase.data import chemical_symbols

        present = {chemical_symbols[int(z)] for s in self.train_set for z in s.numbers}
        pairs = [f"{x} {e:.6g}" + ("" if before is None else f" (was {b:.6g})")
                 for x, e, b in zip(self.model.species, energies, energies if before is None else before)
                 if x in present]
        shown = ", ".join(pairs[:12]) + (f", ... ({len(pairs)} elements)" if len(pairs) > 12 else "")
        return f"mlip-train: reference energies {what} (eV per atom, the training set's elements): {shown}"

    def refit_reference_energies(self) -> None:
        """``model.reference_energies: refit``: add to each element's reference energy the least-squares fit of
        the starting model's energy residual (label − prediction) over the training structures to their
        element counts (as MACE's ``E0s: estimated`` fits the labels); elements absent from the training set
        keep theirs. The same numbers on every rank (predictions summed over ranks)."""
        from ase.data import atomic_numbers

        from .training import fit_reference_energies

        model = self.model
        labelled = [s for s in self.train_set if s.energy is not None]
        if self.pipeline is None:
            before = model.reference_energies()
            predicted = self.strategy.energies(model, labelled) if before is not None and labelled else None
        else:  # a stage holds only its parts: the starting model, whole, on rank 0 (once, before training)
            from .training import predicted_energies

            whole = self.build() if self.root else None
            before, predicted = self.procs.bcast((whole.reference_energies(), predicted_energies(
                whole, labelled, self.config["batch_size"], self.device) if labelled else None) if self.root else None)
            del whole
        if before is None:
            raise ConfigError(f"model.reference_energies: refit: this {type(model).__name__} has no per-element "
                              f"reference energies")
        if not labelled:
            raise ConfigError("model.reference_energies: refit needs training structures with energies")
        residuals = np.array([s.energy for s in labelled]) - predicted
        present = sorted({int(z) for s in labelled for z in s.numbers})
        delta = fit_reference_energies(labelled, present, residuals)
        after = before.copy()
        index = {atomic_numbers[x]: k for k, x in enumerate(model.species)}
        for z, d in zip(present, delta):
            after[index[z]] += d
        model.set_reference_energies(after)  # (a pipeline stage that does not hold them leaves them)
        self.reference_note = self.reference_energies_line(
            f"refit by least squares on {len(labelled)} training structures", after, before)

    # ------------------------------------------------------------------ state
    @property
    def evaluation_model(self):
        """The weights that are scored and saved: the EMA when there is one."""
        return self.ema.module if self.ema is not None else self.model

    def training_state(self, epoch: int) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "epoch": epoch,
                "best": self.best, "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
                "ema": self.ema.state_dict() if self.ema is not None else {}, "pipeline": self.strategy.state_dict()}

    def shard(self, epoch: int) -> Path:
        """This pipeline stage's resume state after ``epoch`` epochs (written by replica 0)."""
        return self.shards / f"stage{self.pipeline.stage.stage}.epoch{epoch}.pt"

    def saved_epoch(self) -> int:
        """The epoch of the last complete last.pt (rank 0 reads it, memory-mapped; every rank gets it)."""
        import torch

        epoch = None
        if self.root:
            try:
                epoch = int(torch.load(self.last_path, map_location="cpu", weights_only=True, mmap=True)["epoch"])
            except (OSError, RuntimeError, KeyError, ValueError) as exc:
                epoch = f"resume: cannot read the epoch of {self.last_path}: {exc}"
        epoch = self.procs.bcast(epoch)
        if isinstance(epoch, str):
            raise ConfigError(epoch)
        return epoch

    def load_state(self) -> None:
        """Continue the run in the output directory from its last complete last.pt: its training state
        (pipeline: this stage's shard of last.pt's epoch; last.pt is written after every stage's shard)."""
        import torch

        path = self.shard(self.saved_epoch()) if self.pipeline is not None else self.last_path
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)["training"]
        except (OSError, RuntimeError, KeyError) as exc:
            raise ConfigError(f"resume: cannot read {path}: {exc}") from None
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        self.strategy.load_state_dict(state["pipeline"])
        self.first_epoch, self.best = int(state["epoch"]), float(state["best"])
        try:
            with open(self.directory / "metrics.csv") as f:
                rows = [{k: int(v) if k == "epoch" else float(v) for k, v in r.items()} for r in csv.DictReader(f)]
        except (OSError, ValueError) as exc:
            raise ConfigError(f"resume: cannot read {self.directory / 'metrics.csv'}: {exc}") from None
        if len(rows) < self.first_epoch:  # metrics.csv is written before the checkpoints of its epoch
            raise ConfigError(f"resume: {self.directory / 'metrics.csv'} holds {len(rows)} epochs, {path} "
                              f"{self.first_epoch}: not this run's metrics")
        self.rows = rows[:self.first_epoch]

    def save(self, path, epoch: int) -> None:
        """Write ``path`` (an ordinary potentials checkpoint of the evaluation model, atomically) from rank
        0; in pipeline mode collectively, assembled from the stages' parts. Saving last.pt in pipeline mode,
        each stage first writes its resume shard of ``epoch``, and removes its older ones once last.pt is
        complete: a resume finds every stage's shard of last.pt's epoch."""
        import potentials
        from potentials.files import atomic_write

        if self.pipeline is None:
            if self.root:
                model = self.evaluation_model
                potentials.save(model, path, extra={"training": self.training_state(epoch)})
                native = model.native_file("best") if path == self.directory / "best.pt" else None
                if native is not None:  # and in the package's own format, for its own tools
                    model.save_native(self.directory / native, data=self.config["data"]["train"])
            return
        last = path == self.last_path
        if self.pipeline.replica == 0 and last:
            import torch
            with atomic_write(self.shard(epoch)) as f:
                torch.save({"training": self.training_state(epoch)}, f)
        self.pipeline.save_merged(path, self.evaluation_model, extra={"epoch": epoch})
        native = self.model.native_file("best") if path == self.directory / "best.pt" else None
        if native is not None and self.root:  # the package's own format, from the merged whole model (on the host)
            potentials.load(path, map_location="cpu").save_native(self.directory / native,
                                                                  data=self.config["data"]["train"])
        if self.pipeline.replica == 0 and last:
            for old in self.shards.glob(f"stage{self.pipeline.stage.stage}.epoch*.pt"):
                if old != self.shard(epoch):
                    old.unlink(missing_ok=True)

    # ----------------------------------------------------------------- scoring
    def errors(self, net, structures, when: str) -> dict:
        """MAE/RMSE of ``net`` on ``structures`` (``training.error_table``); a non-finite prediction ends
        training, naming ``when``."""
        from .training import TrainingError, error_table

        sums = self.strategy.error_sums(net, structures)
        bad = [q for k, q in enumerate(QUANTITIES)
               if sums[3 * k + 2] > 0 and not np.all(np.isfinite(sums[3 * k: 3 * k + 2]))]
        if bad:
            raise TrainingError(f"{when}: non-finite predicted {', '.join(bad)} on the {len(structures)} "
                                "evaluation structures")
        return error_table(sums)

    # -------------------------------------------------------------------- run
    def fit(self) -> list:
        """Train ``epochs`` epochs (from where a resumed run stopped); write checkpoints, metrics.csv, the
        learning curve; score the test set with best.pt. Returns the metric rows (every rank). An output
        file that cannot be written raises OutputError naming it, the reason and the last checkpoint."""
        from potentials.errors import OutputError

        try:
            return self._fit()
        except OutputError as exc:
            raise OutputError(f"{exc}; last checkpoint written: {self.last_written}") from None

    def _fit(self) -> list:
        import torch

        import potentials

        from potentials.files import atomic_write, naming_errors

        from ..model_section import section_options
        from .outputs import format_errors, plot_learning_curve, species_text, write_metrics

        config, procs, root = self.config, self.procs, self.root
        count = np.array([float(sum(p.numel() for p in self.strategy.parameters)),  # trained, of all weights:
                          float(sum(p.numel() for _, p in self.model.named_weights()))])  # the whole model ...
        if self.pipeline is not None:  # ... or a stage's parts: add the stages of one replica
            count = procs.sum(count) / self.pipeline.replicas
        section = config["model"]
        if root:
            with naming_errors(self.directory):
                self.directory.mkdir(parents=True, exist_ok=True)
            if self.pipeline is not None:
                with naming_errors(self.shards):
                    self.shards.mkdir(exist_ok=True)
                with atomic_write(self.shards / "layout.json", "w") as f:
                    json.dump({"stages": self.pipeline.stages, "boundaries": self.pipeline.boundaries}, f)
            from ..progress import Progress
            bar = Progress("mlip-train", config["epochs"], self.first_epoch, "epoch",
                           None if config["output"]["progress"] else "off", every_seconds=0)
            layout = f", stages at blocks {self.pipeline.boundaries}" if self.pipeline is not None else ""
            start = "" if self.starting is None else f" from {self.starting} {section[self.starting]}" + "".join(
                f" ({key} {value})" for key, value in section_options(section, self.starting).items())
            trained = f"{int(count[0])} parameters" if count[0] == count[1] else \
                f"{int(count[0])} of {int(count[1])} parameters trained (model.freeze {section['freeze']})"
            print(f"mlip-train: {type(self.model).__name__}{start} {species_text(self.model.species)}, {trained}, "
                  f"{len(self.train_set)} training / {len(self.validation)} validation / {len(self.test)} test "
                  f"structures\nmlip-train: {procs.size} rank(s) x {torch.get_num_threads()} thread(s), "
                  f"{procs.parallel} parallel{layout}", flush=True)
            if self.reference_note:
                print(self.reference_note, flush=True)
        procs.barrier()  # the output directory exists before any rank writes into it
        batch_size, rows = config["batch_size"], self.rows
        for epoch in range(self.first_epoch, config["epochs"]):
            start = time.perf_counter()
            self.model.train()
            order = np.random.default_rng([config["seed"], epoch]).permutation(len(self.train_set))
            loss_sum, batches = 0.0, 0
            for b in range(0, len(order), batch_size):
                global_batch = [self.train_set[k] for k in order[b:b + batch_size]]
                self.optimizer.zero_grad(set_to_none=False)
                loss_sum += self.strategy.step(global_batch, self.optimizer, epoch + 1)
                batches += 1
                if self.ema is not None:
                    self.ema.update_parameters(self.model)
            self.model.eval()
            errors = self.errors(self.evaluation_model, self.validation, f"epoch {epoch + 1}")
            val_loss = sum(self.weights[q] * errors[f"{q}_rmse"] ** 2 for q in QUANTITIES
                           if self.weights[q] > 0 and np.isfinite(errors[f"{q}_rmse"]))
            lr = self.optimizer.param_groups[0]["lr"]
            if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                self.scheduler.step(val_loss)
            elif self.scheduler is not None:
                self.scheduler.step()
            rows.append(dict(epoch=epoch + 1, train_loss=loss_sum / max(batches, 1), val_loss=val_loss, lr=lr,
                             seconds=time.perf_counter() - start, **errors))
            improved = val_loss < self.best
            self.best = min(self.best, val_loss)
            # last.pt last: a run killed before it is complete redoes the epoch, and writes all three again
            if root:
                write_metrics(self.directory, rows)
            if improved:
                self.save(self.directory / "best.pt", epoch + 1)
            self.save(self.last_path, epoch + 1)
            self.last_written = f"{self.last_path} (epoch {epoch + 1})"
            if root:
                bar.update(epoch + 1, val_loss=f"{val_loss:.3g}", F_mae=f"{errors['forces_mae'] * 1e3:.1f} meV/A")
            procs.barrier()
        if root:
            bar.close()
            plot_learning_curve(self.directory, rows)
        if self.test and procs.bcast((self.directory / "best.pt").exists()):
            parts = None if self.pipeline is None else self.model.parts  # pipeline: each stage reads its own parts
            best_model = potentials.load(self.directory / "best.pt", map_location=self.device, parts=parts)
            errors = self.errors(best_model, self.test, "test set")
            if root:
                print("test set, best.pt:\n" + format_errors(errors), flush=True)
        if root:
            native = self.model.native_file("best")
            written = ["best.pt"] + ([native] if native else []) + ["last.pt", "metrics.csv", "learning_curve.png"] + \
                (["pipeline/"] if self.pipeline else [])
            print(f"mlip-train: output in {self.directory}: {', '.join(written)}", flush=True)
        return rows
