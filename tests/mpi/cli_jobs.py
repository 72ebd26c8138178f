"""mlip-md, mlip-lammps and mlip-train jobs in one mpiexec launch (each a call of the command's ``main`` in this
process), run in the scratch directory given as the first argument, as listed in its ``jobs.json`` (or the file named by the
second argument): a list of
[command, arg, ...] with command "mlip-md", "mlip-lammps" or "mlip-train". Prints "cli jobs exit codes [...]"; the
pytest side (tests/test_mace.py, tests/test_nequip.py, tests/test_families.py) writes the inputs and compares the
outputs."""
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
from mpi4py import MPI  # noqa: E402

from md.cli import main as mlip_md  # noqa: E402
from mlip_parallel.lammps import main as mlip_lammps  # noqa: E402
from mlip_parallel.train.cli import main as mlip_train  # noqa: E402

world = MPI.COMM_WORLD
os.chdir(sys.argv[1])
with open(sys.argv[2] if len(sys.argv) > 2 else "jobs.json") as f:
    jobs = json.load(f)
commands = {"mlip-md": mlip_md, "mlip-lammps": mlip_lammps, "mlip-train": mlip_train}
codes = [commands[job[0]](job[1:]) for job in jobs]
world.Barrier()
if world.rank == 0:
    print(f"cli jobs exit codes {codes}", flush=True)
sys.exit(sorted(codes)[-1])  # the largest exit code (none: an IndexError, exit 1)
