"""The bundled cu-emt (PaiNN, float64) through the LAMMPS bridge (run under mpiexec -n P):

* forces, energy and per-atom energies (``compute pe/atom``) at step 0 == ``potentials.predict`` on
  the same structure (rattled 108-atom fcc, cubic and triclinic boxes; layerwise and wide halo), and
  LAMMPS's pressure == the one of ``predict``'s stress;
* the pressure of one configuration with velocities == mlip-md's (``md.engine.MDSystem.thermo``; the two
  codes' unit constants differ by 8e-8 relative);
* NVE (velocity Verlet, 1 fs): the total energy drifts by less than 2e-4 eV/atom over 60 steps, and the
  trajectory equals mlip-md's ``VelocityVerlet`` from the same start (positions ≤ 1e-6 Å, total energy
  ≤ 1e-8 eV/atom: the unit constants again);
* ``minimize`` converges (max force component ≤ 1e-3 eV/Å before the iteration limit).

Prints one line per check and "lammps cu-emt: N failures".
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: comparison
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ase import Atoms, units  # noqa: E402

import potentials  # noqa: E402
from comparison import compare  # noqa: E402
from mlip_parallel.lammps import Bridge, lammps_class  # noqa: E402

torch.set_num_threads(1)
lammps = lammps_class()
from mpi4py import MPI  # noqa: E402

from md.engine import MDSystem, run  # noqa: E402
from md.integrators import VelocityVerlet  # noqa: E402

world = MPI.COMM_WORLD
MODEL = potentials.load("cu-emt").double()
BAR = 1e4 / units.GPa  # eV/Å^3 → bar (ASE's constants)
failures = []


def report(checks, text):
    """``checks``: {what: Comparison or bool}; OK when every one is."""
    bad = [(c.message(what) if hasattr(c, "message") else what) for what, c in checks.items()
           if not (c.ok if hasattr(c, "ok") else c)]
    ok = not bad
    if not ok:
        failures.append(text.split(":")[0])
        text += f" [{'; '.join(bad)}]"
    if world.rank == 0:
        print(f"{'OK ' if ok else 'FAIL'} {text}", flush=True)


def deck(region="block 0 3 0 3 0 3", rattle=0.08, temperature=0):
    return f"""
