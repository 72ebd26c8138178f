"""A MACE model (tests/data/mace/mace-zbl-f64.model) driving molecular dynamics under mpiexec -n 2, in the
scratch directory given as the first argument; the pytest side (tests/test_mace.py) compares:

* ``mlip-md`` with ``model: {mace: FILE}``, NVE, 50 steps of 1 fs from start.traj (108 Cu/Ag atoms, 600 K):
  OUTPUT ``md2/`` (the one-process run of the same job writes ``md1/``);
* ``mlip-lammps`` on a MACE user's own deck (``pair_style mace no_domain_decomposition`` + ``pair_coeff * *
  FILE.model-lammps.pt Cu Ag``, no fix external, no --model) from the same start (start.data), velocity
  Verlet, 50 steps, masses scaled by the ratio of ASE's and LAMMPS's metal-unit constants so that both
  codes integrate the same equations: ``lammps.dump`` (full-precision positions at step 50);
* ``mlip-lammps --model mace:FILE`` on the same deck with ``fix ext all external pf/callback 1 1`` in place of
  the pair style: ``lammps_fix.dump``.
"""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from mpi4py import MPI  # noqa: E402

from md.cli import main as mlip_md  # noqa: E402
from mlip_parallel.lammps import main as mlip_lammps  # noqa: E402

world = MPI.COMM_WORLD
os.chdir(sys.argv[1])
# written by tests/test_mace.py: start.traj, start.data, job.yaml (output md2), deck.in, deck_fix.in
codes = [mlip_md(["job.yaml"]), mlip_lammps(["-in", "deck.in", "-screen", "none", "-log", "lammps.log"]),
         mlip_lammps(["-in", "deck_fix.in", "--model", f"mace:{sys.argv[2]}", "-screen", "none", "-log", "fix.log"])]
world.Barrier()
if world.rank == 0:
    print(f"mace md exit codes {codes}", flush=True)
sys.exit(max(codes))
