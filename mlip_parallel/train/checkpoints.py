"""The checkpoints of an ``mlip-train`` run (``Checkpoints``, a part of the ``Trainer``): best.pt and last.pt
(ordinary potentials checkpoints of the evaluation model, written atomically; last.pt with the training state for
an exact ``resume``; in pipeline mode assembled part by part from the stages, each stage's state in its own shard),
the package's own file of a fine-tuned model beside best.pt, and reading them back on resume."""
from __future__ import annotations

import csv
from pathlib import Path

from potentials.files import atomic_write

from ..config import ConfigError


def read_checkpoint(path, device, mmap: bool = False) -> dict:
    """``torch.load`` of a checkpoint to resume from (tensors only: ``weights_only``), a missing, damaged or cut-short
    file one ConfigError naming it. Read whole (not ``mmap``), every record is first checked against the CRC-32 its
    archive holds: torch reads a tensor whose bytes changed without a word."""
    import pickle
    import zipfile

    import torch

    damaged = None
    try:
        if not mmap:
            with zipfile.ZipFile(path) as archive:
                damaged = archive.testzip()
        if damaged is None:
            return torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except FileNotFoundError as exc:
        raise ConfigError(f"resume: cannot read {path}: {exc.strerror}") from None
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        reason = "its pickled data is damaged" if isinstance(exc, pickle.UnpicklingError) else \
            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        raise ConfigError(f"resume: {path} is not a whole checkpoint (damaged or cut short?): {reason}") from None
    raise ConfigError(f"resume: {path} is not a whole checkpoint (damaged or cut short?): its record {damaged} "
                      "fails its checksum")


class Checkpoints:
    """The Trainer's checkpoint I/O (reads the Trainer's model, optimizer, schedule, EMA, strategy and paths)."""

    def training_state(self, step: int) -> dict:
        """Everything an exact resume after ``step`` optimizer steps needs (the data order follows from the step)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step,
                "best": self.best, "pending": list(self.pending),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
                "ema": self.ema.state_dict() if self.ema is not None else {},
                "average": self.average.state_dict() if self.average is not None else {},
                "pipeline": self.strategy.state_dict()}

    def shard(self, step: int) -> Path:
        """This pipeline stage's resume state after ``step`` optimizer steps (written by replica 0)."""
        return self.shards / f"stage{self.pipeline.stage.stage}.step{step}.pt"

    def saved_step(self) -> int:
        """The step of the last complete last.pt (rank 0 reads it, memory-mapped; every rank gets it)."""
        step = None
        if self.root:
            try:
                step = int(read_checkpoint(self.last_path, "cpu", mmap=True)["step"])
            except KeyError:
                step = (f"resume: {self.last_path} was written by an older mlip-train that counted epochs, not steps: "
                        "start a new run from it with model.checkpoint")
            except ConfigError as exc:
                step = str(exc)
        step = self.procs.bcast(step)
        if isinstance(step, str):
            raise ConfigError(step)
        return step

    def load_state(self) -> None:
        """Continue the run in the output directory from its last complete last.pt: its training state
        (pipeline: this stage's shard of last.pt's step; last.pt is written after every stage's shard)."""
        path = self.shard(self.saved_step()) if self.pipeline is not None else self.last_path
        try:
            state = read_checkpoint(path, self.device)["training"]
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except ConfigError:
            raise
        except KeyError:
            raise ConfigError(f"resume: {path} holds no training state: not a last.pt of mlip-train") from None
        except (RuntimeError, ValueError) as exc:  # another model's weights, another optimizer's state
            raise ConfigError(f"resume: {path} does not fit this run's model and optimizer: "
                              f"{(str(exc).splitlines() or [''])[0]}") from None
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        if self.average is not None:
            if not state.get("average"):
                raise ConfigError(f"resume: {path} holds no stage-two weight average: resume with the run's "
                                  "stage_two.average")
            self.average.load_state_dict(state["average"])
        self.strategy.load_state_dict(state["pipeline"])
        if "step" not in state:
            raise ConfigError(f"resume: {path} was written by an older mlip-train that counted epochs, not steps: "
                              "start a new run from it with model.checkpoint")
        self.step, self.best, self.pending = int(state["step"]), float(state["best"]), list(state["pending"])
        try:
            with open(self.directory / "metrics.csv") as f:
                rows = [{k: int(v) if k == "step" else float(v) for k, v in r.items()} for r in csv.DictReader(f)]
        except FileNotFoundError:  # last.pt of a checkpoint_every step before the first validation: no row yet
            rows = []
        except (OSError, ValueError) as exc:
            raise ConfigError(f"resume: cannot read {self.directory / 'metrics.csv'}: {exc}") from None
        rows = [{**r, "epoch": self.batches.epochs_done(r["step"])} for r in rows if r["step"] <= self.step]
        # metrics.csv is written before the checkpoints of its step: it may hold rows past last.pt's, never fewer
        if self.pending[1] == 0 and self.step and (not rows or rows[-1]["step"] != self.step):
            raise ConfigError(f"resume: {self.directory / 'metrics.csv'} holds no row of step {self.step} of {path}: "
                              "not this run's metrics")
        self.rows = rows

    def save(self, path, step: int) -> None:
        """Write ``path`` (an ordinary potentials checkpoint of the evaluation model, atomically) from rank
        0; in pipeline mode collectively, assembled from the stages' parts. Saving last.pt in pipeline mode,
        each stage first writes its resume shard of ``step``, and removes its older ones once last.pt is
        complete: a resume finds every stage's shard of last.pt's step."""
        import potentials
        from potentials.lora import merged  # (torch: at first use)

        if self.pipeline is None:
            if self.root:
                model = merged(self.evaluation_model)  # (LoRA: the updates added into the weights)
                potentials.save(model, path, extra={"training": self.training_state(step)})
                native = model.native_file("best") if path == self.directory / "best.pt" else None
                if native is not None:  # and in the package's own format, for its own tools
                    model.save_native(self.directory / native, data=self.config["data"]["train"])
            return
        last = path == self.last_path
        if self.pipeline.replica == 0 and last:
            import torch
            with atomic_write(self.shard(step)) as f:
                torch.save({"training": self.training_state(step)}, f)
        self.pipeline.save_merged(path, self.evaluation_model, extra={"step": step})
        native = self.model.native_file("best") if path == self.directory / "best.pt" else None
        if native is not None and self.root:  # the package's own format, from the merged file (weight by weight)
            from potentials.checkpoint import save_native_from  # (torch: at first use)

            save_native_from(path, self.directory / native, data=self.config["data"]["train"])
        if self.pipeline.replica == 0 and last:
            for old in self.shards.glob(f"stage{self.pipeline.stage.stage}.step*.pt"):
                if old != self.shard(step):
                    old.unlink(missing_ok=True)
