"""mlip-train: a short run learns; resume is exact; data parallel and graph parallel on 2 ranks equal one
process; bad data is named; the bundled cu-emt model matches EMT on held-out structures; glibc keeps freed
memory for reuse."""
import csv
import importlib.util
import os
import re

import numpy as np
import pytest
import torch
import yaml
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io import read, write

import potentials
from comparison import assert_beyond, assert_close
from conftest import MPI_DIR, ROOT, assert_log_lines, launch_sections, require
from mlip_parallel.config import ConfigError
from mlip_parallel.train.cli import RULES, SCHEMA, main, train, validate
from mlip_parallel.train.structures import DataError

spec = importlib.util.spec_from_file_location("generate_cu_emt_data", ROOT / "examples" / "generate_cu_emt_data.py")
generator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generator)


@pytest.fixture(scope="module")
def quick_data(tmp_path_factory):
    """EMT-labelled Cu structures, of three config_types in turn."""
    path = tmp_path_factory.mktemp("data") / "cu_quick.extxyz"
    frames = generator.generate(seed=0, quick=True)
    for k, atoms in enumerate(frames):
        atoms.info["config_type"] = ("bulk", "rattled", "strained")[k % 3]
    write(path, frames, format="extxyz")
    return path


@pytest.fixture(scope="module")
def replay_data(tmp_path_factory):
    """Other structures, for a file sampled at a share (data.train's mixtures)."""
    path = tmp_path_factory.mktemp("replay") / "cu_replay.extxyz"
    write(path, generator.generate(seed=1, quick=True), format="extxyz")
    return path


def job(directory, data, **changes):
    config = {"data": {"train": str(data), "validation_fraction": 0.25},
              "model": {"name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 8, "layers": 2},
                        "dtype": "float64"},
              "loss": {"energy_weight": 1.0, "forces_weight": 10.0, "stress_weight": 1.0},
              "optimizer": {"lr": 0.005}, "ema_decay": 0.9, "epochs": 2, "batch_size": 4, "seed": 1,
              "output": {"directory": str(directory)}}
    config.update(changes)
    return config


def metrics(directory):
    with open(directory / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]


def trained_parameters(directory):
    """The trained (not averaged) weights: last.pt's training state, or the union of the pipeline stages' shards."""
    shards = sorted((directory / "pipeline").glob("stage*.pt"))
    if not shards:
        return torch.load(directory / "last.pt", weights_only=True)["training"]["model"]
    merged = {}
    for shard in shards:
        merged.update(torch.load(shard, weights_only=True)["training"]["model"])
    return merged


def test_short_training_lowers_validation_force_error(quick_data, tmp_path):
    out = tmp_path / "run"
    rows = train(validate(job(out, quick_data, epochs=8), SCHEMA, RULES))
    assert rows[-1]["forces_mae"] < 0.9 * rows[0]["forces_mae"], [r["forces_mae"] for r in rows]
    for name in ("best.pt", "last.pt", "metrics.csv", "learning_curve.png"):
        assert (out / name).exists(), name
    best = potentials.load(out / "best.pt")  # an ordinary potentials checkpoint
    assert isinstance(best, potentials.SchNet) and best.species == ["Cu"]
    assert [int(r["epoch"]) for r in metrics(out)] == list(range(1, 9))
    assert main(["eval", str(out / "best.pt"), str(quick_data)]) == 0


