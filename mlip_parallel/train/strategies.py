"""How a training step is shared over the ranks (docs/architecture.md §5), three strategies with one interface:

* ``DataParallel``: every rank a share of each global batch (one process is the case of one rank);
* ``GraphParallel``: every structure decomposed by space over the ranks, the loss back-propagated
  through the halo;
* ``PipelineParallel``: the model's blocks over stages (``pipeline.PipelineTrainer``, built by
  ``pipeline_trainer``).

A strategy's ``step(global_batch, optimizer, epoch)`` computes the gradients, clips them and takes the
optimizer step, returning the loss; ``error_sums(net, structures)`` scores a model (summed over ranks);
``state_dict`` / ``load_state_dict`` carry its own resume state (2BW's stale weights)."""
from __future__ import annotations

import numpy as np

from ..config import ConfigError


def pipeline_trainer(config, procs, build, train_set, weights, resume_layout):
    """The ``PipelineTrainer`` of this rank (its stage's model: ``trainer.model``); ``weights`` {quantity: the
    largest weight of any stage of training} (an energy-only loss needs no force sweeps). On resume the stage
    layout of the interrupted run (``resume_layout``) is kept; a different one is refused."""
    from .pipeline import PipelineError, PipelineTrainer  # (torch: at first use)

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


class DataParallel:
    """Each rank takes structures rank, rank + P, … of every global batch; gradients are summed over ranks
    (one process: P = 1). Validation and test: each rank scores its share."""

    def __init__(self, procs, model, device, config, rule):
        self.procs, self.model, self.device = procs, model, device
        self.rule, self.clip, self.batch_size = rule, config["optimizer"]["gradient_clip"], config["batch_size"]
        self.parameters = [p for p in model.parameters() if p.requires_grad]

    def gradients(self, global_batch, epoch) -> float:
        # (torch: at first use)
        from .training import Batch, Counts, TrainingError, batch_gradients, nonfinite_structures

        procs = self.procs
        mine = list(global_batch[procs.rank::procs.size])  # only this rank's share is read (a streamed set)
        counts = Counts.of_sums(procs.sum(Counts.sums(mine)))  # the global batch's, from the shares
        value, bad = 0.0, []
        if mine:
            batch = Batch(mine, self.model, self.device)
            loss, predictions = batch_gradients(self.model, batch, counts, self.rule, self.parameters)
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

        from .training import TrainingError  # (torch: at first use)

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

    builds_edges = True  # a step's graphs are Batches of whole structures (their cached neighbour lists)

    def reads(self, positions):
        """The positions of a global batch whose structures this rank reads in a step."""
        return positions[self.procs.rank::self.procs.size]

    def error_sums(self, net, structures) -> np.ndarray:
        from .training import error_sums  # (torch: at first use)

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
        from .training import Counts, TrainingError, graph_parallel_loss, total_loss  # (torch: at first use)

        value, counts = 0.0, Counts.of(global_batch)
        for s in global_batch:
            surrogate, terms = graph_parallel_loss(self.model, s, self.rule, counts, self.procs.backend)
            surrogate.backward(inputs=self.parameters)
            loss = total_loss(terms, self.rule)
            if not np.isfinite(loss):  # terms are global: every rank agrees
                raise TrainingError(f"epoch {epoch}: the loss of {s.source} is not finite")
            value += loss
        return value

    def share(self, structures) -> list:
        return structures if self.procs.rank == 0 else []

    builds_edges = False  # each structure is decomposed over the ranks: no whole-structure neighbour list

    def reads(self, positions):
        return positions


class PipelineParallel:
    """The model's blocks over pipeline stages (``pipeline.PipelineTrainer``; ``model`` holds this stage's
    parts), data parallel across replicas; validation and test are pipelined evaluations. Once the
    trainer has measured its sweep costs, rank 0 prints the schedule of a full global batch once, with
    its predicted step time."""

    def __init__(self, pipeline, config, rule):
        self.pipeline, self.model = pipeline, pipeline.model
        self.rule, self.clip, self.batch_size = rule, config["optimizer"]["gradient_clip"], config["batch_size"]
        self.parameters = pipeline.parameters
        self.reported = False

    def step(self, global_batch, optimizer, epoch) -> float:
        from .training import TrainingError  # (torch: at first use)

        try:
            loss = self.pipeline.step(global_batch, self.rule, optimizer, self.clip)
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

    builds_edges = True

    def reads(self, positions):
        return positions[self.pipeline.replica::self.pipeline.replicas]  # this replica's share (every stage of it)

    def state_dict(self) -> dict:
        return self.pipeline.state_dict()

    def load_state_dict(self, state) -> None:
        self.pipeline.load_state_dict(state)
