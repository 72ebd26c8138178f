"""`mlip-train` seconds per epoch, one process against a 2-stage pipeline (`parallel: pipeline`,
`pipeline.schedule: auto`), run alternately so that both see the same machine:

* the data: ``--structures`` rattled fcc Cu cells of ``--atoms`` atoms (256 or 108) labelled by ASE's EMT
  (10 % of them validation), written to a temporary extxyz file; the default 80 make nine full global
  batches per epoch, so that the first epoch holds auto's five timed warm-up steps. ``--atoms 108
  --structures 18``: 16 training structures, two global batches per epoch, micro-batches of one
  108-atom structure (the regime where what a micro-batch pays whatever its size shows);
* the model: SchNet, 8 blocks, F=64, cutoff 4.5 Å, float32; energy + force + stress loss; global batch
  8, M=8 micro-batches, AdamW, EMA. ``--model mace``: fine-tuning a random MACE of MACE-MP-0-medium
  channels (128x0e+128x1o, max_ell 3, correlation 3, r_max 6 Å, float32) with four interactions, written
  to a .model file first; ``--model sevennet``: fine-tuning SevenNet-0 (five layers, float32). Both with
  ``--atoms 32`` (32-atom Cu cells) at a size this 2-core host trains in minutes;
* each run: ``--epochs`` epochs, one torch thread per rank; the table gives each run's seconds per
  epoch after the first (the first holds the start-up), and per pair of runs the ratio;
* the pipeline's two ranks each on a CPU of its own (``mlip-train`` pins them: ``backend.bind_to_cores``);
* ``--side-by-side`` (the default; ``--no-side-by-side`` leaves it out): per pair also two one-process
  runs at once, each pinned to a CPU of its own as the pipeline's ranks are. Their seconds per epoch
  against one process alone give this machine's own ceiling for two ranks, 2 × alone / side by side:
  what a pipeline without bubble or extra work would reach while both cores compute (shared caches,
  memory bandwidth and the host's placement of the two virtual CPUs slow both when both run);
* ``--also 1f1b`` (or ``gpipe``): per pair also the pipeline under that fixed schedule, right after auto's
  run, and auto's gain over it (seconds per epoch, fixed / auto); ``--also unbound``: auto with its ranks
  left where the kernel puts them (``MLIP_PARALLEL_BIND_CORES=0``), and the binding's gain;
* ``--allocator kept`` (mlip-train's default, ``keep_freed_memory: true``): glibc's malloc keeps freed
  tensors' memory for reuse; ``glibc``: its defaults, under which a step's large tensors go back to the
  system and page-fault in again (``keep_freed_memory: false``); ``both``: the two, one after the other.

    python benchmarks/pipeline_epoch.py [--pairs 3] [--epochs 3] [--atoms 256] [--structures 80] [--no-side-by-side]
                                        [--allocator kept|glibc|both] [--also 1f1b|gpipe|unbound]
    python benchmarks/pipeline_epoch.py --model mace --atoms 32 --structures 20 --pairs 1 --no-side-by-side
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

from common import ROOT, cu_emt_frames, train_command


MODELS = {"schnet": "SchNet 8 blocks F=64", "mace": "MACE of MP-0-medium channels, 4 interactions (fine-tuned)",
          "sevennet": "SevenNet-0, 5 layers (fine-tuned)"}


def model_section(model, tmp) -> dict:
    """mlip-train's model section for ``--model`` (a MACE file written to ``tmp`` first)."""
    if model == "mace":
        from mace_scaling import make_model

        path = tmp / "mace-medium-4.model"
        if not path.exists():
            make_model(str(path), "float32", "128x0e+128x1o", interactions=4)
        return {"mace": str(path)}
    if model == "sevennet":
        return {"sevennet": "7net-0"}
    return {"name": "SchNet", "cutoff": 4.5, "hyperparameters": {"features": 64, "layers": 8}, "dtype": "float32"}


def config(data, directory, epochs, parallel, keep_freed_memory, schedule="auto", model=None):
    return {"keep_freed_memory": keep_freed_memory, "data": {"train": str(data), "validation_fraction": 0.1},
            "model": model or model_section("schnet", None),
            "loss": {"energy_weight": 1.0, "forces_weight": 10.0, "stress_weight": 1.0},
            "schedule": {"name": "none"}, "epochs": epochs, "batch_size": 8, "seed": 0, "parallel": parallel,
            "pipeline": {"stages": 2, "microbatches": 8, "schedule": schedule},
            "output": {"directory": str(directory), "overwrite": True}}


def start(ranks, job, env, cpu=None) -> tuple:
    """A started run of ``job`` on ``ranks`` processes (pinned to CPU ``cpu`` if given): (Popen, command, job)."""
    cmd = train_command(ranks, job)
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, [cpu]))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=pin), cmd, job


