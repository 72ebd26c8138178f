"""mlip-train with parallel: pipeline on 4 ranks (run under mpiexec -n 4 with DATA and a shared OUT directory):

* resume: 2 epochs, then resume to 4 (2 replicas × 2 stages, SchNet, a ragged last batch every epoch,
  pipeline.schedule 1f1b) equals 4 uninterrupted epochs: every stage's shard (weights, AdamW, EMA,
  schedule; not the measured sweep costs) and metrics.csv;
* resume with pipeline.schedule auto keeps the costs measured by the interrupted run (so its schedule),
  and measures them again where a 1F1B run measured them (they time no split sweeps);
* the merged last.pt is an ordinary checkpoint: ``potentials.load`` in one process gives the validation
  errors that the pipelined evaluation of the stages wrote to metrics.csv;
* a merged checkpoint starts pipeline runs with other numbers of stages: 4 stages × 1 replica and
  2 stages × 2 replicas (other boundaries) from the same last.pt train to the same parameters;
* the validation set is scored by a pipelined evaluation, and no rank ever builds the whole model.
"""
import csv
import glob
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import potentials  # noqa: E402
from comparison import compare  # noqa: E402
from mlip_parallel.train.cli import RULES, SCHEMA, train, validate  # noqa: E402
from mlip_parallel.train.training import error_sums, error_table  # noqa: E402
from mlip_parallel.train.sources import read_structures, split

torch.set_num_threads(1)
world = MPI.COMM_WORLD
DATA, OUT = sys.argv[1], sys.argv[2]
failures = []


def job(directory, epochs, **changes):
    config = {"data": {"train": DATA, "validation_fraction": 0.25},
              "model": {"name": "SchNet", "cutoff": 4.0, "dtype": "float64",
                        "hyperparameters": {"features": 8, "layers": 4, "rbf": 8}},
              "loss": {"energy_weight": 1.0, "forces_weight": 10.0, "stress_weight": 1.0},
              "optimizer": {"lr": 0.005, "gradient_clip": 1.0}, "ema_decay": 0.9, "epochs": epochs, "batch_size": 4,
              "seed": 1, "parallel": "pipeline", "pipeline": {"stages": 2, "microbatches": 2, "boundaries": [0, 2, 4]},
              "output": {"directory": os.path.join(OUT, directory)}}
    for key, value in changes.items():
        config[key] = dict(config[key], **value) if isinstance(value, dict) else value
    return validate(config, SCHEMA, RULES)


def shards(directory, costs=False):
    """Every stage's training state; without its measured sweep costs and warm-up timings (timings differ
    from run to run) unless ``costs``."""
    paths = sorted(glob.glob(os.path.join(OUT, directory, "pipeline", "stage*.step*.pt")),  # one per stage
                   key=lambda p: int(os.path.basename(p)[5:].split(".")[0]))
    states = [torch.load(path, weights_only=True)["training"] for path in paths]
    if not costs:
        for state in states:
            state["pipeline"].pop("costs"), state["pipeline"].pop("warm_up")
    return states


