"""Shared fixtures: launching the scripts of tests/mpi/ under mpiexec."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

MPI_DIR = Path(__file__).parent / "mpi"
ROOT = Path(__file__).parent.parent


def mpiexec_path() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.fixture
def mpirun():
    """mpirun(n, script_or_module_args..., timeout=...) → (returncode, output, seconds).

    Runs ``mpiexec -n n python ARGS`` with one thread per rank; a run past ``timeout`` fails the test
    (it would be a hang)."""
    launcher = mpiexec_path()
    if launcher is None:
        pytest.fail("mpiexec not found: install the 'mpich' package (pip install -e .[test])")

    def run(n, *args, timeout=300):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        cmd = [launcher, "-n", str(n), sys.executable, *[str(a) for a in args]]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s (hang?)\n{exc.stdout}\n{exc.stderr}")
        output = proc.stdout + proc.stderr
        return proc.returncode, output, time.perf_counter() - start

    return run


def assert_job_aborted(rc, out, seconds, message, limit=30):
    """An mpiexec job ended by an error on one rank: non-zero status, ``message`` printed, no rank got past
    it ("not reached"), and promptly (within ``limit`` seconds, not a hang)."""
    assert rc != 0, out
    assert message in out, out
    assert "not reached" not in out
    assert seconds < limit, f"took {seconds:.1f} s"