def test_resume_two_plus_two_epochs_equals_four(quick_data, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(validate(job(straight, quick_data, epochs=4), SCHEMA, RULES))
    train(validate(job(resumed, quick_data, epochs=2), SCHEMA, RULES))
    train(validate(job(resumed, quick_data, epochs=4, resume=True), SCHEMA, RULES))
    a, b = (torch.load(d / "last.pt", weights_only=True)["training"] for d in (straight, resumed))
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key in a["ema"]:
        assert torch.equal(a["ema"][key], b["ema"][key]), key
    assert len(a["optimizer"]["state"]) == len(b["optimizer"]["state"])
    for state_a, state_b in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert metrics(straight) == metrics(resumed)


class Killed(Exception):
    """A stand-in for the process being killed (raised out of an optimizer step)."""


@pytest.mark.parametrize("batching", [{"batch_size": 3}, {"batch_atoms": 10}])
def test_killed_mid_epoch_and_resumed_equals_a_straight_run(quick_data, replay_data, tmp_path, monkeypatch, batching):
    """Step-based training on streamed data: 4 steps an epoch (10 structures, batch 3), validation every 5 steps and at
    the end (metrics rows at steps 5, 10, 15, 16), last.pt every 3 steps, 7 warm-up steps then cosine. A run killed at
    its 8th, 16th and 20th step attempts (one step past last.pt of step 6, mid-epoch 2, and of step 12; the last
    step, after the validation of step 15) and resumed each time ends with the straight run's last.pt, best.pt and
    metrics, bit for bit; the cut run redid 2 steps. The cut
    run reads ahead in 2 worker processes (data.workers), the straight one reads when a step uses a structure. Also
    in batches of at most 10 atoms (of 3- and 4-atom structures: epochs of unequal step counts), with another file
    sampled at a share of 0.2 (each epoch its own draws); in batches of 3, a second stage from epoch 3 (other
    weights, a constant rate, the weights averaged at each of its epochs' ends) and config_type weights."""
    from mlip_parallel.train import strategies

    def config(directory, workers=2):
        settings = job(directory, quick_data, epochs=4, **batching, validate_every=5, resume=True,
                       schedule={"name": "cosine", "warmup_steps": 7, "min_lr": 1e-4},
                       output={"directory": str(directory), "checkpoint_every": 3})
        settings["data"].update(stream=True, workers=workers)
        if "batch_size" in batching:  # and a second stage from epoch 3: other weights, its own rate, averaged
            settings["stage_two"] = {"start_epoch": 3, "forces_weight": 3.0, "lr": 0.001, "average": True}
            settings["loss"].update(type="universal", config_type_weights={"rattled": 2.0, "bulk": 0.5})
        if "batch_atoms" in batching:
            settings["data"]["train"] = [str(quick_data), {"file": str(replay_data), "share": 0.2}]
        return validate(settings, SCHEMA, RULES)

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train(config(straight, workers=0))
    original, attempts = strategies.DataParallel.step, []

    def step(self, *args):
        attempts.append(1)
        if len(attempts) in (8, 16, 20):
            raise Killed
        return original(self, *args)

    monkeypatch.setattr(strategies.DataParallel, "step", step)
    outcomes = []
    for _ in range(4):
        try:
            train(config(cut))
            outcomes.append("finished")
        except Killed:
            outcomes.append("killed")
    train(config(cut))  # requeued once more after it finished: nothing to do (no worker started), nothing changed
    rows = metrics(straight)
    steps = int(rows[-1]["step"])
    assert outcomes == ["killed", "killed", "killed", "finished"], outcomes
    if "batch_size" in batching:  # each kill: its attempt, and the steps since last.pt again (1, 1, 0)
        assert len(attempts) == steps + 2 + 2 + 1, len(attempts)
        assert [(r["epoch"], r["step"]) for r in rows] == [(1.25, 5), (2.5, 10), (3.75, 15), (4, 16)], rows
    else:
        assert steps > 16 and [r["step"] for r in rows] == list(range(5, steps, 5)) + [steps] and rows[-1]["epoch"] == 4
    assert metrics(cut) == rows
    for name in ("last.pt", "best.pt"):
        a, b = (torch.load(d / name, weights_only=True) for d in (straight, cut))
        assert a["training"]["step"] == b["training"]["step"] == (steps if name == "last.pt" else a["training"]["step"])
        for part in ("model", "ema", "average"):
            for key in a["training"][part]:
                assert torch.equal(a["training"][part][key], b["training"][part][key]), (name, part, key)
        for state_a, state_b in zip(a["training"]["optimizer"]["state"].values(),
                                    b["training"]["optimizer"]["state"].values(), strict=True):
            assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
        assert a["training"]["scheduler"] == b["training"]["scheduler"]


def test_killed_after_a_checkpoint_before_the_first_validation_resumes(quick_data, tmp_path, monkeypatch):
    """last.pt every 3 steps, the first validation at step 5: a run killed at its 4th step attempt has last.pt (step
    3) and no metrics.csv yet; resumed, it ends with the straight run's metrics and last.pt, bit for bit (before:
    "resume: cannot read metrics.csv", seen when a requeued job was killed in that window)."""
    from mlip_parallel.train import strategies

    def config(directory):
        return validate(job(directory, quick_data, epochs=2, batch_size=3, validate_every=5, resume=True,
                            output={"directory": str(directory), "checkpoint_every": 3}), SCHEMA, RULES)

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train(config(straight))
    original, attempts = strategies.DataParallel.step, []

    def step(self, *args):
        attempts.append(1)
        if len(attempts) == 4:
            raise Killed
        return original(self, *args)

    monkeypatch.setattr(strategies.DataParallel, "step", step)
    with pytest.raises(Killed):
        train(config(cut))
    assert (cut / "last.pt").exists() and not (cut / "metrics.csv").exists()
    train(config(cut))
    assert metrics(cut) == metrics(straight)
    a, b = (torch.load(d / "last.pt", weights_only=True)["training"] for d in (straight, cut))
    assert a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_max_steps_and_the_warm_up_and_cosine_schedule_of_torch(quick_data, tmp_path):
    """max_steps 9 ends a 100-epoch run at step 9 (a row per step with validate_every 1); each row's learning rate
    (its step's) equals torch's own LinearLR warm-up (3 steps) followed by CosineAnnealingLR to min_lr over the
    other 6 (SequentialLR)."""
    out = tmp_path / "run"
    rows = train(validate(job(out, quick_data, epochs=100, max_steps=9, validate_every=1, batch_size=3,
                              optimizer={"lr": 0.005}, schedule={"name": "cosine", "warmup_steps": 3, "min_lr": 1e-4}),
                          SCHEMA, RULES))
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert torch.load(out / "last.pt", weights_only=True)["training"]["step"] == 9
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight], lr=0.005)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / 3, end_factor=1.0, total_iters=2),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6, eta_min=1e-4)], milestones=[3])
    expected = []
    for _ in range(9):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert_close([r["lr"] for r in rows], expected, 1e-12, scale="each", label="learning rates")
    assert rows[0]["lr"] == pytest.approx(0.005 / 3) and rows[3]["lr"] == pytest.approx(0.005)


