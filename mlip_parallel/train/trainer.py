"""The Trainer of ``mlip-train`` (docs/architecture.md §5): built from a validated config, it owns the
model (a pipeline stage's parts, in pipeline mode; ``model_setup``), the AdamW optimizer, the learning-rate
schedule and the EMA, and runs epochs through one of the parallel strategies (``strategies``) over the job's
ranks (``processes``), writing metrics and checkpoints (``checkpoints``). The job, not its steps (``training.py``:
loss, batches, gradients); a pipeline-parallel job's own loop is ``pipeline/trainer.py``'s, which this one drives.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from potentials.base import select_weights
from potentials.errors import OutputError
from potentials.files import atomic_write, naming_errors
from potentials.lora import LoRAError, add_lora

from ..backend import rank_device
from ..config import ConfigError, check_output_directory
from ..model_section import section_options
from ..preflight import check_training_memory
from ..progress import Progress
from .checkpoints import Checkpoints
from .loader import StepBatches, global_batches
from .model_setup import (build_model, check_new_model_size, check_patterns, fit_scale_shift, load_data, lora_settings,
                          loss_rules, model_species, parameter_groups, starting_model)
from .outputs import MetricLoggers, format_errors, plot_learning_curve, species_text, write_metrics
from .processes import Processes
from .sources import take
from .strategies import DataParallel, GraphParallel, PipelineParallel, pipeline_trainer
from .structures import DataError, DataErrorMidRun
from .survey import energy_residuals, surveys
from .training import QUANTITIES, TrainingError, error_table


def learning_rate_factor(warmup: int, total: int, cosine_floor: float | None):
    """The learning rate's factor at step s (``LambdaLR``): rising linearly over the first ``warmup`` steps,
    ((s + 1) / warmup), then, with ``cosine_floor`` (min_lr / lr), falling as a cosine from 1 to the floor at step
    ``total``; else 1."""
    import math

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cosine_floor is None:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return cosine_floor + (1 - cosine_floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def training_state_bytes(model, trained, averaged: bool) -> float:
    """What training adds to a model's loaded weights (this rank's): a gradient and AdamW's two moments per trained
    weight, and the average's copy of every weight (``averaged``: an EMA)."""
    size = sum(p.numel() * p.element_size() for p in trained)
    return 3.0 * size + (sum(p.numel() * p.element_size() for p in model.parameters()) if averaged else 0.0)


