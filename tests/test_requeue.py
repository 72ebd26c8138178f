"""Crash-consistent runs: a job killed with SIGKILL (its whole process group) at seeded random moments and
requeued with the identical command until it exits 0 ends with the outputs of an uninterrupted run, bit
for bit (mlip-md: thermo rows, trajectory frames, final.extxyz; mlip-train: weights and metrics); a full
disk ends the job with one line naming the file and the last restart, which continues the run; a restart
refuses output files that are not the ones it recorded."""
import contextlib
import csv
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import yaml
from ase.io import read, write

from conftest import HANG_GUARD, ROOT, mpiexec_path
from mlip_parallel.launch import yield_when_oversubscribed

pytestmark = pytest.mark.slow  # (jobs killed and requeued: left out of the quick tier)

KILLS = 3  # SIGKILLs per requeued job, each at a seeded random moment
TIMING = {"seconds_per_step", "force_s", "halo_s", "neighbour_s", "integrate_s", "output_s", "seconds"}

MD_JOB = {
    "model": {"lennard_jones": {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 8.0}},
    "structure": {"element": "Ar", "crystal": "fcc", "a": 5.26, "repeat": [3, 3, 3]},
    "temperature_K": 100, "ensemble": "langevin", "thermostat": {"temperature_K": 100}, "timestep_fs": 4.0,
    "steps": 300, "seed": 3, "resume": True,
    "output": {"directory": "out", "thermo_every": 5, "trajectory_every": 10, "restart_every": 40},
}


def command(n, *args):
    return [mpiexec_path(), "-n", str(n), sys.executable, *map(str, args)]


def environment(n):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    yield_when_oversubscribed(env, ranks=n)
    return env


def launch(cmd, cwd, env):
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: mpiexec, its proxies, the ranks


def finish(cmd, cwd, env, started: str) -> tuple:
    """(exit status, output, seconds from the line that holds ``started``, the job's start of work, to its
    end) of ``cmd`` run to its end."""
    proc = launch(cmd, cwd, env)
    lines, begun = [], threading.Event()
    reader = threading.Thread(target=follow, args=(proc, lines, begun, started))
    reader.start()
    reader.join(HANG_GUARD)
    if reader.is_alive():
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{' '.join(cmd)} did not finish within {HANG_GUARD} s (hang?)")
    proc.wait()
    return proc.returncode, "".join(lines), time.perf_counter() - begun.time


def follow(proc, lines, begun, started) -> None:
    """Collect ``proc``'s output lines; set ``begun`` (with the time, ``begun.time``) at the first that
    holds ``started``, or at the end of the output."""
    for line in proc.stdout:
        if not begun.is_set() and started in line:  # merged with stderr: a progress bar may precede it
            begun.time = time.perf_counter()
            begun.set()
        lines.append(line)
    if not begun.is_set():  # ended (or was killed) before it
        begun.time = time.perf_counter()
        begun.set()


def requeue(cmd, cwd, env, started: str, delays, outputs=None, progress=None) -> list:
    """Run ``cmd`` in ``cwd`` as a batch scheduler requeues a job: the k-th launch is killed (SIGKILL to
    its process group) ``delays[k]`` seconds after it prints a line holding ``started`` (``progress``, a function
    counting the work recorded so far: after the count first grows in this launch), unless it ended before; then
    once more to its end. Every launch must end killed or with status 0; the first that exits 0 ends the job.
    Returns the launches' outcomes ("killed" or "done"); ``outputs`` (a list) gets each launch's output."""
    outputs = [] if outputs is None else outputs
    outcomes = []
    for delay in delays:
        recorded = progress() if progress else None
        proc = launch(cmd, cwd, env)
        lines, begun = [], threading.Event()
        reader = threading.Thread(target=follow, args=(proc, lines, begun, started))
        reader.start()
        begun.wait(HANG_GUARD)
        while progress and progress() == recorded and proc.poll() is None:
            time.sleep(0.02)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join()
            outputs.append("".join(lines))
            outcomes.append("killed")
            continue
        reader.join()
        outputs.append("".join(lines))
        assert proc.returncode == 0, "".join(lines)
        return outcomes + ["done"]
    rc, out, _ = finish(cmd, cwd, env, started)
    outputs.append(out)
    assert rc == 0, out
    return outcomes + ["done"]


