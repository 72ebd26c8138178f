"""Crash-consistent runs: a job killed with SIGKILL (its whole process group) at seeded random moments and
requeued with the identical command until it exits 0 ends with the outputs of an uninterrupted run, bit
for bit (mlip-md: thermo rows, trajectory frames, final.extxyz; mlip-train: weights and metrics); a full
disk ends the job with one line naming the file and the last restart, which continues the run; a restart
refuses output files that are not the ones it recorded."""
import csv
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from ase.io import read

from conftest import HANG_GUARD, ROOT, mpiexec_path
from mlip_parallel.launch import yield_when_oversubscribed

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


def finish(cmd, cwd, env) -> tuple:
    """(exit status, output, seconds) of ``cmd`` run to its end."""
    start = time.perf_counter()
    proc = launch(cmd, cwd, env)
    try:
        out, _ = proc.communicate(timeout=HANG_GUARD)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{' '.join(cmd)} did not finish within {HANG_GUARD} s (hang?)")
    return proc.returncode, out, time.perf_counter() - start


def requeue(cmd, cwd, env, moments) -> list:
    """Run ``cmd`` in ``cwd``, killing its process group with SIGKILL ``moments[k]`` seconds after the
    k-th launch, then once more to its end (as a batch scheduler requeues a job); every launch must end
    killed or with status 0. Returns the launches' outcomes ("killed" or "done")."""
    outcomes = []
    for moment in moments:
        proc = launch(cmd, cwd, env)
        try:
            out, _ = proc.communicate(timeout=moment)
            assert proc.returncode == 0, out
            outcomes.append("done")
            continue
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            outcomes.append("killed")
    rc, out, _ = finish(cmd, cwd, env)
    assert rc == 0, out
    return outcomes + ["done"]


def thermo(directory) -> list:
    """thermo.csv's rows without the timing columns, as written (strings: bit for bit)."""
    with open(directory / "thermo.csv", newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def test_mlip_md_killed_at_random_moments_and_requeued_equals_an_uninterrupted_run(tmp_path):
    """2 ranks, Langevin, thermo every 5 steps, a frame every 10, a restart every 40 of 300 steps: killed at
    5 seeded random moments of the run (after its start-up) and requeued with the identical command."""
    env = environment(2)
    for name in ("straight", "requeued"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "job.yaml").write_text(yaml.safe_dump(MD_JOB))
    cmd = command(2, "-m", "md.cli", "job.yaml")
    rc, out, seconds = finish(cmd, tmp_path / "straight", env)
    assert rc == 0 and "steps 0 to 300" in out, out
    moments = np.random.default_rng(35).uniform(0.5, 1.0, size=5) * seconds  # start-up takes about half
    outcomes = requeue(cmd, tmp_path / "requeued", env, moments)
    assert outcomes.count("killed") >= 3, outcomes
    straight, requeued = tmp_path / "straight" / "out", tmp_path / "requeued" / "out"
    rows = thermo(straight)
    assert [int(r["step"]) for r in rows] == list(range(0, 301, 5))
    assert thermo(requeued) == rows
    for name in ("trajectory.extxyz", "final.extxyz"):
        assert (requeued / name).read_bytes() == (straight / name).read_bytes(), name
    frames = read(requeued / "trajectory.extxyz", index=":")
    assert [f.info["step"] for f in frames] == list(range(0, 301, 10))
    assert not list(requeued.glob(".*.partial")), list(requeued.iterdir())
