"""The checkpoints of an ``mlip-train`` run (``Checkpoints``, a part of the ``Trainer``): best.pt and last.pt
(ordinary potentials checkpoints of the evaluation model, written atomically; last.pt with the training state for
an exact ``resume``; in pipeline mode assembled part by part from the stages, each stage's state in its own shard),
the package's own file of a fine-tuned model beside best.pt, and reading them back on resume."""
from __future__ import annotations

import csv
from pathlib import Path

from ..config import ConfigError


class Checkpoints:
    """The Trainer's checkpoint I/O (reads the Trainer's model, optimizer, schedule, EMA, strategy and paths)."""

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