def test_early_stopping_on_a_patience_and_under_resume(quick_data, tmp_path, capsys):
    """early_stopping.patience 3, a validation every step, up to 40 steps at a learning rate that makes the
    validation loss jump: the run ends at the first validation where the last 3 are none below the best before them
    (the rule checked on metrics.csv's rows, and that it held at no earlier row), says so, and best.pt is the best
    row's; a run stopped at step 6 and resumed stops at the same step with the same rows; resumed after its stop,
    it trains no further."""
    def config(directory, max_steps=40):
        return validate(job(directory, quick_data, epochs=100, max_steps=max_steps, validate_every=1, ema_decay=0.0,
                            optimizer={"lr": 0.05}, schedule={"name": "none"}, early_stopping={"patience": 3},
                            resume=True), SCHEMA, RULES)

    def stalls(losses):
        return len(losses) > 3 and min(losses[-3:]) >= min(losses[:-3])

    straight = tmp_path / "straight"
    rows = train(config(straight))
    losses = [r["val_loss"] for r in rows]
    assert len(rows) < 40 and stalls(losses) and not any(stalls(losses[:k]) for k in range(1, len(losses)))
    assert f"stopped early at epoch {rows[-1]['epoch']}, step {len(rows)}: 3 validations" in capsys.readouterr().out
    best = min(rows, key=lambda r: r["val_loss"])
    assert torch.load(straight / "best.pt", weights_only=True)["training"]["step"] == best["step"]
    cut = tmp_path / "cut"
    train(config(cut, max_steps=6))
    train(config(cut))
    assert metrics(cut) == metrics(straight)
    assert train(config(straight)) == rows and len(metrics(straight)) == len(rows)


def test_tensorboard_and_wandb_log_the_metric_rows(quick_data, tmp_path, monkeypatch):
    """output.tensorboard and output.wandb (offline, no network): TensorBoard's event files hold each metrics.csv
    row's values at its step (read back with tensorboard's own reader); a W&B offline run is written and a resumed
    run continues the same run id; a wandb section of other keys is one named line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "run"

    def config(epochs):
        return validate(job(out, quick_data, epochs=epochs, resume=True,
                            output={"directory": str(out), "tensorboard": True, "wandb": {"project": "tests"}}),
                        SCHEMA, RULES)

    train(config(2))
    run_id = (out / "wandb_id").read_text()
    train(config(3))  # resumed: the same run, one more row
    rows = metrics(out)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for name in ("train_loss", "val_loss", "forces_mae", "lr"):
        logged = [(e.step, e.value) for e in events.Scalars(name)]
        assert [step for step, _ in logged] == [int(r["step"]) for r in rows], (name, logged)
        assert_close([v for _, v in logged], [r[name] for r in rows], 1e-6, scale="each", label=name)
    assert (out / "wandb_id").read_text() == run_id and "WANDB_SERVICE" not in os.environ  # the process put back
    launches = [p for p in (out / "wandb").glob(f"offline-run-*-{run_id}*")  # (wandb adds "-1" to a second launch's
                if re.fullmatch(rf"offline-run-\d+_\d+-{run_id}(-\d+)?", p.name)]  # name made in the same second)
    assert len(launches) == 2, launches  # one directory per launch, one id
    with pytest.raises(ConfigError, match=r"output.wandb: \{project: NAME"):
        train(validate(job(tmp_path / "bad", quick_data, output={"directory": str(tmp_path / "bad"),
                                                                 "wandb": {"entity": "me"}}), SCHEMA, RULES))
    assert not (tmp_path / "bad").exists()


# test_two_ranks_equal_one_process's cases (parallel, launcher, stream), and the LoRA test's parallel modes
TWO_RANKS = [("data", "mpiexec", False), ("graph", "mpiexec", False), ("pipeline", "mpiexec", False),
             ("graph", "torchrun", False), ("data", "mpiexec", 1), ("pipeline", "mpiexec", 0)]
LORA = ("data", "graph")


def two_rank_job(tmp_path, quick_data, replay_data, parallel, stream):
    """test_two_ranks_equal_one_process's case: the one-process run trained here in ``tmp_path``/serial, the 2-rank
    run's job written to ``tmp_path``/job.yaml (its output: ``tmp_path``/distributed)."""
    serial, distributed = tmp_path / "serial", tmp_path / "distributed"
    config = job(serial, quick_data, epochs=3, parallel="data", batch_atoms=20 if stream else 0,
                 optimizer={"lr": 0.005, "gradient_clip": 1.0, "amsgrad": True,
                            "lr_factors": {"interactions.1.*": 0.5, "readout.*": 2.0}},
                 loss={"energy_weight": 1.0, "forces_weight": 10.0, "stress_weight": 1.0, "type": "universal",
                       "huber_delta": 0.05, "config_type_weights": {"rattled": 3.0, "strained": 0.5}},
                 stage_two={"start_epoch": 3, "energy_weight": 5.0, "forces_weight": 2.0, "lr": 0.002,
                            "average": True})
    if stream:
        config["data"]["train"] = [str(quick_data), {"file": str(replay_data), "share": 0.3}]
    train(validate(config, SCHEMA, RULES))
    config = dict(config, parallel=parallel, output={"directory": str(distributed)},
                  pipeline={"stages": 2, "microbatches": 4, "schedule": "auto"})  # 10 structures: 4 + 4 + 2
    config["data"] = dict(config["data"], stream=stream is not False, workers=stream or 0)
    if stream:  # and batches by size: of at most 20 atoms (the structures have 3 and 4)
        config["batch_atoms"] = 20
    if stream == 1:  # the first file as an ASE database of the same structures: each rank reads the rows it asks for
        import ase.db

        with ase.db.connect(tmp_path / "cu_quick.db", serial=True) as db:
            for atoms in read(quick_data, ":"):
                db.write(atoms, config_type=atoms.info["config_type"])
        config["data"]["train"] = [str(tmp_path / "cu_quick.db"), *config["data"]["train"][1:]]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))