def thermo(directory) -> list:
    """thermo.csv's rows without the timing columns, as written (strings: bit for bit)."""
    with open(directory / "thermo.csv", newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def straight_and_requeued(tmp_path, job: dict, seed: int) -> tuple:
    """mlip-md ``job`` on 2 ranks straight through in tmp_path/straight, then in tmp_path/requeued killed (SIGKILL)
    at ``KILLS`` moments drawn with ``seed`` within the first 30 % of the straight run's time after its start-up,
    and requeued with the identical command until it ends (each launch killed: together they run at most 90 % of
    it). Returns (the command, its environment, the straight run's output directory, the requeued one's)."""
    env = environment(2)
    for name in ("straight", "requeued"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "job.yaml").write_text(yaml.safe_dump(job))
    cmd = command(2, "-m", "md.cli", "job.yaml")
    rc, out, seconds = finish(cmd, tmp_path / "straight", env, "mlip-md: 108 atoms")
    assert rc == 0 and "steps 0 to 300" in out, out
    delays = np.random.default_rng(seed).uniform(0.0, 0.3, size=KILLS) * seconds  # of the run's time after start-up
    outcomes = requeue(cmd, tmp_path / "requeued", env, "mlip-md: 108 atoms", delays)
    assert outcomes == ["killed"] * KILLS + ["done"], outcomes
    return cmd, env, tmp_path / "straight" / "out", tmp_path / "requeued" / "out"


# a committee of two Lennard-Jones models: mlip-md's uncertainty (a row of model_devi.csv every 5 steps, the frames of
# max_devi_f in [0.016, 0.022] eV/Å into candidates.extxyz) among the outputs a requeue must keep whole
COMMITTEE_JOB = dict(MD_JOB, model={"committee": [
    {"lennard_jones": {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 8.0}},
    {"lennard_jones": {"epsilon": 0.0110, "sigma": 3.42, "cutoff": 8.0}}]},
    uncertainty={"every": 5, "select": [0.016, 0.022]})


def test_mlip_md_killed_at_random_moments_and_requeued_equals_an_uninterrupted_run(tmp_path):
    """2 ranks, Langevin, a committee, thermo and model deviations every 5 steps, a frame every 10, a restart every
    40 of 300 steps: killed at 3 seeded random moments of the run (after its start-up) and requeued with the identical
    command: thermo rows, trajectory, final frame, model_devi.csv and candidates.extxyz equal the uninterrupted run's
    byte for byte (no frame twice, none lost)."""
    cmd, env, straight, requeued = straight_and_requeued(tmp_path, COMMITTEE_JOB, seed=35)
    rows = thermo(straight)
    assert [int(r["step"]) for r in rows] == list(range(0, 301, 5))
    assert thermo(requeued) == rows
    with open(straight / "model_devi.csv") as f:
        deviations = list(csv.DictReader(f))
    assert [int(r["step"]) for r in deviations] == list(range(0, 301, 5))
    candidates = read(straight / "candidates.extxyz", index=":")
    chosen = [int(r["step"]) for r in deviations if 0.016 <= float(r["max_devi_f"]) <= 0.022]
    assert [f.info["step"] for f in candidates] == chosen and 0 < len(chosen) < len(deviations) / 2, chosen
    for name in ("trajectory.extxyz", "final.extxyz", "model_devi.csv", "candidates.extxyz"):
        assert (requeued / name).read_bytes() == (straight / name).read_bytes(), name
    frames = read(requeued / "trajectory.extxyz", index=":")
    assert [f.info["step"] for f in frames] == list(range(0, 301, 10))
    assert not list(requeued.glob(".*.partial")), list(requeued.iterdir())

    # the disk fills during the run: one line names the file, the reason and the last restart; the same
    # command, with space again, continues from that restart to the uninterrupted run's outputs
    full = tmp_path / "full"
    (full / "out").mkdir(parents=True)
    (full / "job.yaml").write_text(yaml.safe_dump(COMMITTEE_JOB))
    with small_disk(full / "out", 120_000) as mounted:
        short = cmd if mounted else command(2, ROOT / "tests" / "mpi" / "disk_full.py", 120_000, full / "out",
                                            "-m", "md.cli", "job.yaml")
        rc, out, seconds = finish(short, full, env, "mlip-md: 108 atoms")
        errors = [line for line in out.splitlines() if "mlip-md: error:" in line]
        assert rc != 0 and len(errors) == 1 and "Traceback" not in out and seconds < 60, out
        found = re.search(r"mlip-md: error: cannot write out/\S+: \[Errno 28\] No space left on device; "
                          r"last restart written: out/restart.npz \(step (\d+)\)$", errors[0])
        assert found and 0 < int(found[1]) < 300, errors
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=16m", str(full / "out")], check=True)
        rc, out, _ = finish(cmd, full, env, "mlip-md: 108 atoms")
        assert rc == 0 and f"steps {found[1]} to 300" in out, out
        assert thermo(full / "out") == rows
        for name in ("trajectory.extxyz", "final.extxyz", "model_devi.csv", "candidates.extxyz"):
            assert (full / "out" / name).read_bytes() == (straight / name).read_bytes(), name

    # a restart refuses output files that are not the ones it recorded, and leaves them as they are
    from md.cli import ConfigError, validate
    from md.start import prepare
    config = validate(dict(COMMITTEE_JOB, output=dict(MD_JOB["output"], directory=str(requeued))))
    thermo_csv, trajectory = requeued / "thermo.csv", requeued / "trajectory.extxyz"
    with open(thermo_csv, "a") as f:
        f.write("300,partial row")  # written after the restart: cut back, not refused
    prepare(config)
    text = thermo_csv.read_bytes()
    thermo_csv.write_bytes(text.replace(b",", b";", 1))
    with pytest.raises(ConfigError, match="thermo.csv has different contents than when .*restart.npz was written"):
        prepare(config)
    assert thermo_csv.read_bytes() == text.replace(b",", b";", 1)
    trajectory.write_bytes(trajectory.read_bytes()[:trajectory.stat().st_size // 2])
    thermo_csv.write_bytes(text)
    with pytest.raises(ConfigError, match=r"trajectory.extxyz is shorter \(\d+ bytes\) than when"):
        prepare(config)
    trajectory.unlink()
    with pytest.raises(ConfigError, match="trajectory.extxyz is missing"):
        prepare(config)


def test_mlip_batch_killed_at_random_moments_and_resumed_equals_an_uninterrupted_run(tmp_path):
    """mlip-batch relaxations (cu-emt, cell filter) of 12 structures on 2 ranks, killed at 3 seeded random moments
    of the run (each after the launch recorded a structure: a batch's structures finish together, late in a launch)
    and started again with resume: true (the last launch finds some done and does the rest): every
    structure is recorded exactly once over the ranks' parts,
    results.extxyz holds each once in input order, with the steps and convergence of the uninterrupted run and its
    positions, cells, energies and forces within 1e-9 (the structures met other batch partners: summation order)."""
    from test_batch import cu_cells

    job = {"model": {"checkpoint": "cu-emt"}, "structures": "structures.extxyz", "task": "relax",
           "relax": {"fmax": 0.05, "max_steps": 20, "cell": True}, "resume": True,
           "output": {"directory": "out", "progress": False}}
    env = environment(2)
    for name in ("straight", "requeued"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "job.yaml").write_text(yaml.safe_dump(job))
        write(tmp_path / name / "structures.extxyz", cu_cells(12, seed=12))
    cmd = command(2, "-m", "md.batch_cli", "job.yaml")
    rc, out, seconds = finish(cmd, tmp_path / "straight", env, "mlip-batch: 12 structures")
    assert rc == 0, out
    delays = np.random.default_rng(37).uniform(0.0, 0.1, size=KILLS) * seconds
    outputs, parts = [], tmp_path / "requeued" / "out" / "parts"
    done = lambda: sum(len(f.read_bytes().splitlines()) for f in parts.glob("rank*.done"))  # noqa: E731
    outcomes = requeue(cmd, tmp_path / "requeued", env, "mlip-batch: 12 structures", delays, outputs, done)
    assert outcomes == ["killed"] * KILLS + ["done"], outcomes
    before = [int(m) for m in re.findall(r"\((\d+) done before\)", "".join(outputs))]
    assert len(before) == KILLS + 1 and before[0] == 0 and 0 < before[-1] < 12, before  # (kills cut the run)
    recorded = [int(line.split()[0]) for f in sorted(parts.glob("rank*.done")) for line in f.read_text().splitlines()]
    assert sorted(recorded) == list(range(12)), recorded
    straight = read(tmp_path / "straight" / "out" / "results.extxyz", ":")
    resumed = read(tmp_path / "requeued" / "out" / "results.extxyz", ":")
    assert [a.info["index"] for a in resumed] == list(range(12))
    for k, (a, b) in enumerate(zip(resumed, straight)):
        assert (a.info["steps"], a.info["converged"]) == (b.info["steps"], b.info["converged"]), k
        for name, x, y in (("positions", a.positions, b.positions), ("cell", a.cell[:], b.cell[:]),
                           ("forces", a.get_forces(), b.get_forces()),
                           ("energy", a.get_potential_energy(), b.get_potential_energy())):
            assert np.abs(np.asarray(x) - np.asarray(y)).max() <= 1e-9, (k, name)


@contextlib.contextmanager
def small_disk(directory, size: int):
    """Mount a tmpfs of ``size`` bytes on ``directory`` where this process may (yields True; unmounted at
    the end), else yield False (the caller fills the disk through tests/mpi/disk_full.py)."""
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                                 capture_output=True).returncode == 0
    except OSError:  # no mount command
        mounted = False
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)


def test_trajectory_files_cut_back_to_a_restart(tmp_path):
    """An extxyz and an ASE .traj trajectory, recorded after 3 frames, then 2 more frames and a partial one
    written: cut back, they hold the 3 frames whole, and the 2 frames written again give the bytes of the
    file written straight through (the .traj header's frame count and offset table restored)."""
    from ase.build import bulk
    from ase.calculators.singlepoint import SinglePointCalculator

    from md.job import THERMO_COLUMNS
    from md.outputs import RunFiles, check_recorded, cut_back

    def frames(n):
        atoms = bulk("Cu", cubic=True).repeat(2)
        out = []
        for k in range(n):
            frame = atoms.copy()
            frame.positions += 0.01 * k
            frame.info["step"] = k
            frame.calc = SinglePointCalculator(frame, energy=-1.0 * k, forces=np.full((len(frame), 3), 0.1 * k))
            out.append(frame)
        return out

    for name in ("trajectory.extxyz", "trajectory.traj"):
        for run in ("straight", "cut"):
            (tmp_path / run).mkdir(exist_ok=True)
            files = RunFiles(tmp_path / run, THERMO_COLUMNS, name, fresh=True)
            for k, frame in enumerate(frames(5)):
                if run == "cut" and k == 3:
                    record = files.record()
                files.frame(frame)
            files.close()
        path = tmp_path / "cut" / name
        with open(path, "ab") as f:
            f.write(b"\x00partial frame" * 10)
        check_recorded(tmp_path / "cut", record, "restart.npz")
        cut_back(tmp_path / "cut", record)
        assert [f.info["step"] for f in read(path, index=":")] == [0, 1, 2], name
        files = RunFiles(tmp_path / "cut", THERMO_COLUMNS, name, fresh=False)
        for frame in frames(5)[3:]:
            files.frame(frame)
        files.close()
        assert path.read_bytes() == (tmp_path / "straight" / name).read_bytes(), name
        assert [f.info["step"] for f in read(path, index=":")] == [0, 1, 2, 3, 4], name


def cu_data(path):
    spec = importlib.util.spec_from_file_location("generate_cu_emt_data", ROOT / "examples" / "generate_cu_emt_data.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    write(path, generator.generate(seed=0, quick=True), format="extxyz")
    return path


def train_job(data_path, **changes):
    config = {"data": {"train": str(data_path), "validation_fraction": 0.25},
              "model": {"name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 8, "layers": 2},
                        "dtype": "float64"},
              "loss": {"energy_weight": 1.0, "forces_weight": 10.0, "stress_weight": 1.0},
              "optimizer": {"lr": 0.005}, "ema_decay": 0.9, "epochs": 16, "batch_size": 2, "seed": 1,
              "resume": True, "output": {"directory": "out"}}
    return dict(config, **changes)


def tensors(path, key=None):
    state = torch.load(path, weights_only=True)
    return state[key] if key else state


def same(a, b) -> bool:
    """Nested states equal bit for bit (tensors, numbers, containers)."""
    if isinstance(a, dict):
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("parallel", ["data", "pipeline"])
def test_mlip_train_killed_at_random_moments_and_requeued_equals_an_uninterrupted_run(tmp_path, parallel):
    """mlip-train on 2 ranks (data parallel; 2 pipeline stages, 1F1B), 16 epochs, killed at 3 seeded random
    moments and requeued with the identical command: best.pt, last.pt (and the stages' shards) and
    metrics.csv equal the uninterrupted run's bit for bit (but the seconds column). Data parallel: streamed data,
    last.pt every 2 steps of an epoch's 5 (a kill mid-epoch resumes mid-epoch), 7 warm-up steps, then cosine."""
    data = cu_data(tmp_path / "cu.extxyz")
    changes = {"parallel": "pipeline", "pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"}} \
        if parallel == "pipeline" else \
        {"parallel": "data", "data": {"train": str(data), "validation_fraction": 0.25, "stream": True},
         "output": {"directory": "out", "checkpoint_every": 2}, "schedule": {"name": "cosine", "warmup_steps": 7}}
    env = environment(2)
    for name in ("straight", "requeued"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "job.yaml").write_text(yaml.safe_dump(train_job(data, **changes)))
    cmd = command(2, "-m", "mlip_parallel.train.cli", "job.yaml")
    rc, out, seconds = finish(cmd, tmp_path / "straight", env, "mlip-train: SchNet")
    assert rc == 0, out
    delays = np.random.default_rng(36).uniform(0.0, 0.3, size=KILLS) * seconds  # of the run's time after start-up
    outcomes = requeue(cmd, tmp_path / "requeued", env, "mlip-train: SchNet", delays)
    assert outcomes == ["killed"] * KILLS + ["done"], outcomes
    straight, requeued = tmp_path / "straight" / "out", tmp_path / "requeued" / "out"
    with open(straight / "metrics.csv") as f:
        rows = [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]
    with open(requeued / "metrics.csv") as f:
        assert [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)] == rows
    assert [int(r["epoch"]) for r in rows] == list(range(1, 17))
    for name in ("best.pt", "last.pt"):
        assert same(tensors(requeued / name), tensors(straight / name)), name
    shards = sorted(p.name for p in (straight / "pipeline").glob("stage*.pt")) if parallel == "pipeline" else []
    steps = int(rows[-1]["step"])  # one shard per stage, of the last step
    assert shards == ([f"stage0.step{steps}.pt", f"stage1.step{steps}.pt"] if parallel == "pipeline" else [])
    assert sorted(p.name for p in (requeued / "pipeline").glob("stage*.pt")) == shards if shards else True
    for name in shards:
        a, b = (tensors(d / "pipeline" / name, "training") for d in (straight, requeued))
        for state in (a, b):  # timings: the measured costs, and the warm-up's steps (none once the costs are known)
            assert state["pipeline"].pop("warm_up") is None
            state["pipeline"].pop("costs", None)
        assert same(a, b), name


