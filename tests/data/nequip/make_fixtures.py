"""Make the nequip-framework fixtures of the test suite: a NequIP model with ZBL and an Allegro model,
each trained for one epoch by ``nequip-train`` on a few EMT-labelled Cu/Ag structures (the weights only
need to be the framework's own, not good), in float64, saved as the framework saves them: the training
checkpoint ``NAME.ckpt`` and the package ``NAME.nequip.zip`` (``nequip-package build``).

Run it in the project's environment (the ``nequip`` extra: nequip >= 0.19, nequip-allegro >= 0.8):

    python tests/data/nequip/make_fixtures.py      # writes tests/data/nequip/{nequip-zbl,allegro}.{ckpt,nequip.zip}

The tests compute their references with the framework's own ASE calculator, so no outputs are stored.
The CI does not run this script.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io import write

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def labelled_structures(path: Path, count: int = 12) -> None:
    """``count`` rattled, strained 32-atom fcc Cu/Ag cells with ASE EMT's energy, forces and stress."""
    rng = np.random.default_rng(0)
    frames = []
    for k in range(count):
        atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat(2)
        atoms.numbers[rng.random(len(atoms)) < 0.4] = 47
        atoms.set_cell(atoms.cell[:] * rng.uniform(0.97, 1.03), scale_atoms=True)
        atoms.rattle(0.1, seed=k)
        atoms.calc = EMT()
        atoms.calc = SinglePointCalculator(atoms, energy=atoms.get_potential_energy(), forces=atoms.get_forces(),
                                           stress=atoms.get_stress())
        frames.append(atoms)
    write(path, frames)


def config(data: Path, model: dict) -> dict:
    """A hydra config for one epoch of nequip-train on ``data`` (float64, Cu and Ag, r_max 4.5 Å)."""
    loader = {"_target_": "torch.utils.data.DataLoader", "batch_size": 4}
    species = ["Cu", "Ag"]
    transforms = [
        {"_target_": "nequip.data.transforms.ChemicalSpeciesToAtomTypeMapper", "model_type_names": species,
         "chemical_species_to_atom_type_map": {s: s for s in species}},
        {"_target_": "nequip.data.transforms.NeighborListTransform", "r_max": 4.5},
    ]
    return {
        "run": ["train"], "seed": 3,
        "data": {"_target_": "nequip.data.datamodule.ASEDataModule", "seed": 3,
                 "split_dataset": {"file_path": str(data), "train": 8, "val": 4}, "transforms": transforms,
                 "train_dataloader": loader, "val_dataloader": loader,
                 "stats_manager": {"_target_": "nequip.data.CommonDataStatisticsManager", "type_names": species}},
        "trainer": {"_target_": "lightning.Trainer", "max_epochs": 1, "enable_progress_bar": False,
                    "logger": False, "enable_checkpointing": True,
                    "callbacks": [{"_target_": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "dirpath": "${hydra:runtime.output_dir}", "filename": "last",
                                   "save_last": False}]},
        "training_module": {
            "_target_": "nequip.train.EMALightningModule",
            "loss": {"_target_": "nequip.train.EnergyForceStressLoss", "per_atom_energy": True,
                     "coeffs": {"total_energy": 1.0, "forces": 1.0, "stress": 1.0}},
            "val_metrics": {"_target_": "nequip.train.EnergyForceStressMetrics",
                            "coeffs": {"total_energy_mae": 1.0, "forces_mae": 1.0, "stress_mae": 1.0}},
            "optimizer": {"_target_": "torch.optim.Adam", "lr": 0.01},
            "model": {"seed": 3, "model_dtype": "float64", "type_names": species, "r_max": 4.5,
                      "avg_num_neighbors": "${training_data_stats:num_neighbors_mean}",
                      "per_type_energy_shifts": "${training_data_stats:per_atom_energy_mean}",
                      "per_type_energy_scales": "${training_data_stats:forces_rms}", **model},
        },
    }


MODELS = {
    # NequIP, l_max 2, three interaction blocks (ghost exchanges before blocks 1 and 2), ZBL core repulsion
    "nequip-zbl": {"_target_": "nequip.model.NequIPGNNModel", "l_max": 2, "num_layers": 3, "num_features": 8,
                   "radial_mlp_depth": 1, "radial_mlp_width": 16,
                   "pair_potential": {"_target_": "nequip.nn.pair_potential.ZBL", "units": "metal",
                                      "chemical_species": ["Cu", "Ag"]}},
    # Allegro, l_max 2, two layers: strictly local (one r_max of receptive field)
    "allegro": {"_target_": "allegro.model.AllegroModel", "l_max": 2, "num_layers": 2, "num_scalar_features": 16,
                "num_tensor_features": 4, "allegro_mlp_hidden_layers_width": 16,
                "readout_mlp_hidden_layers_width": 8,
                "radial_chemical_embed": {"_target_": "allegro.nn.TwoBodyBesselScalarEmbed", "num_bessels": 8}},
}


def train_and_package(name: str, model: dict, directory: Path, work: Path) -> None:
    """One epoch of nequip-train for ``model`` (a ``training_module.model`` section) on EMT data, in
    ``work``; writes ``directory/NAME.ckpt`` and ``directory/NAME.nequip.zip``."""
    if not (work / "emt.extxyz").exists():
        labelled_structures(work / "emt.extxyz")
    (work / f"{name}.yaml").write_text(yaml.safe_dump(config(work / "emt.extxyz", model)))
    run = work / f"run-{name}"
    subprocess.run([str(BIN / "nequip-train"), "-cp", str(work), "-cn", name, f"hydra.run.dir={run}"],
                   check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    shutil.copy(run / "last.ckpt", directory / f"{name}.ckpt")
    subprocess.run([str(BIN / "nequip-package"), "build", str(directory / f"{name}.ckpt"),
                    str(directory / f"{name}.nequip.zip")], check=True, capture_output=True)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in MODELS.items():
            train_and_package(name, model, HERE, Path(tmp))
            print(f"{name}: {os.path.getsize(HERE / f'{name}.ckpt') / 1e3:.0f} kB checkpoint, "
                  f"{os.path.getsize(HERE / f'{name}.nequip.zip') / 1e3:.0f} kB package")


if __name__ == "__main__":
    main()
