"""What a training run writes and prints: OUTPUT/metrics.csv (one row per validation, atomically), the learning
curve (OUTPUT/learning_curve.png) and the error table of a scored model."""
from __future__ import annotations

import csv
from pathlib import Path

from potentials.files import atomic_write

METRIC_COLUMNS = ("epoch", "step", "train_loss", "val_loss", "energy_mae", "energy_rmse", "forces_mae", "forces_rmse",
                  "stress_mae", "stress_rmse", "lr", "seconds")


def write_metrics(directory: Path, rows) -> None:
    """OUTPUT/metrics.csv (atomically: a kill leaves the previous file): one row per validation (each epoch's end,
    or every ``validate_every`` steps; ``epoch``: the epochs done, a fraction mid-epoch)."""
    with atomic_write(directory / "metrics.csv", "w", newline="") as f:
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