def lora_job(tmp_path, quick_data, parallel):
    """test_lora_two_ranks_equal_one_process_and_best_pt_holds_the_merged_weights's case, as ``two_rank_job``."""
    serial, distributed = tmp_path / "serial", tmp_path / "distributed"
    lora = {"targets": ["interactions.*.lin*.weight"], "rank": 2, "alpha": 2.0}
    config = job(serial, quick_data, model={"name": "SchNet", "cutoff": 4.0, "dtype": "float64", "lora": lora,
                                            "hyperparameters": {"features": 8, "layers": 2}})
    train(validate(config, SCHEMA, RULES))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(dict(config, parallel=parallel,
                                                           output={"directory": str(distributed)})))


@pytest.fixture(scope="module")
def on_two_ranks(mpirun, quick_data, replay_data, tmp_path_factory):
    """``on_two_ranks(name)`` → (case directory, exit status, output) of the mpiexec runs of ``TWO_RANKS`` (name
    "PARALLEL-STREAM") and ``LORA`` ("lora-PARALLEL"): the one-process runs trained here, the 2-rank runs of
    mlip-train in one launch (``conftest.launch_sections``)."""
    root = tmp_path_factory.mktemp("two_ranks")
    for parallel, launcher, stream in TWO_RANKS:
        if launcher == "mpiexec":
            (root / f"{parallel}-{stream}").mkdir()
            two_rank_job(root / f"{parallel}-{stream}", quick_data, replay_data, parallel, stream)
    for parallel in LORA:
        (root / f"lora-{parallel}").mkdir()
        lora_job(root / f"lora-{parallel}", quick_data, parallel)
    section = launch_sections(mpirun, 2, [(case, ["-m", "mlip_parallel.train.cli", root / case / "job.yaml"])
                                          for case in sorted(p.name for p in root.iterdir())])
    return lambda name: (root / name, *section(name))


@pytest.mark.parametrize("parallel, launcher, stream", TWO_RANKS)
def test_two_ranks_equal_one_process(on_two_ranks, torchrun, quick_data, replay_data, tmp_path, parallel, launcher,
                                     stream):
    """Same global batch, float64: parameters after 9 optimizer steps (gradient clipping, EMA, AMSGrad, the
    universal loss with config_type weights, a second stage in epoch 3 with its weight average, and learning-rate
    factors on: in pipeline, each stage holds some of the groups) equal the
    single-process run. Pipeline: 2 stage-local models, up to 4 micro-batches (the last batch
    of each epoch has 2 structures), schedule auto (five timed warm-up steps, then
    the order predicted fastest under the measured costs), four sweeps, pipelined validation. Graph parallel also under
    torchrun: the halo over the torch.distributed backend, no MPI. ``stream`` (a number: data.workers): the 2-rank run
    reads its structures from disk at each use (data.stream; data parallel: each rank only its share, read ahead by a
    worker process of each rank, in batches of at most 20 atoms, another file sampled at a share of 0.3; with a worker,
    the first file as an ASE database: under MPI, ASE's databases once handed every rank rank 0's rows), the
    one-process run holds them."""
    if launcher == "mpiexec":  # (with the others: one launch)
        tmp_path, rc, out = on_two_ranks(f"{parallel}-{stream}")
    else:
        two_rank_job(tmp_path, quick_data, replay_data, parallel, stream)
        rc, out, _ = torchrun(2, "-m", "mlip_parallel.train.cli", tmp_path / "job.yaml")
    serial, distributed = tmp_path / "serial", tmp_path / "distributed"
    assert rc == 0, out
    assert f"2 rank(s) x 1 thread(s), {parallel} parallel" in out, out
    assert_log_lines(out, "mlip-train: epoch 3/3 (100 %)", [tmp_path])  # (output to a pipe: plain lines)
    whole = sum(p.numel() for p in potentials.load(serial / "last.pt").parameters())
    assert f"SchNet ['Cu'], {whole} parameters," in out, (whole, out)  # the model's count, not the ranks' sum
    if parallel == "pipeline":  # the warm-up ended and auto chose its schedule
        assert "mlip-train: pipeline schedule" in out and "(timed warm-up)" not in out, out
    a, b = trained_parameters(serial), trained_parameters(distributed)
    assert_close(b, a, 1e-8, label="trained parameters")
    assert re.search(r"mlip-train: stage two from epoch 2, step \d+: loss weights energy 5, forces 2, stress 1, "
                     r"learning rate 0.002\n", out), out
    for name in ("forces_mae", "train_forces_mae", "train_energy_rmse", "lr"):
        assert metrics(serial)[-1][name] == pytest.approx(metrics(distributed)[-1][name], rel=1e-8), name


