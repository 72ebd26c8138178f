"""What a training run writes and prints: OUTPUT/metrics.csv (one row per validation, atomically), the learning
curve (OUTPUT/learning_curve.png), TensorBoard and W&B logs, and the error table of a scored model."""
from __future__ import annotations

import csv
from pathlib import Path

from potentials.files import atomic_write

from ..config import ConfigError

ERROR_COLUMNS = ("energy_mae", "energy_rmse", "forces_mae", "forces_rmse", "stress_mae", "stress_rmse")
# the validation set's errors, then the training subset's (training_errors; NaN: none scored)
METRIC_COLUMNS = ("epoch", "step", "train_loss", "val_loss", *ERROR_COLUMNS, *(f"train_{k}" for k in ERROR_COLUMNS),
                  "lr", "seconds")


def write_metrics(directory: Path, rows) -> None:
    """OUTPUT/metrics.csv (atomically: a kill leaves the previous file): one row per validation (each epoch's end,
    or every ``validate_every`` steps; ``epoch``: the epochs done, a fraction mid-epoch)."""
    with atomic_write(directory / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=METRIC_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, float("nan")) for k in METRIC_COLUMNS})  # (a resumed older run's rows)


class MetricLoggers:
    """The metric rows sent on to TensorBoard (``output.tensorboard``: event files in OUTPUT/tensorboard, through
    ``torch.utils.tensorboard``) and Weights & Biases (``output.wandb: {project, mode}``: a run in OUTPUT/wandb,
    offline unless ``mode`` — else WANDB_MODE, else "online" where WANDB_API_KEY is set — says otherwise; its id
    kept in OUTPUT/wandb_id, so a resumed run continues it). Each scalar is logged at its row's step; a run resumed
    at step S first drops what a killed run logged after S. ConfigError where the package is missing. Rank 0's."""

    @staticmethod
    def check(output: dict) -> None:
        """ConfigError for an ``output.wandb`` section of other keys, or a logger whose package is missing (before
        anything is written, on every rank)."""
        import importlib.util

        if output["tensorboard"] and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("output.tensorboard: needs the tensorboard package (pip install tensorboard)")
        if output["wandb"] is not None:
            settings = output["wandb"]
            if set(settings) - {"project", "mode", "name"} or not isinstance(settings.get("project"), str) or \
                    settings.get("mode") not in (None, "offline", "online"):
                raise ConfigError(f"output.wandb: {{project: NAME, mode: offline | online, name: RUN}} (project "
                                  f"required), got {settings}")
            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("output.wandb: needs the wandb package (pip install wandb)")

    def __init__(self, output: dict, directory: Path, step: int, config: dict):
        import os
        import secrets

        self.board, self.run = None, None
        if output["tensorboard"]:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(log_dir=str(directory / "tensorboard"), purge_step=step + 1 if step else None)
        if output["wandb"] is not None:
            import wandb

            settings = output["wandb"]
            mode = settings.get("mode") or os.environ.get("WANDB_MODE") or \
                ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            id_file = directory / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
            id_file.write_text(run_id)
            from potentials.process import process_kept  # (torch: at first use)

            self.kept = process_kept(warning_filters=True)  # wandb's service variable and warning filters: until
            self.kept.__enter__()  # the run is finished (close), then put back
            self.run = wandb.init(project=settings["project"], name=settings.get("name"), mode=mode, id=run_id,
                                  resume="allow", dir=str(directory), config=config)

    def log(self, row: dict) -> None:
        values = {k: row[k] for k in METRIC_COLUMNS if k in row and k not in ("step", "seconds")}
        if self.board is not None:
            for k, v in values.items():
                self.board.add_scalar(k, v, row["step"])
            self.board.flush()
        if self.run is not None:
            self.run.log(values, step=row["step"])

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.run is not None:
            self.run.finish()
            self.kept.__exit__(None, None, None)


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
    with atomic_write(directory / "learning_curve.png") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def format_errors(errors: dict) -> str:
    units = {"energy": ("meV/atom", 1e3), "forces": ("meV/Å", 1e3), "stress": ("meV/Å³", 1e3)}
    lines = [f"{'quantity':10s} {'MAE':>12s} {'RMSE':>12s}  unit"]
    for q, (unit, factor) in units.items():
        lines.append(f"{q:10s} {factor * errors[f'{q}_mae']:12.4g} {factor * errors[f'{q}_rmse']:12.4g}  {unit}")
    return "\n".join(lines)


def species_text(species) -> str:
    """A model's elements for a log line: the list, or their number where there are more than ten."""
    return str(species) if species is None or len(species) <= 10 else f"({len(species)} elements)"
