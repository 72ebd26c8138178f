"""An exception inside LAMMPS's fix external callback on rank 1 only (run under mpiexec -n 3): LAMMPS
would swallow it and the other ranks would wait in the next halo exchange forever; the bridge prints
``rank 1: RuntimeError: ...`` and aborts the whole job."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import potentials  # noqa: E402
from mlip_parallel.lammps import Bridge, lammps_class  # noqa: E402

lammps = lammps_class()
from mpi4py import MPI  # noqa: E402


class Failing(Bridge):
    def compute(self, step, *args):
        if step == 3 and MPI.COMM_WORLD.Get_rank() == 1:
            raise RuntimeError("deliberate failure in the callback on rank 1")
        super().compute(step, *args)


lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"], comm=MPI.COMM_WORLD)
lmp.commands_string("""units metal
lattice fcc 5.26
region box block 0 3 0 3 0 3
create_box 1 box
create_atoms 1 box
mass 1 39.948
velocity all create 100 1 loop geom
fix ext all external pf/callback 1 1
fix 1 all nve
""")
Failing(lmp, potentials.LennardJones(0.0104, 3.4, 8.5), "ext")
lmp.command("run 10")
print("not reached", flush=True)
