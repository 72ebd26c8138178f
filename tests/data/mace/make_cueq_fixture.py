"""Make ``mace-cueq-f64.model``: a MACE model that ``mace_run_train --enable_cueq True`` trained with
cuEquivariance's layers and wrote back in e3nn form (MACE's ``run_cueq_to_e3nn``, as its training does before
saving), the file a user of MACE's accelerated training brings. The suite loads it and compares it with
``MACECalculator`` on the same file; cuEquivariance is needed only here (its pure-torch layers run on a CPU).

Run it in the project's environment with cuEquivariance on the path (not installed by the suite):

    pip install --target /tmp/cueq --no-deps cuequivariance==0.13.0 cuequivariance-torch==0.13.0
    PYTHONPATH=/tmp/cueq python tests/data/mace/make_cueq_fixture.py     # ~1 min on one core

One epoch on 14 EMT-labelled Cu structures (examples/generate_cu_emt_data.py --quick), float64, a small
architecture (8x0e + 8x1o, max_ell 2, correlation 2) so that the file stays small. The CI does not run this.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..")
NAME = "mace-cueq-f64"


def main():
    importlib.import_module("cuequivariance_torch")  # fails here, not inside MACE's training, when absent
    from ase.io import write

    spec = importlib.util.spec_from_file_location("generator", os.path.join(ROOT, "examples",
                                                                            "generate_cu_emt_data.py"))
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    with tempfile.TemporaryDirectory() as work:
        frames = generator.generate(seed=0, quick=True)
        for atoms in frames:  # the labels under the names mace_run_train reads by default
            atoms.info["REF_energy"], atoms.arrays["REF_forces"] = atoms.get_potential_energy(), atoms.get_forces()
            atoms.info["REF_stress"] = atoms.get_stress()
            atoms.calc = None
        write(os.path.join(work, "train.xyz"), frames, format="extxyz")
        command = [sys.executable, "-c", "from mace.cli.run_train import main; main()", "--name", NAME,
                   "--train_file", "train.xyz", "--valid_fraction", "0.2", "--E0s", "average", "--model", "MACE",
                   "--hidden_irreps", "8x0e + 8x1o", "--max_ell", "2", "--correlation", "2", "--r_max", "4.0",
                   "--num_radial_basis", "4", "--num_interactions", "2", "--batch_size", "2",
                   "--valid_batch_size", "2", "--max_num_epochs", "1", "--device", "cpu",
                   "--default_dtype", "float64", "--seed", "1", "--enable_cueq", "True"]
        done = subprocess.run(command, cwd=work, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        log = done.stdout + done.stderr
        if done.returncode != 0 or "CUEQ TO E3NN" not in log:
            sys.exit(f"mace_run_train did not train with cuEquivariance and convert back:\n{log[-3000:]}")
        shutil.copy(os.path.join(work, f"{NAME}.model"), os.path.join(HERE, f"{NAME}.model"))
    print(f"{NAME}.model: {os.path.getsize(os.path.join(HERE, f'{NAME}.model')) / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
