"""mlip-md: a YAML job under mpiexec writes its thermo table, trajectory, final structure, plot and
summary; bad configurations name the key, once per job, before anything is written."""
import csv
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from ase.io import read

from comparison import assert_beyond, assert_close
from conftest import HANG_GUARD, ROOT, assert_log_lines
from md.cli import ConfigError, schema_help, validate
from md.start import build_model, prepare

JOB = {
    "model": {"lennard_jones": {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 8.0}},
    "structure": {"element": "Ar", "crystal": "fcc", "a": 5.26, "repeat": [3, 3, 3]},
    "temperature_K": 100, "ensemble": "npt", "thermostat": {"temperature_K": 100, "tdamp_fs": 100.0},
    "barostat": {"pressure_GPa": 0.5, "pdamp_fs": 200.0, "isotropic": False}, "balance_every": 10,
    "timestep_fs": 4.0, "steps": 40, "seed": 3, "memory_budget_gb": 0.5,
}


def bad_configs(tmp_path) -> dict:
    """Config files that mlip-md refuses, each with its expected message."""
    tmp_path.mkdir()
    (tmp_path / "hello.txt").write_text("hello\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "thermo.csv").write_text("step\n")
    cases = {
        "missing.yaml": (None, "cannot read config"),
        "typo.yaml": ({"temprature_K": 300}, "unknown key temprature_K (did you mean temperature_K?"),
        "iron.yaml": ({"structure": {"element": "Fe", "crystal": "bcc", "a": 2.87, "repeat": [2, 2, 2]},
                       "output": {"directory": str(tmp_path / "iron")}},
                      "structure: element(s) ['Fe'] not known to PaiNN; it knows ['Cu']"),
        "text.yaml": ({"model": {"checkpoint": str(tmp_path / "hello.txt")},
                       "output": {"directory": str(tmp_path / "t")}},
                      f"model.checkpoint: {tmp_path / 'hello.txt'}: not a checkpoint"),
        "full.yaml": (dict(JOB, output={"directory": str(tmp_path / "full")}), "is not empty (thermo.csv)"),
    }
    if not torch.cuda.is_available():
        cases["gpu.yaml"] = ({"device": "cuda", "output": {"directory": str(tmp_path / "gpu")}},
                             "device: cuda, but torch sees no CUDA device")
    for name, (config, _) in cases.items():
        if config is not None:
            (tmp_path / name).write_text(yaml.safe_dump(config))
    return {str(tmp_path / name): message for name, (_, message) in cases.items()}


SCRIPT = """import sys
from md.cli import main
codes = [main([path]) for path in sys.argv[2:]]
sys.stdout.write(f"error exit codes {codes}\\n")  # one write: the two ranks' lines must not interleave
sys.stdout.flush()
sys.exit(main([sys.argv[1]]))
"""


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(mpirun, tmp_path):
    """stderr_is_terminal: true for a terminal (a pseudo-terminal here), also for a rank of mpiexec whose
    launcher writes to one (the rank itself writes into a pipe); false for a file. Progress then draws tqdm's
    bar, writes a plain line per ``every_seconds`` (and at the end), or nothing ("off": mlip-md's
    --no-progress, whose progress is otherwise a line in a log file)."""
    import contextlib
    import io
    import os
    import pty

    from mlip_parallel.progress import Progress

    probe = "from mlip_parallel.progress import stderr_is_terminal as t; import sys; print(t(sys.stderr))"
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        for command in ([sys.executable, "-c", probe], [mpirun.launcher, "-n", "1", sys.executable, "-c", probe]):
            run = subprocess.run(command, stdout=subprocess.PIPE, stderr=slave, text=True, env=env, timeout=120)
            assert run.stdout.strip() == "True", (command, run.stdout)
    finally:
        os.close(master), os.close(slave)
    with open(tmp_path / "log", "w") as log:
        run = subprocess.run([mpirun.launcher, "-n", "1", sys.executable, "-c", probe], stdout=subprocess.PIPE,
                             stderr=log, text=True, env=env, timeout=120)
    assert run.stdout.strip() == "False", run.stdout

    stream = io.StringIO()
    progress = Progress("job", 10, 2, "step", mode="lines", every_seconds=0, stream=stream)
    for n in range(3, 11):
        progress.update(n, loss="0.5")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 8 and re.fullmatch(r"job: step 10/10 \(100 %\), \S+ step/s, ETA 00:00:00, loss 0.5", lines[-1])
    stream = io.StringIO()
    progress = Progress("job", 10, 0, mode="lines", every_seconds=3600, stream=stream)
    for n in range(1, 11):
        progress.update(n)
    assert stream.getvalue().count("\n") == 1 and "step 10/10" in stream.getvalue()  # only the end, within the hour
    stream = io.StringIO()
    slow = Progress("job", 100_000, 0, mode="off", stream=stream)
    slow.n = 1  # one step in the first second: 99,999 s to go, past a day (once printed modulo a day: 03:46:39)
    assert slow.line(slow.start + 1.0, {}).endswith("1 step/s, ETA 27:46:39"), slow.line(slow.start + 1.0, {})

    Progress("job", 10, mode="off", stream=stream).update(10)
    assert stream.getvalue() == ""
    from md.cli import main

    job = dict(JOB, ensemble="nve", barostat={}, steps=10, output={"directory": str(tmp_path / "md")})
    (tmp_path / "md.yaml").write_text(yaml.safe_dump(job))
    with open(tmp_path / "stderr", "w") as err, contextlib.redirect_stderr(err):  # a log file
        assert main([str(tmp_path / "md.yaml"), "--no-progress"]) == 0
        job["output"]["directory"] = str(tmp_path / "md2")
        (tmp_path / "md.yaml").write_text(yaml.safe_dump(job))
        assert main([str(tmp_path / "md.yaml")]) == 0
    assert (tmp_path / "stderr").read_text().count("mlip-md: step 10/10 (100 %)") == 1  # the second run's
    stream = io.StringIO()
    bar = Progress("job", 10, mode="bar", stream=stream)
    bar.update(5)
    bar.close()
    assert "\r" in stream.getvalue() and "5/10" in stream.getvalue()


def test_mlip_md_job_under_mpiexec(mpirun, tmp_path):
    """One 2-rank launch: first bad configs (every rank exits 2, rank 0 alone prints one line, nothing is
    written), then NPT with load balancing and an ASE .traj trajectory (frames with step, time, energy,
    forces; a summary; thermo.png; full-precision final.extxyz); then 20 + 20 steps through a restart file
    in one process equal the 2-rank 40-step run, and a second run into the same directory is refused."""
    config = dict(JOB, output={"directory": str(tmp_path / "out"), "thermo_every": 10, "trajectory_every": 20,
                               "trajectory_format": "traj"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "script.py").write_text(SCRIPT)
    errors = bad_configs(tmp_path / "bad")
    rc, out, _ = mpirun(2, tmp_path / "script.py", tmp_path / "job.yaml", *errors)
    assert rc == 0, out
    assert out.count(f"error exit codes {[2] * len(errors)}") == 2, out  # on both ranks
    assert out.count("mlip-md: error:") == len(errors) and "Traceback" not in out, out
    for message in errors.values():
        assert out.count(message) == 1, (message, out)
    assert not (tmp_path / "bad" / "iron").exists() and not (tmp_path / "bad" / "t").exists()
    assert "108 atoms on 2 rank(s) (MPICH" in out and "x 1 thread(s)" in out and "done in" in out, out
    assert_log_lines(out, "mlip-md: step 40/40 (100 %)", [tmp_path])
    assert "% of time" in out and all(f"\n{phase} " in out for phase in ("force", "halo", "neighbour", "integrate")), out
    assert re.search(r"steps 20 to 40 \(second half, 21 samples\)", out), out
    for quantity in ("temperature_K", "pressure_GPa", "epot_eV/atom", "etot_eV/atom", "volume_A3"):
        assert re.search(rf"^  {re.escape(quantity)} +\S+ ± \S+$", out, re.M), (quantity, out)
    assert (tmp_path / "out" / "thermo.png").stat().st_size > 1000
    with open(tmp_path / "out" / "thermo.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 10, 20, 30, 40]
    for column in ("time_fs", "temperature_K", "epot_eV", "ekin_eV", "etot_eV", "pressure_GPa", "volume_A3",
                   "seconds_per_step", "force_s", "halo_s", "neighbour_s", "integrate_s", "output_s"):
        assert column in rows[0]
    frames = read(tmp_path / "out" / "trajectory.traj", index=":")
    assert len(frames) == 3 and len(frames[0]) == 108  # steps 0, 20, 40
    final = read(tmp_path / "out" / "final.extxyz")
    for frame in (frames[-1], final):
        assert frame.info["step"] == 40 and frame.info["time_fs"] == 160.0
        assert frame.get_potential_energy() == float(rows[-1]["epot_eV"])
        assert frame.get_forces().shape == (108, 3)
        assert_beyond(frame.get_forces(), np.zeros((108, 3)), 0.0, scale="absolute", label="forces")
        assert frame.get_stress().shape == (6,)
    assert_close(final.get_temperature(), float(rows[-1]["temperature_K"]), 1e-6, scale="absolute", label="temperature")
    assert_close(final.get_volume(), float(rows[-1]["volume_A3"]), 1e-6, scale="absolute", label="volume")
    with np.load(tmp_path / "out" / "restart.npz") as restart:
        assert np.array_equal(final.positions, restart["positions"])  # full precision
        assert np.array_equal(final.cell[:], restart["cell"])
    assert_beyond(frames[-1].get_volume(), frames[0].get_volume(), 1e-3, scale="each",
                  label="volume")  # the barostat moved the cell

    # 20 steps, then 20 more from the restart file == the 40-step run (here in one process: the
    # trajectory does not depend on the number of ranks; restarts under MPI: tests/mpi/md_engine.py)
    from md.cli import main
    half = dict(config, steps=20, output=dict(config["output"], directory=str(tmp_path / "half")))
    (tmp_path / "half.yaml").write_text(yaml.safe_dump(half))
    rest = dict(half, restart_from=str(tmp_path / "half" / "restart.npz"))
    (tmp_path / "rest.yaml").write_text(yaml.safe_dump(rest))
    assert main([str(tmp_path / "half.yaml")]) == 0 and main([str(tmp_path / "rest.yaml")]) == 0
    assert main([str(tmp_path / "half.yaml")]) == 2  # the directory holds a run now
    with open(tmp_path / "half" / "thermo.csv") as f:
        resumed = list(csv.DictReader(f))
    assert [int(r["step"]) for r in resumed] == [0, 10, 20, 30, 40]
    assert len(read(tmp_path / "half" / "trajectory.traj", index=":")) == 3  # steps 0, 20, 40: none twice
    columns = ("etot_eV", "volume_A3", "pressure_GPa")
    assert_close({c: [float(r[c]) for r in resumed] for c in columns},
                 {c: [float(r[c]) for r in rows] for c in columns}, 1e-9, scale="each", label="resumed thermo")


def test_torch_backend_under_torchrun_equals_one_process(torchrun, tmp_path):
    """mlip-md under torchrun (no MPI: the torch.distributed backend over gloo) on 3 ranks follows the
    one-process trajectory (NPT, rebalancing): thermo to 1e-9 and final positions to 1e-9 Å."""
    from md.cli import main
    config = dict(JOB, steps=20, output={"directory": str(tmp_path / "serial")})
    (tmp_path / "serial.yaml").write_text(yaml.safe_dump(config))
    assert main([str(tmp_path / "serial.yaml")]) == 0
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(dict(config, output={"directory": str(tmp_path / "torch")})))
    rc, out, _ = torchrun(3, "-m", "md.cli", tmp_path / "job.yaml")
    assert rc == 0 and "108 atoms on 3 rank(s) (torch.distributed gloo)" in out, out
    tables = []
    for run in ("serial", "torch"):
        with open(tmp_path / run / "thermo.csv") as f:
            tables.append(list(csv.DictReader(f)))
    serial, torch_run = ({c: [float(r[c]) for r in table] for c in ("etot_eV", "volume_A3", "pressure_GPa")}
                         for table in tables)
    assert_close(torch_run, serial, 1e-9, scale="each", label="torch.distributed thermo")
    final = [read(tmp_path / run / "final.extxyz") for run in ("serial", "torch")]
    assert_close(final[1].positions, final[0].positions, 1e-9, scale="absolute", label="final positions")


def test_bad_config_names_the_key(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        (dict(JOB, temprature_K=300), "unknown key temprature_K (did you mean temperature_K?"),
        (dict(JOB, output={"trajectory_evry": 3}), "unknown key output.trajectory_evry (did you mean "
                                                   "output.trajectory_every?"),
        (dict(JOB, output={"directory": str(tmp_path / "full")}), "is not empty (x); set output.overwrite: true"),
        (dict(JOB, model={"checkpoint": str(tmp_path / "data.csv")}), f"model.checkpoint: {tmp_path / 'data.csv'}: "),
        (dict(JOB, model={}, structure={"element": "Fe", "crystal": "bcc", "a": 2.87}), "element(s) ['Fe'] not known"),
        (dict(JOB, structure={"element": "Ar", "crystal": "fcc", "a": 5.26, "repeat": [2, 2, 1]}, barostat={},
              model={"checkpoint": "cu-emt"}), "element(s) ['Ar'] not known to PaiNN; it knows ['Cu'] (model: cu-emt)"),
        (dict(JOB, steps="many"), "steps must be int"),
        (dict(JOB, ensemble="npt-magic"), "ensemble must be one of"),
        (dict(JOB, barostat={"isotropic": "yes"}), "barostat.isotropic must be bool"),
        (dict(JOB, thermostat={"tdamp_fs": 0.0}), "thermostat.tdamp_fs must be a finite number > 0"),
        (dict(JOB, output={"trajectory_format": "pdb"}), "output.trajectory_format must be one of"),
        (dict(JOB, timestep_fs=-1.0), "timestep_fs must be a finite number > 0, got -1.0"),
        (dict(JOB, memory_budget_gb=0), "memory_budget_gb must be a finite number > 0, got 0"),
        (dict(JOB, memory_budget_gb="lots"), "memory_budget_gb must be float"),
        (dict(JOB, model={"sevennet": "7net-0", "checkpoint": "x.pt"}), "model takes one of"),
        (dict(JOB, model={"checkpoint": str(tmp_path / "none.pt")}), "model.checkpoint: "),
        (dict(JOB, structure={"file": str(tmp_path / "missing.xyz")}), "structure.file: cannot read"),
        (dict(JOB, structure={"repeat": [2, 2]}), "structure.repeat must be three positive integers"),
        (dict(JOB, output={"every": 3}), "unknown key output.every"),
        (dict(JOB, resume=True, restart_from="x.npz"), "resume continues OUTPUT/restart.npz and restart_from"),
        (dict(JOB, restart_from=str(tmp_path / "data.csv")), f"restart_from: '{tmp_path / 'data.csv'}' is not a whole "
                                                               "restart file"),
    ]
    for config, message in cases:
        config = dict(config, output=dict({"directory": str(tmp_path / "out")}, **config.get("output", {})))
        with pytest.raises(ConfigError, match=re.escape(message)):
            prepare(validate(config))
    prepare(validate(dict(JOB, output={"directory": str(tmp_path / "full"), "overwrite": True})))
    # the command itself: message on stderr, exit status 2
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(dict(JOB, temprature_K=300)))
    proc = subprocess.run([sys.executable, "-m", "md.cli", str(tmp_path / "bad.yaml")], capture_output=True,
                          text=True, cwd=ROOT, timeout=HANG_GUARD)
    assert proc.returncode == 2 and proc.stderr.startswith("mlip-md: error: unknown key temprature_K"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and not proc.stdout, proc.stderr


def test_no_model_given_runs_the_bundled_cu_emt():
    model = build_model(validate({})["model"])
    assert type(model).__name__ == "PaiNN" and model.species == ["Cu"]


def test_help_documents_every_key(capsys):
    from md.cli import main
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert schema_help() in out and "``" not in out  # plain text
    for key in ("lennard_jones", "checkpoint", "sevennet", "repeat", "temperature_K", "ensemble", "friction_per_fs",
                "timestep_fs", "steps", "seed", "skin", "mode", "thermo_every", "trajectory_every", "tdamp_fs",
                "pressure_GPa", "pdamp_fs", "isotropic", "balance_every", "trajectory_format", "overwrite"):
        assert key in out, key
