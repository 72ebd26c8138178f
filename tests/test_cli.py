"""mlip-md: a YAML job under mpiexec writes its thermo table, trajectory and final structure; bad
configurations name the key."""
import csv
import re
import subprocess
import sys

import pytest
import yaml
from ase.io import read

from conftest import ROOT
from md.cli import ConfigError, build_atoms, build_integrator, build_model, schema_help, validate

JOB = {
    "model": {"lennard_jones": {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 8.0}},
    "structure": {"element": "Ar", "crystal": "fcc", "a": 5.26, "repeat": [3, 3, 3]},
    "temperature_K": 100, "ensemble": "npt", "thermostat": {"temperature_K": 100, "tdamp_fs": 100.0},
    "barostat": {"pressure_GPa": 0.5, "pdamp_fs": 200.0, "isotropic": False}, "balance_every": 10,
    "timestep_fs": 4.0, "steps": 40, "seed": 3,
}


def test_mlip_md_job_under_mpiexec(mpirun, tmp_path):
    """NPT with load balancing on 2 ranks; an ASE .traj trajectory; then 20 + 20 steps through a restart
    file in one process equal the 2-rank 40-step run."""
    config = dict(JOB, output={"directory": str(tmp_path / "out"), "thermo_every": 10, "trajectory_every": 20,
                               "trajectory_format": "traj"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    rc, out, _ = mpirun(2, "-m", "md.cli", tmp_path / "job.yaml")
    assert rc == 0, out
    assert "108 atoms on 2 rank(s)" in out and "done in" in out, out
    with open(tmp_path / "out" / "thermo.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 10, 20, 30, 40]
    for column in ("time_fs", "temperature_K", "epot_eV", "ekin_eV", "etot_eV", "pressure_GPa", "volume_A3",
                   "seconds_per_step"):
        assert column in rows[0]
    frames = read(tmp_path / "out" / "trajectory.traj", index=":")
    assert len(frames) == 3 and len(frames[0]) == 108  # steps 0, 20, 40
    final = read(tmp_path / "out" / "final.extxyz")
    assert abs(final.get_temperature() - float(rows[-1]["temperature_K"])) < 1e-6
    assert abs(final.get_volume() - float(rows[-1]["volume_A3"])) < 1e-6
    assert abs(frames[-1].get_volume() / frames[0].get_volume() - 1) > 1e-3  # the barostat moved the cell

    # 20 steps, then 20 more from the restart file == the 40-step run (here in one process: the
    # trajectory does not depend on the number of ranks; restarts under MPI: tests/mpi/md_engine.py)
    from md.cli import main
    half = dict(config, steps=20, output=dict(config["output"], directory=str(tmp_path / "half")))
    (tmp_path / "half.yaml").write_text(yaml.safe_dump(half))
    rest = dict(half, restart_from=str(tmp_path / "half" / "restart.npz"))
    (tmp_path / "rest.yaml").write_text(yaml.safe_dump(rest))
    assert main([str(tmp_path / "half.yaml")]) == 0 and main([str(tmp_path / "rest.yaml")]) == 0
    with open(tmp_path / "half" / "thermo.csv") as f:
        resumed = list(csv.DictReader(f))
    assert [int(r["step"]) for r in resumed] == [0, 10, 20, 30, 40]
    assert len(read(tmp_path / "half" / "trajectory.traj", index=":")) == 3  # steps 0, 20, 40: none twice
    for a, b in zip(rows, resumed):
        for column in ("etot_eV", "volume_A3", "pressure_GPa"):
            assert abs(float(a[column]) - float(b[column])) < 1e-9 * abs(float(a[column])), column


def test_bad_config_names_the_key(tmp_path):
    cases = [
        (dict(JOB, temprature_K=300), "unknown key temprature_K"),
        (dict(JOB, steps="many"), "steps must be int"),
        (dict(JOB, ensemble="npt-magic"), "ensemble must be one of"),
        (dict(JOB, barostat={"isotropic": "yes"}), "barostat.isotropic must be bool"),
        (dict(JOB, thermostat={"tdamp_fs": 0.0}), "thermostat.tdamp_fs must be > 0"),
        (dict(JOB, output={"trajectory_format": "pdb"}), "output.trajectory_format must be one of"),
        (dict(JOB, timestep_fs=-1.0), "timestep_fs must be >= 0"),
        (dict(JOB, model={"sevennet": "7net-0", "checkpoint": "x.pt"}), "model takes one of"),
        (dict(JOB, model={"checkpoint": str(tmp_path / "none.pt")}), "model.checkpoint: "),
        (dict(JOB, structure={"file": str(tmp_path / "missing.xyz")}), "structure.file: cannot read"),
        (dict(JOB, structure={"repeat": [2, 2]}), "structure.repeat must be three positive integers"),
        (dict(JOB, output={"every": 3}), "unknown key output.every"),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            config = validate(config)
            build_model(config["model"])
            build_integrator(config)
            build_atoms(config)
    # the command itself: message on stderr, exit status 2
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(dict(JOB, temprature_K=300)))
    proc = subprocess.run([sys.executable, "-m", "md.cli", str(tmp_path / "bad.yaml")], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "mlip-md: error: unknown key temprature_K" in proc.stderr, proc.stderr[-500:]


def test_no_model_given_runs_the_bundled_cu_emt():
    model = build_model(validate({})["model"])
    assert type(model).__name__ == "PaiNN" and model.species == ["Cu"]


def test_help_documents_every_key(capsys):
    from md.cli import main
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert schema_help() in out
    for key in ("lennard_jones", "checkpoint", "sevennet", "repeat", "temperature_K", "ensemble", "friction_per_fs",
                "timestep_fs", "steps", "seed", "skin", "mode", "thermo_every", "trajectory_every", "tdamp_fs",
                "pressure_GPa", "pdamp_fs", "isotropic", "balance_every", "trajectory_format"):
        assert key in out, key