@pytest.mark.parametrize("parallel", LORA)
def test_lora_two_ranks_equal_one_process_and_best_pt_holds_the_merged_weights(on_two_ranks, parallel):
    """model.lora (rank 2) on SchNet's interaction matrices, float64, 2 epochs: the low-rank updates trained on 2 ranks
    (data or graph parallel) equal one process's to 1e-8; every other weight stays the seeded start (the same in
    both); best.pt, an ordinary SchNet checkpoint, differs from the start only in the adapted weights."""
    directory, rc, out = on_two_ranks(f"lora-{parallel}")
    serial, distributed = directory / "serial", directory / "distributed"
    assert rc == 0, out
    assert "parameters of LoRA updates trained (rank 2, alpha 2, on 6 weights)" in out, out
    a, b = trained_parameters(serial), trained_parameters(distributed)
    assert any(".B." in key for key in a)
    assert_close(b, a, 1e-8, label="trained parameters")
    start = potentials.SchNet(["Cu"], cutoff=4.0, features=8, layers=2, seed=1).double().state_dict()
    best = potentials.load(distributed / "best.pt").state_dict()
    adapted = {k for k in best if re.fullmatch(r"interactions\.\d\.(conv\.lin\d|lin)\.weight", k)}
    assert len(adapted) == 6
    for key, value in best.items():
        if key in adapted:
            assert_beyond(value, start[key], 1e-8 + 1e-5 * float(start[key].abs().max()), scale="absolute", label=key)
        elif key in start and "scale_shift" not in key:  # (the scale and shift: fitted to the data at the start)
            assert torch.equal(value, start[key]), key


def test_pipeline_resume_merged_checkpoint_and_restaging(mpirun, quick_data, tmp_path):
    """mlip-train, parallel: pipeline, SchNet on 4 ranks (tests/mpi/pipeline_training.py): resume 2 + 2
    epochs == 4 (every stage's shard and metrics; 1F1B); resume under auto keeps the measured costs, and
    within its warm-up goes on with the steps timed so far; the
    merged last.pt in one process gives the pipelined validation errors; from that last.pt (auto),
    4 stages × 1 replica == 2 stages × 2 replicas."""
    rc, out, _ = mpirun(4, MPI_DIR / "pipeline_training.py", quick_data, tmp_path)
    assert rc == 0, out
    assert "pipeline training 0 failures" in out and out.count(" ok ") == 8, out


@pytest.mark.parametrize("name", ["SchNet", "PaiNN", "NequIP"])
def test_split_backward_equals_whole_backward(name):
    """pipeline.backward_split (a sweep's input part now, its parameter part later, in another order) gives the
    input and parameter gradients of one backward, for A and B of a middle stage (inputs: the stage input and
    the force-backward seed) and of the first stage (B has no inputs there: all of it is deferred), float64."""
    from ase.build import bulk

    from mlip_parallel.train.pipeline import backward_split
    from mlip_parallel.train.training import Batch, batch_geometry
    from mlip_parallel.train.structures import Structure

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.rattle(0.05, seed=1)
    structure = Structure(atoms.numbers, atoms.positions, atoms.cell[:], atoms.pbc, 0.0, np.zeros((4, 3)),
                          np.zeros((3, 3)), "x")
    kwargs = {"SchNet": dict(features=8, rbf=8), "PaiNN": dict(features=4, rbf=8),
              "NequIP": dict(l_max=1, features=2, radial=4, radial_hidden=8)}[name]
    model = getattr(potentials, name)(["Cu"], cutoff=4.0, layers=3, seed=2, **kwargs).double()
    params = list(model.parameters())
    batch = Batch([structure], model, model.device)
    seeds = torch.Generator().manual_seed(0)

    def graphs(first):  # a stage of blocks 1..2 (or the first stage, blocks 0..1, from the embedding)
        geometry = batch_geometry(batch)
        ctx = model.context(geometry.graph)
        blocks = range(0, 2) if first else range(1, 3)
        h_in = None if first else torch.randn(4, model.feature_width(1), generator=seeds, dtype=torch.float64)
        h = model.embed(geometry.graph, ctx) if first else h_in.requires_grad_(True)
        for k in blocks:
            h = model.block(k, h, geometry.graph, ctx)
        g_out = torch.randn(h.shape, generator=seeds, dtype=h.dtype).requires_grad_(True)
        grads = torch.autograd.grad(h, [geometry.pos] + ([] if first else [h_in]), g_out, create_graph=True)
        return h, h_in, g_out, grads

    for first in (False, True):
        results = []
        for split in (False, True):
            torch.manual_seed(0)
            seeds.manual_seed(0)
            for p in params:
                p.grad = None
            h, h_in, g_out, grads = graphs(first)
            cotangents = [torch.randn(g.shape, generator=seeds, dtype=g.dtype) for g in grads]
            inputs = [g_out] + ([] if first else [h_in])
            sweeps = [(list(grads), cotangents, inputs), ([h], [torch.randn(h.shape, generator=seeds, dtype=h.dtype)],
                                                           [] if first else [h_in])]
            deferred = []
            for tensors, seed, leaves in sweeps:  # A, then B
                if split:
                    deferred.append(backward_split(tensors, seed, leaves, params))
                else:
                    torch.autograd.backward(tensors, seed, retain_graph=True, inputs=params + leaves)
            for part in reversed(deferred):  # W in another order than their sweeps
                part.run()
            results.append([t.grad for t in params + inputs])
        assert len(results[0]) == len(results[1])
        for a, b in zip(*results):
            assert (a is None) == (b is None)
            if a is not None:
                assert_close(a, b, 1e-14, scale="absolute", label=name)