def finish(started) -> tuple:
    """(seconds of each epoch, the schedule line mlip-train printed) of a started run, once it has ended."""
    proc, cmd, job = started
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    directory = Path(yaml.safe_load(job.read_text())["output"]["directory"])
    with open(directory / "metrics.csv") as f:
        seconds = [float(row["seconds"]) for row in csv.DictReader(f)]
    schedule = [line for line in stdout.splitlines() if "pipeline schedule" in line]
    return seconds, schedule[0].split("mlip-train: ")[-1] if schedule else ""


def per_epoch(*runs) -> float:
    """Mean seconds per epoch after the first, over ``runs`` (each ``finish``'s result)."""
    return float(np.mean([seconds for run in runs for seconds in run[0][1:]]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="alternating (one process, pipeline) pairs of runs")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--atoms", type=int, choices=(32, 108, 256), default=256, help="atoms per structure")
    parser.add_argument("--model", choices=tuple(MODELS), default="schnet", help="the model trained (see above)")
    parser.add_argument("--structures", type=int, default=80, help="structures in the data set (10 %% validation)")
    parser.add_argument("--side-by-side", action=argparse.BooleanOptionalAction, default=True,
                        help="also run two one-process runs at once per pair (this machine's ceiling for two ranks)")
    parser.add_argument("--allocator", choices=("kept", "glibc", "both"), default="kept")
    parser.add_argument("--also", choices=("1f1b", "gpipe", "unbound"),
                        help="per pair also the pipeline under this fixed schedule, or auto with unpinned ranks")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first epoch holds the start-up and is left out)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in [k for k in env if k.startswith("MALLOC_")]:
        env.pop(key)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from ase.io import write
        write(tmp / "cu.extxyz", cu_emt_frames(args.structures, args.atoms), format="extxyz")
        for allocator in ("kept", "glibc") if args.allocator == "both" else (args.allocator,):
            compare(tmp, args, allocator, env)


def compare(tmp, args, allocator, env):
    """Alternate one-process and S=2 runs (and two one-process runs at once), ``args.pairs`` times; print each
    pair's seconds per epoch and speed-up, and with ``args.side_by_side`` the machine's ceiling."""
    jobs = {}
    runs = [("one", "data", "auto"), ("other", "data", "auto"), ("pipeline", "pipeline", "auto")]
    also = {"unbound": "auto"}.get(args.also, args.also)
    for name, parallel, schedule in runs + ([("also", "pipeline", also)] if args.also else []):
        jobs[name] = tmp / f"{name}.yaml"
        jobs[name].write_text(yaml.safe_dump(config(tmp / "cu.extxyz", tmp / name, args.epochs, parallel,
                                                    allocator == "kept", schedule, model_section(args.model, tmp))))
    train = args.structures - round(0.1 * args.structures)
    print(f"mlip-train, {MODELS[args.model]}, {train} training / {args.structures - train} validation structures "
          f"of {args.atoms} Cu atoms, batch 8, M=8, {args.epochs} epochs; allocator: {allocator}")
    print(f"{'pair':>4s} {'one process s/epoch':>20s} {'S=2 s/epoch':>12s} {'speed-up':>8s}"
          + (f" {'side by side s/epoch':>21s} {'ceiling':>7s}" if args.side_by_side else "")
          + (f" {'S=2 ' + args.also + ' s/epoch':>17s} {'pin gain' if args.also == 'unbound' else 'auto gain':>9s}" if args.also else "") + "  schedule")
    rows, cpus = [], sorted(os.sched_getaffinity(0))
    for pair in range(args.pairs):
        one = per_epoch(finish(start(1, jobs["one"], env)))
        two = finish(start(2, jobs["pipeline"], env))
        row = [one, per_epoch(two)]
        if args.side_by_side:
            both = [start(1, jobs[name], env, cpus[k % len(cpus)]) for k, name in enumerate(("one", "other"))]
            row.append(per_epoch(*[finish(run) for run in both]))
        if args.also:
            also_env = dict(env, MLIP_PARALLEL_BIND_CORES="0") if args.also == "unbound" else env
            row.append(per_epoch(finish(start(2, jobs["also"], also_env))))
        rows.append(row)
        print(f"{pair + 1:4d} {row[0]:20.2f} {row[1]:12.2f} {row[0] / row[1]:8.2f}"
              + (f" {row[2]:21.2f} {2 * row[0] / row[2]:7.2f}" if args.side_by_side else "")
              + (f" {row[-1]:17.2f} {row[-1] / row[1]:9.2f}" if args.also else "") + f"  {two[1]}", flush=True)
    rows = np.array(rows)
    mean, ratios = rows.mean(axis=0), rows[:, 0] / rows[:, 1]
    print(f"mean {mean[0]:20.2f} {mean[1]:12.2f} {mean[0] / mean[1]:8.2f}"
          + (f" {mean[2]:21.2f} {2 * mean[0] / mean[2]:7.2f}" if args.side_by_side else "")
          + (f" {mean[-1]:17.2f} {mean[-1] / mean[1]:9.2f}" if args.also else "")
          + f"  (speed-up per pair: median {np.median(ratios):.2f}, range {ratios.min():.2f}-{ratios.max():.2f})")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