def metrics(directory):
    with open(os.path.join(OUT, directory, "metrics.csv")) as f:
        return [{k: float(v) for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]


def report(label, ok, detail=""):
    if world.rank == 0:
        print(f"{label:70s} {'ok' if ok else 'FAILED'} {detail}", flush=True)
    if not ok:
        failures.append(label)


def equal_states(a, b, tolerance):
    """Two nested states (dicts, lists, tensors, other values): a ``Comparison`` of every tensor's largest
    absolute difference against ``tolerance``; a failure where keys, lengths or types differ, another value is
    not equal, a tensor holds a NaN, or no tensor holds anything to compare."""
    tensors, references, problems = {}, {}, []

    def walk(x, y, where):
        if isinstance(x, dict) or isinstance(y, dict):
            if not (isinstance(x, dict) and isinstance(y, dict)) or set(x) != set(y):
                problems.append(f"{where or 'state'}: keys differ: "
                                f"{sorted(map(str, x)) if isinstance(x, dict) else type(x).__name__} vs "
                                f"{sorted(map(str, y)) if isinstance(y, dict) else type(y).__name__}")
                return
            for k in x:
                walk(x[k], y[k], f"{where}.{k}" if where else str(k))
        elif isinstance(x, (list, tuple)) or isinstance(y, (list, tuple)):
            if not (isinstance(x, (list, tuple)) and isinstance(y, (list, tuple))) or len(x) != len(y):
                problems.append(f"{where or 'state'}: lengths differ: {x!r:.80} vs {y!r:.80}")
                return
            for k, (u, v) in enumerate(zip(x, y, strict=True)):
                walk(u, v, f"{where}[{k}]")
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                other = y if isinstance(x, torch.Tensor) else x
                problems.append(f"{where}: a tensor compared with a {type(other).__name__}")
                return
            tensors[where], references[where] = x, y
        elif not x == y:  # a NaN is not equal to itself: a failure
            problems.append(f"{where}: {x!r} vs {y!r}")

    walk(a, b, "")
    c = compare(tensors, references, tolerance, scale="absolute")
    return c._replace(error=float("nan"), problem="; ".join(problems)) if problems else c


# ------------------------------------------------------------------------ resume
FIXED = {"stages": 2, "microbatches": 2, "boundaries": [0, 2, 4], "schedule": "1f1b"}
train(job("straight", 4, pipeline=FIXED))
train(job("resumed", 2, pipeline=FIXED))
train(job("resumed", 4, pipeline=FIXED, resume=True))
train(job("auto", 3))  # pipeline.schedule: auto, the default (its warm-up: five of the six full batches)
before = [shard["pipeline"]["costs"] for shard in shards("auto", costs=True)] if world.rank == 0 else None
train(job("auto", 4, resume=True))
if world.rank == 0:
    after = [shard["pipeline"]["costs"] for shard in shards("auto", costs=True)]
    report("pipeline resume (auto): the interrupted run's measured costs kept",
           len(after) == 2 and before == after and all(before),
           f"{len(after)} shards")
# stopped within auto's warm-up (2 of its 5 timed steps), resumed: the warm-up goes on where it was, ending within
# the third epoch as in an uninterrupted run (started over, its 4 remaining full batches would not finish it)
train(job("auto_early", 1))
if world.rank == 0:
    early = [len(shard["pipeline"]["warm_up"]["steps"]) for shard in shards("auto_early", costs=True)]
train(job("auto_early", 3, resume=True))
if world.rank == 0:
    timed = [shard["pipeline"]["costs"] for shard in shards("auto_early", costs=True)]
    report("pipeline resume within auto's warm-up: the warm-up goes on", early == [2, 2] and all(
        c is not None and {"B.in", "WB"} <= set(c["seconds"][0]) for c in timed), f"timed steps kept {early}")
# a 1F1B run's costs time no split sweeps: resumed under auto they are measured again (its warm-up: 5 of 6 batches)
if world.rank == 0:  # a copy of the 1F1B run (4 epochs), resumed under auto
    shutil.copytree(os.path.join(OUT, "resumed"), os.path.join(OUT, "switched"))
world.Barrier()
train(job("switched", 7, resume=True))
if world.rank == 0:
    def timed_keys(directory):
        return [set((shard["pipeline"]["costs"] or {"seconds": [{}]})["seconds"][0])
                for shard in shards(directory, costs=True)]
    fixed, switched = timed_keys("resumed"), timed_keys("switched")
    report("pipeline resume 1f1b -> auto: the costs measured again, split sweeps timed",
           len(fixed) == len(switched) == 2 and all("WB" not in k for k in fixed)
           and all({"B.in", "WB"} <= k for k in switched), f"{switched[0] if switched else 'no shards'}")
_, validation, _ = split(read_structures(DATA), [0.25, 0.0], job("straight", 4)["seed"])  # collective (ASE reads on rank 0)
if world.rank == 0:
    a, b = shards("straight"), shards("resumed")
    c = equal_states(a, b, 0.0)  # bit for bit
    report("pipeline resume: 2 + 2 epochs == 4 (weights, AdamW, EMA, schedule)", len(a) == 2 and c.ok,
           f"max diff {c.error:.1e}" + ("" if c.ok else f" ({c.message()})"))
    straight_metrics = metrics("straight")
    report("pipeline resume: metrics.csv equal", len(straight_metrics) > 0 and straight_metrics == metrics("resumed"))
    # the merged last.pt (EMA weights) in one process == the pipelined validation errors of the stages
    model = potentials.load(os.path.join(OUT, "straight", "last.pt"))
    errors = error_table(error_sums(model, validation, 4, model.device))
    last = metrics("straight")[-1]
    c = compare(errors, {k: last[k] for k in errors}, 1e-9, scale="each")
    report("merged last.pt (potentials.load) == pipelined validation errors", c.ok,
           f"max rel {c.error:.1e}" + ("" if c.ok else f" ({c.message()})"))

# ------------------------------------------ a merged checkpoint starts runs with other stage counts
start = os.path.join(OUT, "straight", "last.pt")
train(job("four_stages", 1, model={"checkpoint": start}, pipeline={"stages": 4, "microbatches": 2, "boundaries": None}))
train(job("two_stages", 1, model={"checkpoint": start}, pipeline={"stages": 2, "microbatches": 2, "boundaries": [0, 1, 4]}))
if world.rank == 0:
    merged = {}
    for directory in ("four_stages", "two_stages"):
        merged[directory] = {}
        for shard in shards(directory):
            merged[directory].update(shard["model"])
    c = equal_states(merged["four_stages"], merged["two_stages"], 1e-12)
    report("from last.pt: 4 stages x 1 replica == 2 stages x 2 replicas (weights)", c.ok,
           f"max diff {c.error:.1e}" + ("" if c.ok else f" ({c.message()})"))
    report("from last.pt: every shard of the 4-stage run written", len(shards("four_stages")) == 4)

if world.rank == 0:
    print(f"pipeline training {len(failures)} failures {failures}", flush=True)
sys.exit(1 if world.bcast(len(failures)) else 0)