@pytest.mark.parametrize("beta, threshold", [(1.0, 20.0), (2.0, 0.5)])
def test_branch_formulas_equal_the_nodes(beta, threshold):
    """The outputs that backward_split's parameter part computes by formula (pipeline._branch_outputs) equal
    those of the autograd node itself, float64: the double backward of softplus (both sides of its
    threshold, beta 1 and 2), and a matrix product."""
    from mlip_parallel.train.pipeline.split_backward import _branch_outputs

    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return (3 * torch.randn(*shape, generator=generator, dtype=torch.float64)).requires_grad_(True)
    x, g, a, b = leaf(50, 7), leaf(50, 7), leaf(50, 6), leaf(6, 7)
    for out in (torch.ops.aten.softplus_backward(g, x, beta, threshold), a.mm(b)):
        grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
        expected = out.grad_fn(grad)
        for k in range(2):
            got = _branch_outputs(out.grad_fn, (grad,), {k})
            assert got is not None and got[1 - k] is None
            assert_close(got[k], expected[k], 1e-14, scale="absolute", label=f"output {k}")


def labelled(atoms, forces=True, energy=-1.0):
    atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=np.zeros((len(atoms), 3)) if forces else None)
    return atoms


def test_bad_data_and_config_are_named(quick_data, tmp_path):
    no_forces = tmp_path / "no_forces.extxyz"
    write(no_forces, [labelled(Atoms("Cu2", positions=[[0, 0, 0], [2.5, 0, 0]]), forces=False)] * 4)
    silver = tmp_path / "silver.extxyz"
    write(silver, [labelled(Atoms("CuAg", positions=[[0, 0, 0], [2.6, 0, 0]]))] * 4)
    empty = tmp_path / "empty.extxyz"
    empty.write_text("")
    garbage = tmp_path / "garbage.extxyz"
    garbage.write_text("this is not\na structure file\n")
    cases = [
        (job(tmp_path / "a", no_forces), DataError, "no forces"),
        (job(tmp_path / "b", silver, model={"name": "SchNet", "species": ["Cu"]}), ConfigError, "['Ag'] not known"),
        (job(tmp_path / "c", empty), DataError, "empty.extxyz"),
        (job(tmp_path / "d", garbage), DataError, "garbage.extxyz: cannot read"),
        (job(tmp_path / "e", tmp_path / "missing.extxyz"), DataError, "no such data file"),
        (dict(job(tmp_path / "f", quick_data), learning_rate=0.1), ConfigError, "unknown key learning_rate"),
        (job(tmp_path / "g", quick_data, parallel="tensor"), ConfigError, "parallel must be one of"),
        (job(tmp_path / "i", quick_data, parallel="pipeline", pipeline={"stages": 2}), ConfigError,
         "pipeline.stages = 2 must divide the 1 rank(s)"),
        (job(tmp_path / "j", quick_data, parallel="pipeline", pipeline={"stages": 3}), ConfigError,
         "pipeline.stages = 3: a stage holds at least one interaction block and the model has 2"),
        (job(tmp_path / "k", quick_data, parallel="pipeline", pipeline={"stages": 1, "microbatches": 0}), ConfigError,
         "pipeline.microbatches must be a finite number >= 1, got 0"),
    ]
    for config, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            train(validate(config, SCHEMA, RULES))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(job(tmp_path / "h", no_forces)))
    assert main([str(tmp_path / "bad.yaml")]) == 2
    # the missing label is counted, and the structure named by its index, not as file:line
    with pytest.raises(DataError, match=re.escape("structure 0 (counting from 0) has no forces")) as info:
        train(validate(dict(job(tmp_path / "m", no_forces), data={"train": str(no_forces), "validation": str(no_forces)}),
                       SCHEMA, RULES))
    assert "4 of these 4 structures lack forces" in str(info.value)


