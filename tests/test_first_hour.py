"""First-hour experience: a file that is not a checkpoint names itself, a config error prints once per
MPI job, output directories are not overwritten by accident, the mlip-md summary's statistics, and a
plain install gets every module."""
import re
import sys
import zipfile

import numpy as np
import pytest

import potentials
from mlip_parallel.config import ConfigError, check_output_directory, launch_rank, report_error


def test_files_that_are_not_checkpoints_name_themselves(tmp_path):
    (tmp_path / "hello.txt").write_text("hello world\n")
    (tmp_path / "data.csv").write_text("energy,forces\n1.0,2.0\n")
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "random.pt").write_bytes(np.random.default_rng(0).bytes(4096))
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive:  # a zip that torch did not write
        archive.writestr("notes.txt", "not a checkpoint")
    for name, reason in (("hello.txt", "not a zip archive"), ("data.csv", "not a zip archive"),
                         ("empty.pt", "an empty file"), ("random.pt", "not a zip archive"),
                         ("other.zip", "truncated or corrupt checkpoint")):
        path = tmp_path / name
        with pytest.raises(potentials.CheckpointError, match=f"^{path}: .*{reason}"):
            potentials.load(path)


def test_config_errors_print_on_rank_zero_only(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)  # MPI not initialised: the environment decides
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert launch_rank() == 0
    report_error("mlip-md", ConfigError("steps must be int"))
    assert capsys.readouterr().err == "mlip-md: error: steps must be int\n"
    monkeypatch.setenv("PMI_RANK", "1")
    assert launch_rank() == 1
    report_error("mlip-md", ConfigError("steps must be int"))
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("PMI_RANK")
    monkeypatch.setenv("RANK", "3")  # torchrun sets RANK with WORLD_SIZE; RANK alone is not a launcher's
    assert launch_rank() == 0
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch_rank() == 3


def test_output_directory_is_not_overwritten(tmp_path):
    check_output_directory(tmp_path / "new", overwrite=False)  # absent: fine
    (tmp_path / "empty").mkdir()
    check_output_directory(tmp_path / "empty", overwrite=False)
    (tmp_path / "run").mkdir()
    for name in ("a", "b", "c", "d", "e"):
        (tmp_path / "run" / name).write_text("")
    with pytest.raises(ConfigError, match=r"output.directory: .* is not empty \(a, b, c, d, ...\); set output."
                                          r"overwrite: true"):
        check_output_directory(tmp_path / "run", overwrite=False)
    check_output_directory(tmp_path / "run", overwrite=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        check_output_directory(tmp_path / "file", overwrite=True)


def test_summary_statistics():
    from md.report import block_average, summary

    rng = np.random.default_rng(1)
    values = 5.0 + rng.normal(size=10_000)
    mean, error = block_average(values)
    assert mean == values.mean() and 0.5 / np.sqrt(10_000) < error < 2 / np.sqrt(10_000)
    assert np.isnan(block_average([1.0])[1])
    # NVE: 11 samples over 1 ps (1e-3 ns) whose total energy per atom rises by 2e-6 eV: drift 2e-3 eV/atom/ns
    samples = [{"step": s, "time_fs": 100.0 * s, "temperature_K": 300.0, "pressure_GPa": 0.1, "epot_eV": -10.0,
                "etot_eV": -5.0 + 2e-7 * s * 10, "volume_A3": 1000.0} for s in range(11)]
    text = summary(samples, n_atoms=10, ensemble="nve")
    assert "steps 5 to 10 (second half, 6 samples)" in text and "volume_A3" not in text
    assert re.search(r"energy drift +0\.002 eV/atom/ns", text), text
    assert re.search(r"epot_eV/atom +-1 ± 0\b", text), text
    assert "volume_A3" in summary(samples, n_atoms=10, ensemble="npt")


def test_wheel_holds_every_module_and_data_file(tmp_path):
    """A plain (not editable) install gets every package: the wheel built from a copy of this tree (no
    stale build/ folder) holds each .py file under mlip_parallel/, potentials/ and md/, and the shipped
    model data."""
    import shutil
    import subprocess
    from pathlib import Path

    root, source, tops = Path(__file__).resolve().parents[1], tmp_path / "source", ("mlip_parallel", "potentials", "md")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for top in tops:
        shutil.copytree(root / top, source / top, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(tmp_path), str(source)], capture_output=True, text=True, cwd=tmp_path)
    assert built.returncode == 0, f"pip wheel failed:\n{built.stderr[-3000:]}"
    (wheel,) = tmp_path.glob("mlip_parallel-*.whl")
    packed = set(zipfile.ZipFile(wheel).namelist())
    wanted = {p.relative_to(source).as_posix() for top in tops for p in (source / top).rglob("*")
              if p.suffix in (".py", ".pt")}
    assert wanted and not wanted - packed, f"missing from the wheel: {sorted(wanted - packed)}"