def test_mlip_train_disk_full_names_the_file_and_the_last_checkpoint(tmp_path):
    """mlip-train (one process) whose disk fills after some epochs: exit status 1 and one line naming the
    file, the reason and the last complete last.pt; the same command, with space again, finishes the run."""
    data = cu_data(tmp_path / "cu.extxyz")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(train_job(data, epochs=6)))
    env = environment(1)
    script = [sys.executable, ROOT / "tests" / "mpi" / "disk_full.py", 400_000, tmp_path / "out",
              "-m", "mlip_parallel.train.cli", "job.yaml"]
    rc, out, _ = finish([str(a) for a in script], tmp_path, env, "mlip-train: SchNet")
    errors = [line for line in out.splitlines() if "mlip-train: error:" in line]
    assert rc == 1 and len(errors) == 1 and "Traceback" not in out, out
    found = re.search(r"error: cannot write out/\S+: \[Errno 28\] No space left on device; last checkpoint "
                      r"written: out/last.pt \(epoch (\d+), step \d+\)$", errors[0])
    assert found and 0 < int(found[1]) < 6, errors
    rc, out, _ = finish([sys.executable, "-m", "mlip_parallel.train.cli", "job.yaml"], tmp_path, env, "mlip-train")
    assert rc == 0, out
    with open(tmp_path / "out" / "metrics.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == list(range(1, 7))