def test_losses_equal_maces_weighted_mse_huber_and_universal_losses(quick_data):
    """loss_terms under each loss.type equals MACE's own loss module of that name (mace.modules.loss: its weighted
    energy/forces/stress MSE with per-configuration weights, its Huber loss, its universal loss, whose force
    threshold shrinks in bands of the labelled force's norm), float64, on structures whose labelled forces reach each
    band and whose predictions err on both sides of each threshold; config_type weights are read by data.keys'
    name. Fault shown: the universal loss with one threshold (plain Huber) differs."""
    from dataclasses import replace

    require("mace")
    import mace.modules.loss as mace_loss

    from mlip_parallel.train.training import Counts, Labels, LossRule, loss_terms, total_loss
    from mlip_parallel.train.sources import read_structures

    structures = read_structures(quick_data, keys={"config_type": "config_type"})[:6]
    assert [s.config_type for s in structures] == ["bulk", "rattled", "strained"] * 2
    structures[1].forces[0] = [150.0, 0.0, 0.0]  # labelled forces in every band of the universal loss
    structures[2].forces[1] = [0.0, 220.0, -10.0]
    structures[3].forces[2] = [310.0, 40.0, 0.0]
    rng = np.random.default_rng(3)
    labels = Labels(structures, "cpu")
    energy = labels.energy + torch.as_tensor(rng.normal(0, 0.03, len(structures))) * labels.atoms_per_structure
    forces = labels.forces + torch.as_tensor(rng.normal(0, 0.02, labels.forces.shape))
    stress = labels.stress + torch.as_tensor(rng.normal(0, 0.01, labels.stress.shape))
    counts = Counts.of(structures)

    class Reference(dict):  # MACE's batch: labels by key, per-configuration weights by attribute
        __getattr__ = dict.__getitem__

    sizes = labels.atoms_per_structure.long()
    ones = torch.ones(len(structures), dtype=torch.float64)
    config_weights = {"rattled": 3.0, "strained": 0.5}
    theirs = Reference(energy=labels.energy, forces=labels.forces, stress=labels.stress,
                       ptr=torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]),
                       weight=torch.tensor([config_weights.get(s.config_type, 1.0) for s in structures],
                                           dtype=torch.float64),
                       energy_weight=ones, forces_weight=ones, stress_weight=ones)
    predicted = {"energy": energy, "forces": forces, "stress": stress}
    w = {"energy": 2.0, "forces": 10.0, "stress": 3.0}
    cases = [("mse", config_weights, mace_loss.WeightedEnergyForcesStressLoss(**{f"{q}_weight": v for q, v in w.items()})),
             ("huber", {}, mace_loss.WeightedHuberEnergyForcesStressLoss(**{f"{q}_weight": v for q, v in w.items()},
                                                                          huber_delta=0.01)),
             ("universal", {}, mace_loss.UniversalLoss(**{f"{q}_weight": v for q, v in w.items()}, huber_delta=0.01))]
    for kind, factors, module in cases:
        rule = LossRule(**w, type=kind, huber_delta=0.01, config_type_weights=factors)
        ours = float(total_loss(loss_terms(energy, forces, stress, labels, counts, rule), rule))
        reference = float(module(theirs, predicted))
        assert ours == pytest.approx(reference, rel=1e-12), kind
    plain = replace(rule, type="huber")
    assert float(total_loss(loss_terms(energy, forces, stress, labels, counts, plain), plain)) != \
        pytest.approx(reference, rel=1e-6)  # the bands matter here


def test_stage_two_weights_rate_and_average(quick_data, tmp_path):
    """stage_two from epoch 2 of 3 (average on): the rows of epochs 2 and 3 score val_loss with stage two's weights
    (Σ w rmse² of the row's errors) and train at its learning rate, epoch 1 at stage one's; best.pt and last.pt hold
    the average of the trained weights at the ends of epochs 2 and 3 (read from a run of 2 epochs resumed to 3, whose
    last.pt training states hold them), not the EMA; a stage-two key without start_epoch is named."""
    two = {"start_epoch": 2, "energy_weight": 4.0, "forces_weight": 1.0, "stress_weight": 0.0, "lr": 0.0007,
           "average": True}
    out = tmp_path / "run"
    train(validate(job(out, quick_data, epochs=2, stage_two=two), SCHEMA, RULES))
    at_two = torch.load(out / "last.pt", weights_only=True)["training"]["model"]
    rows = train(validate(job(out, quick_data, epochs=3, stage_two=two, resume=True), SCHEMA, RULES))
    at_three = torch.load(out / "last.pt", weights_only=True)["training"]["model"]
    assert [r["lr"] for r in rows] == [0.005, 0.0007, 0.0007]
    weights = [{"energy": 1.0, "forces": 10.0, "stress": 1.0}] + [{"energy": 4.0, "forces": 1.0, "stress": 0.0}] * 2
    assert len(rows) == len(weights)
    for row, w in zip(rows, weights):
        assert row["val_loss"] == pytest.approx(sum(w[q] * row[f"{q}_rmse"] ** 2 for q in w if w[q]), rel=1e-12)
        assert np.isfinite(row["train_forces_mae"]) and row["train_forces_mae"] != row["forces_mae"]
    for name in ("last.pt", "best.pt"):
        saved = potentials.load(out / name).state_dict()
        for key, value in at_three.items():
            assert_close(saved[key], (at_two[key] + at_three[key]) / 2, 1e-12, scale="each", label=f"{name} {key}")
    with pytest.raises(ConfigError, match=re.escape("stage_two: set stage_two.start_epoch")):
        train(validate(job(tmp_path / "bad", quick_data, stage_two={"lr": 0.001}), SCHEMA, RULES))