units metal
atom_style atomic
lattice fcc 3.61
region box {region}
create_box 1 box
create_atoms 1 box
mass 1 63.546
displace_atoms all random {rattle} {rattle} {rattle} 5517 units box
{f"velocity all create {temperature} 8812 loop geom" if temperature else ""}
timestep 0.001
fix ext all external pf/callback 1 1
compute peatom all pe/atom
thermo_style custom step pe ke etotal press vol fmax
"""


def start(text, mode="layerwise"):
    lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"], comm=world)
    lmp.commands_string(text)
    return lmp, Bridge(lmp, MODEL, "ext", mode=mode)


def snapshot(lmp):
    """(ase.Atoms with velocities in ASE units, forces [N, 3]) in atom-id order, from LAMMPS."""
    x = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3)).reshape(-1, 3).copy()
    v = np.ctypeslib.as_array(lmp.gather_atoms("v", 1, 3)).reshape(-1, 3).copy()
    f = np.ctypeslib.as_array(lmp.gather_atoms("f", 1, 3)).reshape(-1, 3).copy()
    boxlo, boxhi, xy, yz, xz, _, _ = lmp.extract_box()
    cell = np.diag(np.array(boxhi) - np.array(boxlo))
    cell[1, 0], cell[2, 0], cell[2, 1] = xy, xz, yz
    atoms = Atoms(numbers=np.full(len(x), 29), positions=x - np.array(boxlo), cell=cell, pbc=True)
    atoms.set_masses(np.full(len(x), 63.546))
    atoms.set_velocities(v / (1000 * units.fs))  # Å/ps → ASE velocity units
    return atoms, f


# --- step 0 == predict: cubic and triclinic boxes, layerwise and wide halo
for name, region, mode in (("cubic", "block 0 3 0 3 0 3", "layerwise"), ("triclinic", "prism 0 3 0 3 0 3 1 0 -1",
                                                                         "layerwise"),
                           ("cubic", "block 0 3 0 3 0 3", "wide")):
    lmp, bridge = start(deck(region), mode)
    lmp.command("run 0")
    atoms, forces = snapshot(lmp)
    ref = potentials.predict(MODEL, atoms)
    cf = compare(forces, ref["forces"], 1e-9, scale="absolute")
    peatom = np.ctypeslib.as_array(lmp.gather("c_peatom", 1, 1)).copy()
    ce = compare({"pe": lmp.get_thermo("pe"), "pe/atom": peatom}, {"pe": ref["energy"], "pe/atom": ref["energies"]},
                 1e-10, scale="absolute")
    pressure = -ref["stress"][:3].mean() * BAR
    cp = compare(lmp.get_thermo("press"), pressure, 1e-6, scale="each")
    report({"forces": cf, "energies": ce, "press": cp},
           f"step 0 {name} {mode}: {len(atoms)} atoms, |F - predict| {cf.error:.1e} eV/A, |E, E_i (pe/atom) - predict| "
           f"{ce.error:.1e} eV, "
           f"press {lmp.get_thermo('press'):.3f} vs {pressure:.3f} bar (rel {cp.error:.1e})")
    lmp.close()

# --- pressure with velocities == mlip-md; NVE: drift and trajectory == mlip-md's VelocityVerlet
lmp, bridge = start(deck(temperature=600) + "fix integrate all nve\n")
lmp.command("run 0")
atoms, _ = snapshot(lmp)
system = MDSystem.from_atoms(MODEL, atoms, skin=1.0)
system.compute_forces()
thermo = system.thermo(0, 1.0 * units.fs)
cp = compare(lmp.get_thermo("press"), thermo["pressure_GPa"] * 1e4, 1e-6, scale="each")
report({"press": cp}, f"pressure == mlip-md: {lmp.get_thermo('press'):.4f} vs {thermo['pressure_GPa'] * 1e4:.4f} bar "
                      f"(rel {cp.error:.1e}, 600 K)")
n = lmp.get_natoms()
etot = [lmp.get_thermo("etotal")]
for _ in range(3):
    lmp.command("run 20")
    etot.append(lmp.get_thermo("etotal"))
final, _ = snapshot(lmp)
lmp.close()
rows = run(system, VelocityVerlet(1.0), 60, thermo_every=20)
positions = system.gather("positions")
frac = (final.positions - positions) @ np.linalg.inv(final.cell[:])
dx = (frac - np.round(frac)) @ final.cell[:]  # minimum image
cx = compare(dx, np.zeros_like(dx), 1e-6, scale="absolute")
ce = compare(etot, [r["etot_eV"] for r in rows], 1e-8 * n, scale="absolute")  # per atom: / n
cd = compare(etot, [etot[0]] * len(etot), 2e-4 * n, scale="absolute")
report({"drift": cd, "positions": cx, "etot": ce},
       f"nve: {n} atoms, 60 steps of 1 fs, |etot - etot0| <= {cd.error / n:.1e} eV/atom; vs mlip-md: positions "
       f"{cx.error:.1e} A, etot {ce.error / n:.1e} eV/atom; {bridge.decomposition.rebuilds} halo rebuilds")

# --- minimize converges
lmp, bridge = start(deck(rattle=0.15) + "min_modify norm max\n")
lmp.command("minimize 0 1e-3 300 3000")
steps, fmax = int(lmp.get_thermo("step")), lmp.get_thermo("fmax")
report({"fmax <= 1e-3": fmax <= 1e-3, "< 300 iterations": steps < 300},
       f"minimize: max force {fmax:.1e} eV/A after {steps} iterations, "
       f"{bridge.calls} force calls, pe {lmp.get_thermo('pe'):.4f} eV")
lmp.close()
if world.rank == 0:
    print(f"lammps cu-emt P={world.size}: {len(failures)} failures {failures}", flush=True)