class Trainer(Checkpoints):
    """Everything one ``mlip-train`` run holds (see the module docstring); ``Trainer(config)`` builds it
    (collective), ``fit()`` runs the epochs and returns the metric rows (every rank)."""

    def __init__(self, config):
        self.config = config
        self.directory = Path(config["output"]["directory"])
        if not config["resume"]:
            check_output_directory(self.directory, config["output"]["overwrite"])
        MetricLoggers.check(config["output"])
        section = config["model"]
        self.starting = starting_model(section)  # (the config alone: before any process group exists)
        self.procs = procs = Processes(config["parallel"])
        self.root = procs.rank == 0
        mixture, needed = self._read_data()
        self.last_path, self.shards = self.directory / "last.pt", self.directory / "pipeline"
        self.resume = bool(procs.bcast(config["resume"] and self.last_path.exists()))  # rank 0's disk decides
        self.device = rank_device(procs.backend)
        self._build_strategy(model_species(section, self.surveys[0]), needed)
        self._check_what_trains(needed)
        self._check_memory(mixture)
        self._reference_energies()
        self._optimizer_and_averages()
        # where training stands: optimizer steps taken, the best validation loss, the metric rows, and the training
        # loss summed since the last row ([sum, steps]; a row's train_loss is their mean)
        self.step, self.best, self.rows, self.pending = 0, float("inf"), [], [0.0, 0]
        if self.resume:
            self.load_state()
        self.last_written = f"{self.last_path} ({self.position(self.step)})" if self.resume else "none yet"

    def _read_data(self) -> tuple:
        """The data sets, the loss rules and one survey pass over each part (the ranks sharing it: the label checks,
        the memory check's structures, a new model's species and fits); returns (the training files' mixture,
        {quantity: the largest weight either loss phase gives it})."""
        config = self.config
        self.train_set, self.validation, self.test, mixture, self.data_note = load_data(config)
        self.rules = loss_rules(config)  # (phase one's, stage two's or None)
        needed = {q: max(r[q] for r in self.rules if r is not None) for q in QUANTITIES}  # the labels either reads
        if config["data"]["workers"] and not config["data"]["stream"]:
            raise ConfigError("data.workers reads structures ahead from disk: it needs data.stream: true (held "
                              "structures keep their neighbour lists after the first epoch)")
        self.surveys = surveys((self.train_set, self.validation, self.test), self.procs)
        for part in self.surveys:
            part.check_labels(needed, config["data"]["keys"])
        return mixture, needed

    def _build_strategy(self, species: list, needed: dict) -> None:
        """The model (a new one after its size check, or the starting one; frozen weights, LoRA) and the parallel
        strategy that trains it (a pipeline stage's parts in pipeline mode): ``self.build``, ``self.pipeline``,
        ``self.strategy``, ``self.model``."""
        config, section, procs, device = self.config, self.config["model"], self.procs, self.device
        self.lora = lora_settings(config)

        def build(parts=None):
            model = build_model(section, species, config["seed"], parts).to(device)
            select_weights(model, section["freeze"], require_match=False)  # checked below, over every stage
            if self.lora is not None:  # (a pipeline stage's parts: the globs checked over every stage below)
                try:
                    self.lora["adapted"] = add_lora(model, self.lora["rank"], self.lora["alpha"], self.lora["targets"],
                                                    seed=config["seed"], require_match=parts is None)
                except LoRAError as exc:
                    raise ConfigError(str(exc)) from None
            return model

        self.build = build
        if self.starting is None:  # a new model: its size comes from the config alone (a starting model's: its file)
            check_new_model_size(section, species, config, procs, device)
        self.pipeline = None
        if procs.parallel == "pipeline":
            layout = None
            if self.resume:
                layout = procs.bcast(json.loads((self.shards / "layout.json").read_text()) if self.root else None)
            self.pipeline = pipeline_trainer(config, procs, build, self.train_set, needed, layout)
            self.strategy = PipelineParallel(self.pipeline, config, self.rules[0])
        else:
            kind = GraphParallel if procs.parallel == "graph" else DataParallel
            self.strategy = kind(procs, build(), device, config, self.rules[0])
        self.model = self.strategy.model

    def _check_what_trains(self, needed: dict) -> None:
        """ConfigError (every rank) for globs that match nothing, a model (or a pipeline stage) left nothing to
        train, elements the model does not know, and a weighted quantity the model cannot predict."""
        config, section, procs, model = self.config, self.config["model"], self.procs, self.model
        check_patterns(model, section["freeze"], procs)
        check_patterns(model, list(config["optimizer"]["lr_factors"] or {}), procs, "optimizer.lr_factors")
        if self.lora is not None:  # (a glob matching a stage's weight adapted it there)
            self.lora["adapted"] = sorted({name for held in procs.allgather(self.lora["adapted"]) for name in held})
            check_patterns(model, self.lora["targets"], procs, "model.lora.targets", matched=self.lora["adapted"])
        fixing = f"model.lora.targets {self.lora['targets']}" if self.lora is not None else \
            f"model.freeze {section['freeze']}"
        trains = procs.allgather((self.pipeline.stage.stage if self.pipeline is not None else 0,
                                  bool(self.strategy.parameters)))  # (stage, whether it trains) of every rank
        if not any(t for _, t in trains):
            raise ConfigError(f"{fixing} keeps every weight of the model fixed: nothing to train")
        idle = sorted({stage for stage, t in trains if not t})  # (only pipeline stages differ)
        if idle:
            k, bounds = idle[0], self.pipeline.boundaries
            raise ConfigError(f"{fixing} leaves pipeline stage {k} (blocks {bounds[k]} to {bounds[k + 1] - 1}) "
                              f"nothing to train: each stage needs weights to train; include some of its blocks' "
                              f"weights, or use parallel: data or graph")
        for part, role in zip(self.surveys, ("training", "validation", "test")):
            part.check_species(model, role, error=ConfigError)
        for q in QUANTITIES:
            problem = model.untrained_quantity(q) if needed[q] > 0 else None
            if problem is not None:
                raise ConfigError(f"loss.{q}_weight is {needed[q]}, but {problem}: set loss.{q}_weight: 0")

    def _check_memory(self, mixture) -> None:
        """The steps' batches (``self.batches``), the training structures scored at each validation
        (``self.train_sample``), and the training memory check of a step's graphs and the weights' state."""
        config, procs, model = self.config, self.procs, self.model
        n = config["training_errors"]  # the training structures scored at each validation
        n = min(len(self.validation) if n is None else n, len(self.train_set))
        self.train_sample = take(self.train_set, np.sort(np.random.default_rng(config["seed"]).permutation(
            len(self.train_set))[:n])) if n else None
        self.batches = StepBatches(len(self.train_set), config["batch_size"], config["seed"], self.surveys[0].atoms,
                                   config["batch_atoms"], mixture)
        batch = min(config["batch_size"], len(self.train_set))  # structures a step's graphs hold, per rank:
        if config["batch_atoms"]:  # as many of the largest structures as a batch of that many atoms holds
            largest = int(self.surveys[0].atoms.max())
            batch = max(1, config["batch_atoms"] // largest)
        per_step = {"data": -(-batch // procs.size), "graph": 1,
                    "pipeline": -(-batch // config["pipeline"]["microbatches"])}[procs.parallel]
        check_training_memory(procs.backend, model, [s for part in self.surveys for s in part.memory_candidates],
                              per_step, procs.parallel == "graph", training_state_bytes(model, self.strategy.parameters,
                                                                                        config["ema_decay"] > 0))

    def _reference_energies(self) -> None:
        """A new model's scale and shift fitted to the data (not on resume), or a starting model's reference
        energies kept, refitted or fitted (model.reference_energies); ``self.reference_note``: the log's line."""
        section = self.config["model"]
        self.reference_note = None  # the log's line on a starting model's reference energies
        if self.starting is None:
            if not self.resume:
                fit_scale_shift(self.model, self.surveys[0])
        elif section["reference_energies"] == "refit":  # also on resume: the saved state may hold their shape
            self.refit_reference_energies()
        elif section["reference_energies"] == "fit":
            self.fit_reference_energies()
        else:
            self.reference_note = self.reference_energies_line("kept", self.held_reference_energies())

    def _optimizer_and_averages(self) -> None:
        """AdamW over the trained weights (``optimizer.lr_factors`` per group), the learning-rate schedule, the
        weights' EMA and stage two's average."""
        import torch
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        config, model = self.config, self.model
        o, sch = config["optimizer"], config["schedule"]
        self.optimizer = torch.optim.AdamW(parameter_groups(model, self.strategy.parameters, o["lr"], o["lr_factors"]),
                                           lr=o["lr"], weight_decay=o["weight_decay"], amsgrad=o["amsgrad"])
        self.total_steps = self.batches.total_steps(config["epochs"], config["max_steps"])
        if sch["name"] == "plateau":
            if sch["warmup_steps"]:
                raise ConfigError("schedule.warmup_steps: the plateau schedule sets the learning rate from the "
                                  "validation loss; use schedule.name: cosine or none with a warm-up")
            self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
                self.optimizer, factor=sch["factor"], patience=sch["patience"], min_lr=sch["min_lr"])
        elif sch["name"] == "cosine" or sch["warmup_steps"]:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, learning_rate_factor(
                sch["warmup_steps"], self.total_steps, sch["min_lr"] / o["lr"] if sch["name"] == "cosine" else None))
        else:
            self.scheduler = None
        # the parameters only: buffers are constants (reference energies, MACE's atomic numbers, whose integers an
        # average would round down: 29 -> 28)
        self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(config["ema_decay"]), use_buffers=False) \
            if config["ema_decay"] > 0 else None
        # stage two's weight average (SWA: equal weights, one sample per stage-two epoch)
        self.average = AveragedModel(model, use_buffers=False) if config["stage_two"]["average"] else None

    def training_count(self) -> str:
        """The training set's size, for the log: with sampled files, an epoch's composition."""
        b = self.batches
        if not b.mixture:
            return str(len(self.train_set))
        drawn = ", ".join(f"{n} of {stop - start} sampled ({share:g})" for (start, stop, share), n
                          in zip(b.mixture, b.draws))
        return f"{b.epoch_size} per epoch ({len(b.whole)} whole, {drawn})"

    def position(self, step: int) -> str:
        """``epoch E, step S`` (E: the epochs done, a fraction mid-epoch)."""
        return f"epoch {self.batches.epochs_done(step)}, step {step}"

    # ------------------------------------------------------------------ reference energies
    def reference_energies_line(self, what: str, energies, before=None) -> str | None:
        """The log's line of the per-element reference energies of the training set's elements (None: none)."""
        if energies is None:
            return None
        from ase.data import chemical_symbols

        present = {chemical_symbols[z] for z in self.surveys[0].elements}
        pairs = [f"{x} {e:.6g}" + ("" if before is None else f" (was {b:.6g})")
                 for x, e, b in zip(self.model.species, energies, energies if before is None else before)
                 if x in present]
        shown = ", ".join(pairs[:12]) + (f", ... ({len(pairs)} elements)" if len(pairs) > 12 else "")
        return f"mlip-train: reference energies {what} (eV per atom, the training set's elements): {shown}"

    def held_reference_energies(self):
        """The model's per-element reference energies (None: it has none); in pipeline mode the stage's that holds
        them (the readout's, for most models), on every rank (collective there)."""
        energies = self.model.reference_energies()
        if self.pipeline is not None:
            energies = next((e for e in self.procs.allgather(energies) if e is not None), None)
        return energies

    def fit_reference_energies(self) -> None:
        """``model.reference_energies: fit``: each element of the labelled training structures gets the least
        squares of the energy labels on the element counts (the start-up survey's; MACE's ``E0s: average``);
        other elements keep theirs."""
        from ase.data import atomic_numbers

        model, survey = self.model, self.surveys[0]
        before = self.held_reference_energies()
        if before is None:
            raise ConfigError(f"model.reference_energies: fit: this {type(model).__name__} has no per-element "
                              f"reference energies")
        if not survey.energies.rows:
            raise ConfigError("model.reference_energies: fit needs training structures with energies")
        solved, labelled = survey.energies.solve(), survey.labelled_elements
        numbers = [atomic_numbers[x] for x in model.species]
        after = np.array([solved[z] if z in labelled else e for z, e in zip(numbers, before)])
        model.set_reference_energies(after)  # (a pipeline stage that does not hold them leaves them)
        self.reference_note = self.reference_energies_line(
            f"fitted by least squares to the labels of {survey.energies.rows} training structures", after, before)

    def refit_reference_energies(self) -> None:
        """``model.reference_energies: refit``: add to each element's reference energy the least-squares fit of
        the starting model's energy residual (label − prediction) over the training structures to their
        element counts (as MACE's ``E0s: estimated`` fits the labels); elements absent from the training set
        keep theirs. The same numbers on every rank: each rank predicts its share, a batch at a time, and the
        shares' least squares are merged (``survey.energy_residuals``)."""
        from ase.data import atomic_numbers

        model, labelled = self.model, self.surveys[0].energies.rows
        batch_size = self.config["batch_size"]
        if self.pipeline is None:
            before = model.reference_energies()
            fit = energy_residuals(model, self.train_set, self.procs, batch_size, self.device) \
                if before is not None and labelled else None
        else:  # a stage holds only its parts: the starting model, whole, on rank 0 (once, before training)
            whole = self.build() if self.root else None
            before, fit = self.procs.bcast((whole.reference_energies(), energy_residuals(
                whole, self.train_set, None, batch_size, self.device) if labelled else None) if self.root else None)
            del whole
        if before is None:
            raise ConfigError(f"model.reference_energies: refit: this {type(model).__name__} has no per-element "
                              f"reference energies")
        if not labelled:
            raise ConfigError("model.reference_energies: refit needs training structures with energies")
        delta = fit.solve()  # [119] by atomic number; 0 for an element no labelled structure holds
        after = before + np.array([delta[atomic_numbers[x]] for x in model.species])
        model.set_reference_energies(after)  # (a pipeline stage that does not hold them leaves them)
        self.reference_note = self.reference_energies_line(
            f"refit by least squares on {labelled} training structures", after, before)

    # ------------------------------------------------------------------ state
    @property
    def evaluation_model(self):
        """The weights that are scored and saved: stage two's average once it holds one, else the EMA when there
        is one."""
        if self.average is not None and int(self.average.n_averaged) > 0:
            return self.average.module
        return self.ema.module if self.ema is not None else self.model

    # ------------------------------------------------------------------ stage two (MACE's; not a pipeline stage)
    def phase(self, steps: int) -> int:
        """The loss phase (1, or 2: stage two) of the training ``steps`` steps make: 2 once a step of epoch
        stage_two.start_epoch (counting from 1) has run; the step numbered s (from 0) is of phase ``phase(s + 1)``."""
        start = self.config["stage_two"]["start_epoch"]
        return 2 if start and steps > self.batches.first_step(start - 1) else 1

    def enter_phase(self, phase: int) -> None:
        """Set the loss rule of ``phase`` for the next step, and stage two's constant learning rate (times each
        parameter group's factor) where stage_two.lr is set."""
        self.strategy.rule = self.rules[phase - 1]
        lr = self.config["stage_two"]["lr"]
        if phase == 2 and lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group["lr_factor"]

    def scheduled(self) -> bool:
        """Whether the learning-rate schedule sets the rate now (not once stage two sets its own)."""
        return self.scheduler is not None and not (self.phase(self.step) == 2 and
                                                   self.config["stage_two"]["lr"] is not None)

    # ----------------------------------------------------------------- scoring
    def errors(self, net, structures, when: str) -> dict:
        """MAE/RMSE of ``net`` on ``structures`` (``training.error_table``); a non-finite prediction ends
        training, naming ``when``."""
        sums = self.strategy.error_sums(net, structures)
        bad = [q for k, q in enumerate(QUANTITIES)
               if sums[3 * k + 2] > 0 and not np.all(np.isfinite(sums[3 * k: 3 * k + 2]))]
        if bad:
            raise TrainingError(f"{when}: non-finite predicted {', '.join(bad)} on the {len(structures)} "
                                "evaluation structures")
        return error_table(sums)

    def validate(self, seconds: float) -> None:
        """Score the evaluation model on the validation set at this step: a metrics.csv row (its train_loss: the
        mean loss of the steps since the last row), the learning-rate schedule on plateau, best.pt when the
        validation loss is the lowest yet, last.pt (written last: a run killed before it redoes these steps)."""
        import torch

        self.model.eval()
        epoch = self.batches.epochs_done(self.step)
        errors = self.errors(self.evaluation_model, self.validation, f"epoch {epoch} (step {self.step})")
        if self.train_sample is not None:
            scored = self.errors(self.evaluation_model, self.train_sample, f"epoch {epoch} (step {self.step}), "
                                 "training errors")
            errors.update({f"train_{k}": v for k, v in scored.items()})
        phase = self.phase(self.step)
        rule = self.rules[phase - 1]
        val_loss = sum(rule[q] * errors[f"{q}_rmse"] ** 2 for q in QUANTITIES
                       if rule[q] > 0 and np.isfinite(errors[f"{q}_rmse"]))
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and self.scheduled():
            self.scheduler.step(val_loss)
        if phase == 2 and (not self.rows or self.phase(self.rows[-1]["step"]) == 1):
            self.best = float("inf")  # stage two's validation losses (of its weights) are compared among themselves
        self.rows.append(dict(epoch=epoch, step=self.step, train_loss=self.pending[0] / max(self.pending[1], 1),
                              val_loss=val_loss, lr=self.lr, seconds=seconds, **errors))
        self.pending = [0.0, 0]
        improved = val_loss < self.best
        self.best = min(self.best, val_loss)
        if self.root:
            write_metrics(self.directory, self.rows)
            self.loggers.log(self.rows[-1])
        if improved:
            self.save(self.directory / "best.pt", self.step)
        self.save(self.last_path, self.step)
        self.last_written = f"{self.last_path} ({self.position(self.step)})"

    def stalled(self) -> bool:
        """Early stopping: each of the last ``early_stopping.patience`` validations' loss is no lower than the best
        before them (from the metric rows alone, which a resumed run restores: exact under resume)."""
        patience = self.config["early_stopping"]["patience"]
        rows = [row for row in self.rows if self.phase(row["step"]) == self.phase(self.step)]  # this phase's
        if not patience or len(rows) <= patience:
            return False
        best_before = min(row["val_loss"] for row in rows[:-patience])
        return all(row["val_loss"] >= best_before for row in rows[-patience:])

    def progress_count(self, total: bool = False):
        """The progress bar's count now (``total``: its (total, initial, unit)): epochs where validation ends
        each epoch and the run ends with one, else steps."""
        by_epoch = not self.config["validate_every"] and self.batches.locate(self.total_steps)[1] == 0
        if total:
            return ((self.batches.locate(self.total_steps)[0], self.batches.locate(self.step)[0], "epoch") if by_epoch
                    else (self.total_steps, self.step, "step"))
        return self.batches.locate(self.step)[0] if by_epoch else self.step

    # -------------------------------------------------------------------- run
    def fit(self) -> list:
        """Train ``epochs`` epochs (from where a resumed run stopped); write checkpoints, metrics.csv, the
        learning curve; score the test set with best.pt. Returns the metric rows (every rank). An output
        file that cannot be written raises OutputError naming it, the reason and the last checkpoint; a structure
        that cannot be read (the files changed since start-up) DataErrorMidRun, naming it and the last checkpoint."""
        try:
            return self._fit()
        except OutputError as exc:
            raise OutputError(f"{exc}; last checkpoint written: {self.last_written}") from None
        except DataError as exc:
            raise DataErrorMidRun(f"{exc}; training stopped; last checkpoint written: {self.last_written}") from None

    def _fit(self) -> list:
        bar = self._announce()
        self.procs.barrier()  # the output directory exists before any rank writes into it
        self._loop(bar)
        self._finish(bar)
        return self.rows

    def _announce(self):
        """Rank 0: the output directory (and the pipeline's layout), the metric loggers, and the log's opening lines;
        returns its progress bar (None on the other ranks)."""
        import torch

        config, procs, section = self.config, self.procs, self.config["model"]
        count = np.array([float(sum(p.numel() for p in self.strategy.parameters)),  # trained, of all weights:
                          float(sum(p.numel() for _, p in self.model.named_weights()))])  # the whole model ...
        if self.pipeline is not None:  # ... or a stage's parts: add the stages of one replica
            count = procs.sum(count) / self.pipeline.replicas
        if not self.root:
            return None
        with naming_errors(self.directory):
            self.directory.mkdir(parents=True, exist_ok=True)
        if self.pipeline is not None:
            with naming_errors(self.shards):
                self.shards.mkdir(exist_ok=True)
            with atomic_write(self.shards / "layout.json", "w") as f:
                json.dump({"stages": self.pipeline.stages, "boundaries": self.pipeline.boundaries}, f)
        self.loggers = MetricLoggers(config["output"], self.directory, self.step, config)
        bar = Progress("mlip-train", *self.progress_count(total=True), None if config["output"]["progress"] else
                       "off", every_seconds=0)
        layout = f", stages at blocks {self.pipeline.boundaries}" if self.pipeline is not None else ""
        start = "" if self.starting is None else f" from {self.starting} {section[self.starting]}" + "".join(
            f" ({key} {value})" for key, value in section_options(section, self.starting).items())
        trained = f"{int(count[0])} parameters" if count[0] == count[1] else \
            f"{int(count[0])} of {int(count[1])} parameters trained (model.freeze {section['freeze']})"
        if self.lora is not None:
            trained = (f"{int(count[1] - count[0])} parameters fixed, {int(count[0])} parameters of LoRA "
                       f"updates trained (rank {self.lora['rank']}, alpha {self.lora['alpha']:g}, on "
                       f"{len(self.lora['adapted'])} weights)")
        print(f"mlip-train: {type(self.model).__name__}{start} {species_text(self.model.species)}, {trained}, "
              f"{self.training_count()} training / {len(self.validation)} validation / {len(self.test)} test "
              f"structures\nmlip-train: {procs.size} rank(s) x {torch.get_num_threads()} thread(s), "
              f"{procs.parallel} parallel{layout}\n{self.data_note}", flush=True)
        if self.reference_note:
            print(self.reference_note, flush=True)
        return bar

    def _loop(self, bar) -> None:
        """The optimizer steps to the end (or an early stop), validating and writing checkpoints on the way."""
        import torch

        config, procs, root = self.config, self.procs, self.root
        every, checkpoint_every = config["validate_every"], config["output"]["checkpoint_every"]
        start = time.perf_counter()
        last = self.step if self.stalled() else self.total_steps  # (a run that stopped early, resumed: no step)
        batches = global_batches(self.train_set, self.batches, self.step, last, config["data"]["workers"],
                                 self.strategy.reads,
                                 self.model.cutoff if self.strategy.builds_edges else None)
        epoch = self.batches.locate(self.step)[0]
        for global_batch in batches:
            phase = self.phase(self.step + 1)
            if phase == 2 and self.phase(self.step) == 1 and root:
                two = config["stage_two"]
                lr = "" if two["lr"] is None else f", learning rate {two['lr']:g}"
                print(f"mlip-train: stage two from {self.position(self.step)}: loss weights " + ", ".join(
                      f"{q} {self.rules[1][q]:g}" for q in QUANTITIES) + lr, flush=True)
            self.enter_phase(phase)
            self.model.train()
            self.optimizer.zero_grad(set_to_none=False)
            self.pending[0] += self.strategy.step(global_batch, self.optimizer, epoch + 1)
            self.pending[1] += 1
            self.lr = self.optimizer.param_groups[0]["lr"]  # this step's
            self.step += 1
            if self.ema is not None:
                self.ema.update_parameters(self.model)
            if isinstance(self.scheduler, torch.optim.lr_scheduler.LambdaLR) and self.scheduled():
                self.scheduler.step()
            epoch, within = self.batches.locate(self.step)  # of the next step
            epoch_ends = within == 0
            if self.average is not None and epoch_ends and self.phase(self.step) == 2:
                self.average.update_parameters(self.model)
            if (self.step % every == 0 if every else epoch_ends) or self.step == self.total_steps:
                self.validate(time.perf_counter() - start)
                start = time.perf_counter()
                if root:
                    bar.update(self.progress_count(), val_loss=f"{self.rows[-1]['val_loss']:.3g}",
                               E_mae=f"{self.rows[-1]['energy_mae'] * 1e3:.1f} meV/atom",
                               F_mae=f"{self.rows[-1]['forces_mae'] * 1e3:.1f} meV/A")
                procs.barrier()
                if self.stalled():
                    break
            elif checkpoint_every and self.step % checkpoint_every == 0:
                self.save(self.last_path, self.step)
                self.last_written = f"{self.last_path} ({self.position(self.step)})"
        batches.close()  # (after an early stop: the read-ahead workers end now)

    def _finish(self, bar) -> None:
        """The closing lines, the learning curve, and the test set scored with best.pt."""
        import potentials

        config, procs, root = self.config, self.procs, self.root
        if root:
            bar.close()
            if self.stalled():
                best = min(self.rows, key=lambda row: row["val_loss"])
                print(f"mlip-train: stopped early at {self.position(self.step)}: {config['early_stopping']['patience']}"
                      f" validations without a lower validation loss than {best['val_loss']:.6g} (step "
                      f"{best['step']}, best.pt)", flush=True)
            plot_learning_curve(self.directory, self.rows)
            self.loggers.close()
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