def test_nan_is_never_masked(quick_data, tmp_path):
    """Unlabelled entries are left out by label masks, but a non-finite prediction of a labelled one makes
    the loss and the errors non-finite, and training stops naming the epoch and the structures."""
    from mlip_parallel.train.training import Batch, Counts, TrainingError, loss_terms, prediction_errors
    from mlip_parallel.train.sources import read_structures

    structures = read_structures(quick_data)[:3]
    structures[1].forces = None  # unlabelled: no force term from it
    model = potentials.SchNet(["Cu"], cutoff=4.0, features=8, layers=2, seed=0).double()
    batch = Batch(structures, model, model.device)
    energy = torch.as_tensor([s.energy for s in structures], dtype=torch.float64)
    forces = torch.zeros(len(batch.species), 3, dtype=torch.float64)
    stress = batch.stress.nan_to_num()
    terms = loss_terms(energy, forces, stress, batch, Counts.of(structures))
    assert all(torch.isfinite(t) for t in terms.values()) and terms["energy"] == 0
    forces[0, 0] = float("nan")  # a labelled component predicted NaN
    assert torch.isnan(loss_terms(energy, forces, stress, batch, Counts.of(structures))["forces"])
    assert np.isnan(prediction_errors(batch, forces=forces)[3])

    broken = tmp_path / "nan.pt"  # a model whose every prediction is NaN
    with torch.no_grad():
        model.readout[-1].bias.fill_(float("nan"))
    potentials.save(model, broken)
    config = job(tmp_path / "nan_run", quick_data, model={"checkpoint": str(broken), "dtype": "float64"})
    with pytest.raises(TrainingError, match=r"epoch 1: the loss is not finite; non-finite predictions for .*cu_quick"):
        train(validate(config, SCHEMA, RULES))


def test_config_error_reported_once_under_mpiexec(mpirun, tmp_path):
    """A config error prints one line for the whole job and every rank exits 2, before torch is imported."""
    (tmp_path / "bad.yaml").write_text("epochs: 2\nlearning_rate: 0.1\n")
    code = ("import sys; from mlip_parallel.train.cli import main; status = main(sys.argv[1:]); "
            "import os; os.write(1, f\"torch imported: {'torch' in sys.modules}\\n\".encode()); sys.exit(status)")
    # one write call per rank: two ranks' print() pieces can interleave in mpiexec's merged output
    for config in (tmp_path / "missing.yaml", tmp_path / "bad.yaml"):
        rc, out, _ = mpirun(2, "-c", code, config, timeout=60)
        assert rc == 2 and out.count("mlip-train: error:") == 1 and "Traceback" not in out, out
        assert out.count("torch imported: False") == 2, out
    assert "unknown key learning_rate" in out, out


def test_output_directory_not_overwritten_and_eval_header(quick_data, tmp_path, capsys):
    """A non-empty output directory is refused unless output.overwrite or resume; eval names what it scores."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty"):
        train(validate(job(used, quick_data), SCHEMA, RULES))
    assert (used / "notes.txt").read_text() == "mine" and not (used / "last.pt").exists()
    train(validate(job(used, quick_data, epochs=1, output={"directory": str(used), "overwrite": True}), SCHEMA, RULES))
    assert "output in" in capsys.readouterr().out
    assert main(["eval", "cu-emt", str(quick_data)]) == 0
    out = capsys.readouterr().out
    assert "scoring every structure of" in out and "14 structures" in out and "PaiNN ['Cu']" in out, out


def test_reads_ase_db_with_labels(quick_data, tmp_path):
    from ase.io import read

    from mlip_parallel.train.sources import read_structures

    frames = read(quick_data, ":")
    write(tmp_path / "data.db", frames)
    from_db, from_xyz = read_structures(tmp_path / "data.db"), read_structures(quick_data)
    assert len(from_db) == len(from_xyz)
    for a, b in zip(from_db, from_xyz):
        assert a.energy == pytest.approx(b.energy)
        assert_close({"forces": a.forces, "stress": a.stress}, {"forces": b.forces, "stress": b.stress}, 1e-8,
                     scale="absolute", label="db vs extxyz")


def test_help_documents_every_key(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for key in ("train", "validation_fraction", "hyperparameters", "forces_weight", "gradient_clip", "patience",
                "ema_decay", "batch_size", "parallel", "resume", "directory", "stages", "microbatches", "schedule",
                "boundaries", "two_bw", "recompute", "merge"):
        assert key in out, key


def test_bundled_model_matches_emt_on_held_out_structures():
    """cu-emt (trained with mlip-train on examples/generate_cu_emt_data.py, seed 0) on fresh structures
    (seed 1234) at 300–900 K: force MAE ≤ 50 meV/Å."""
    from mlip_parallel.train.training import error_sums, error_table
    from mlip_parallel.train.sources import read_structures

    model = potentials.load("cu-emt")
    held_out = [a for a in generator.generate(seed=1234, frames=6) if a.info["temperature_K"] <= 900]
    path = ROOT / ".pytest_cache" / "cu_emt_held_out.extxyz"
    path.parent.mkdir(exist_ok=True)
    write(path, held_out, format="extxyz")
    errors = error_table(error_sums(model, read_structures(path), 8, model.device))
    print(f"cu-emt on {len(held_out)} held-out structures: force MAE {1e3 * errors['forces_mae']:.1f} meV/A, "
          f"energy MAE {1e3 * errors['energy_mae']:.2f} meV/atom")
    assert errors["forces_mae"] <= 0.050, errors
