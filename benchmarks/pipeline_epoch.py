"""`mlip-train` seconds per epoch, one process against a 2-stage pipeline (`parallel: pipeline`,
`pipeline.schedule: auto`), run alternately so that both see the same machine:

* the data: ``--structures`` rattled 256-atom fcc Cu cells labelled by ASE's EMT (10 % of them
  validation), written to a temporary extxyz file; the default 80 make nine full global batches per
  epoch, so that the first epoch holds auto's five timed warm-up steps (with 18 training structures,
  two full batches per epoch, the next two epochs held three of them, two on split sweeps);
* the model: SchNet, 8 blocks, F=64, cutoff 4.5 Å, float32; energy + force + stress loss; global batch
  8, M=8 micro-batches, AdamW, EMA;
* each run: ``--epochs`` epochs, one torch thread per rank; the table gives each run's seconds per
  epoch after the first (the first holds the start-up), and per pair of runs the ratio;
* ``--allocator kept`` (mlip-train's default, ``keep_freed_memory: true``): glibc's malloc keeps freed
  tensors' memory for reuse; ``glibc``: its defaults, under which a step's large tensors go back to the
  system and page-fault in again (``keep_freed_memory: false``); ``both``: the two, one after the other.

    python benchmarks/pipeline_epoch.py [--pairs 3] [--epochs 3] [--structures 80] [--allocator kept|glibc|both]
"""
import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

from common import ROOT, cu_emt_frames, launcher_command


def config(data, directory, epochs, parallel, keep_freed_memory):
    return {"keep_freed_memory": keep_freed_memory, "data": {"train": str(data), "validation_fraction": 0.1},
            "model": {"name": "SchNet", "cutoff": 4.5, "hyperparameters": {"features": 64, "layers": 8},
                      "dtype": "float32"},
            "loss": {"energy_weight": 1.0, "forces_weight": 10.0, "stress_weight": 1.0},
            "schedule": {"name": "none"}, "epochs": epochs, "batch_size": 8, "seed": 0, "parallel": parallel,
            "pipeline": {"stages": 2, "microbatches": 8, "schedule": "auto"},
            "output": {"directory": str(directory), "overwrite": True}}


def run(ranks, job, env) -> tuple:
    """(seconds of each epoch, the schedule line mlip-train printed) of one run."""
    cmd = ([sys.executable] if ranks == 1 else launcher_command(ranks)) + ["-m", "mlip_parallel.train.cli", str(job)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    directory = Path(yaml.safe_load(job.read_text())["output"]["directory"])
    with open(directory / "metrics.csv") as f:
        seconds = [float(row["seconds"]) for row in csv.DictReader(f)]
    schedule = [line for line in proc.stdout.splitlines() if "pipeline schedule" in line]
    return seconds, schedule[0].split("mlip-train: ")[-1] if schedule else ""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="alternating (one process, pipeline) pairs of runs")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--structures", type=int, default=80, help="structures in the data set (10 %% validation)")
    parser.add_argument("--allocator", choices=("kept", "glibc", "both"), default="kept")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first epoch holds the start-up and is left out)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in [k for k in env if k.startswith("MALLOC_")]:
        env.pop(key)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from ase.io import write
        write(tmp / "cu256.extxyz", cu_emt_frames(args.structures, 256), format="extxyz")
        for allocator in ("kept", "glibc") if args.allocator == "both" else (args.allocator,):
            compare(tmp, args, allocator, env)


def compare(tmp, args, allocator, env):
    """Alternate one-process and S=2 runs, ``args.pairs`` times; print each pair's seconds per epoch."""
    jobs = {}
    for ranks, parallel in ((1, "data"), (2, "pipeline")):
        jobs[ranks] = tmp / f"{parallel}.yaml"
        jobs[ranks].write_text(yaml.safe_dump(config(tmp / "cu256.extxyz", tmp / parallel, args.epochs, parallel,
                                                     allocator == "kept")))
    train = args.structures - round(0.1 * args.structures)
    print(f"mlip-train, SchNet 8 blocks F=64, {train} training / {args.structures - train} validation structures "
          f"of 256 Cu atoms, batch 8, M=8, {args.epochs} epochs; allocator: {allocator}")
    print(f"{'pair':>4s} {'one process s/epoch':>20s} {'S=2 s/epoch':>12s} {'speed-up':>8s}  schedule")
    means = {1: [], 2: []}
    for pair in range(args.pairs):
        (one, _), (two, schedule) = run(1, jobs[1], env), run(2, jobs[2], env)
        a, b = float(np.mean(one[1:])), float(np.mean(two[1:]))
        means[1].append(a), means[2].append(b)
        print(f"{pair + 1:4d} {a:20.2f} {b:12.2f} {a / b:8.2f}  {schedule}", flush=True)
    ratios = np.array(means[1]) / np.array(means[2])
    print(f"mean {np.mean(means[1]):20.2f} {np.mean(means[2]):12.2f} {np.mean(means[1]) / np.mean(means[2]):8.2f}"
          f"  (per pair: median {np.median(ratios):.2f}, range {ratios.min():.2f}-{ratios.max():.2f})")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
