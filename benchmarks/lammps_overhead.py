"""The LAMMPS bridge's cost per MD step against mlip-md's engine: the bundled cu-emt (PaiNN, float64) on
~4,000 Cu atoms, NVE velocity Verlet, 2 fs, skin 1 Å, on 2 ranks (one thread each), target ≤ 10 %.

One mpiexec launch holds both: LAMMPS (``fix external`` driven by ``mlip_parallel.lammps.Bridge``) and
``md.engine.MDSystem`` start from the same atoms and velocities (read back from LAMMPS) and run the
same number of steps in alternating segments; the medians of the per-step times are compared.

    python benchmarks/lammps_overhead.py [--cells 10] [--steps 4] [--rounds 3]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch  # noqa: E402


def worker(args):
    import numpy as np
    import torch
    from ase import Atoms, units

    import potentials
    from md.engine import MDSystem, run
    from md.integrators import VelocityVerlet
    from mlip_parallel.lammps import Bridge, lammps_class

    torch.set_num_threads(1)
    lammps = lammps_class()
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    model = potentials.load("cu-emt").double()
    lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"], comm=world)
    lmp.commands_string(f"""
units metal
atom_style atomic
lattice fcc 3.61
region box block 0 {args.cells} 0 {args.cells} 0 {args.cells}
create_box 1 box
create_atoms 1 box
mass 1 63.546
displace_atoms all random 0.05 0.05 0.05 7 units box
velocity all create 600 4928459 loop geom
timestep 0.002
fix ext all external pf/callback 1 1
fix integrate all nve
thermo_style custom step pe etotal press
""")
    bridge = Bridge(lmp, model, "ext", skin=1.0)
    lmp.command("run 0")
    x = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3)).reshape(-1, 3).copy()
    v = np.ctypeslib.as_array(lmp.gather_atoms("v", 1, 3)).reshape(-1, 3).copy()
    boxlo, boxhi = np.array(lmp.extract_box()[0]), np.array(lmp.extract_box()[1])
    atoms = Atoms(numbers=np.full(len(x), 29), positions=x - boxlo, cell=np.diag(boxhi - boxlo), pbc=True)
    atoms.set_masses(np.full(len(x), 63.546))
    atoms.set_velocities(v / (1000 * units.fs))
    system = MDSystem.from_atoms(model, atoms, skin=1.0)
    integrator = VelocityVerlet(2.0)
    system.compute_forces()

    md_times, lammps_times, callback_share = [], [], []
    step = 0
    for _ in range(args.rounds):
        world.Barrier()
        t0 = time.perf_counter()
        run(system, integrator, args.steps, thermo_every=args.steps, start_step=step)
        md_times.append((time.perf_counter() - t0) / args.steps)
        step += args.steps
        world.Barrier()
        seconds = bridge.seconds
        t0 = time.perf_counter()
        lmp.command(f"run {args.steps} pre no post no")
        elapsed = time.perf_counter() - t0
        lammps_times.append(elapsed / args.steps)
        callback_share.append((bridge.seconds - seconds) / elapsed)
    etot = lmp.get_thermo("etotal")
    md_etot = system.thermo(step, integrator.dt)["etot_eV"]
    result = {"n_atoms": len(atoms), "md": md_times, "lammps": lammps_times, "callback_share": callback_share,
              "lammps_rebuilds": bridge.decomposition.rebuilds, "md_rebuilds": system.rebuilds,
              "etot_difference": abs(etot - md_etot) / len(atoms)}
    lmp.close()
    if world.rank == 0:
        print(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=10, help="cubic fcc cells per direction (10 → 4,000 atoms)")
    parser.add_argument("--steps", type=int, default=4, help="steps per segment")
    parser.add_argument("--rounds", type=int, default=3, help="alternating segments of each")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    r = launch(2, __file__, ["--cells", args.cells, "--steps", args.steps, "--rounds", args.rounds])
    md, bridged = statistics.median(r["md"]), statistics.median(r["lammps"])
    print(f"cu-emt (PaiNN, float64), {r['n_atoms']} Cu atoms, NVE 2 fs, skin 1 A, 2 ranks x 1 thread, "
          f"{args.rounds} x {args.steps} steps each, alternating")
    print(f"  mlip-md      {md:7.3f} s/step  (per segment: {', '.join(f'{t:.3f}' for t in r['md'])}; "
          f"{r['md_rebuilds']} halo builds)")
    print(f"  mlip-lammps  {bridged:7.3f} s/step  (per segment: {', '.join(f'{t:.3f}' for t in r['lammps'])}; "
          f"{r['lammps_rebuilds']} halo builds; {100 * statistics.median(r['callback_share']):.1f} % of it in the "
          f"fix external callback)")
    print(f"  same trajectory: |etot difference| {r['etot_difference']:.1e} eV/atom after the last segment")
    print(f"bridge overhead per step = {100 * (bridged / md - 1):+.1f} % (target <= 10 %)")


if __name__ == "__main__":
    main()
