"""The born_coulomb family with Ewald == LAMMPS's own ``born/coul/long`` + ``kspace_style ewald`` (mpiexec -n P).

A NaCl box of 216 ions with NaCl's Fumi–Tosi parameters, rattled and given velocities of 1200 K, runs one deck twice
in this process: with LAMMPS's pair and kspace styles (accuracy 1e-8, the Ewald splitting α set to ours with
``kspace_modify gewald``, exact erfc: ``pair_modify table 0``) and with ``fix external`` driven by our model through
``mlip_parallel.lammps.Bridge``. Step 0: forces ≤ 1e-6 relative (the norm of the difference over the norm), pe and
pressure ≤ 1e-6 relative; then 100 NVE steps of 2 fs: positions ≤ 1e-5 Å and pe ≤ 1e-6 relative, and the bridged
run's total energy drifts ≤ 1e-4 eV/atom. With the pairs shifted to zero at the cutoff (``pair_modify shift yes``;
``shift: true``) pe at step 0 ≤ 1e-6 relative.

What is left between the two is LAMMPS's erfc, a polynomial approximation (Abramowitz–Stegun 7.1.26, |error| ≤
1.5e-7): it moves LAMMPS's pe by +3.0e-4 eV here (3.5e-7 relative; computed alone, the same sum with scipy's erfc),
of the +2.9e-4 eV by which the two differ; forces differ by 7.7e-7 relative.

On several ranks the bridged run is repeated with the sums over ranks (structure factors, total charge) left as each
rank's own part: its forces must then differ by over 1e-3. Prints one line per check and "lammps born P=<ranks>: N
failures".
"""
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ase.build import bulk  # noqa: E402

import potentials  # noqa: E402
from mlip_parallel.lammps import Bridge, lammps_class  # noqa: E402

torch.set_num_threads(1)
lammps = lammps_class()
from mpi4py import MPI  # noqa: E402

world = MPI.COMM_WORLD

FUMI_TOSI = {"Na-Na": [0.2637, 0.317, 2.340, 1.0486, -0.4993], "Na-Cl": [0.2110, 0.317, 2.755, 6.99055, -8.6758],
             "Cl-Cl": [0.1582, 0.317, 3.170, 72.40215, -145.4284]}  # A eV, rho Å, sigma Å, C eV·Å⁶, D eV·Å⁸
CUTOFF, ACCURACY = 9.0, 1e-8
MODEL = potentials.load_model(("born_coulomb", {"charges": {"Na": 1.0, "Cl": -1.0}, "pairs": FUMI_TOSI,
                                                "cutoff": CUTOFF}),
                              long_range={"method": "ewald", "accuracy": ACCURACY})
SHIFTED = potentials.load_model(("born_coulomb", {"charges": {"Na": 1.0, "Cl": -1.0}, "pairs": FUMI_TOSI,
                                                  "cutoff": CUTOFF, "shift": True}),
                                long_range={"method": "ewald", "accuracy": ACCURACY})
ATOMS = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(3)
ATOMS.positions += np.random.default_rng(7).normal(0.0, 0.15, ATOMS.positions.shape)
SMEARING, _ = MODEL.long_range.split(CUTOFF, torch.tensor(ATOMS.cell[:]), len(ATOMS), float(len(ATOMS)))
ALPHA = float(1.0 / (np.sqrt(2.0) * SMEARING))  # LAMMPS's g_ewald: erfc(α r)/r is torch-pme's erfc(r/(√2 σ))/r

DATA = os.path.join(world.bcast(tempfile.mkdtemp() if world.rank == 0 else None), "born.data")
if world.rank == 0:
    lines = ["NaCl", "", f"{len(ATOMS)} atoms", "2 atom types", "",
             f"0 {float(ATOMS.cell[0, 0])!r} xlo xhi", f"0 {float(ATOMS.cell[1, 1])!r} ylo yhi",
             f"0 {float(ATOMS.cell[2, 2])!r} zlo zhi",
             "", "Masses", "", "1 22.98976928", "2 35.45", "", "Atoms # charge", ""]
    lines += [f"{k + 1} {1 if z == 11 else 2} {1.0 if z == 11 else -1.0} {float(x)!r} {float(y)!r} {float(w)!r}"
              for k, (z, (x, y, w)) in enumerate(zip(ATOMS.numbers, ATOMS.positions))]
    with open(DATA, "w") as f:
        f.write("\n".join(lines) + "\n")
world.Barrier()

DECK = f"""
units metal
atom_style charge
boundary p p p
read_data {DATA}
velocity all create 1200 87287 loop geom
timestep 0.002
neighbor 1.0 bin
fix integrate all nve
"""
pair = {(1, 1): "Na-Na", (1, 2): "Na-Cl", (2, 2): "Cl-Cl"}
NATIVE = (f"pair_style born/coul/long {CUTOFF}\npair_modify table 0\n"
          + "".join(f"pair_coeff {a} {b} {' '.join(repr(v) for v in FUMI_TOSI[name])}\n"
                    for (a, b), name in pair.items())
          + f"kspace_style ewald {ACCURACY}\nkspace_modify gewald {ALPHA!r}\n")
BRIDGED = "fix ext all external pf/callback 1 1\nfix_modify ext energy yes virial yes\n"


def simulate(bridged: bool, fault: bool = False, shift: bool = False, runs=("run 0", "run 100")):
    """Thermo, positions and forces by atom id after each of ``runs``; ``fault``: the model's sums over ranks (the
    structure factors and the total charge) left as each rank's own part; ``shift``: the pairs shifted to zero at
    the cutoff (LAMMPS's ``pair_modify shift yes``, the model's ``shift: true``)."""
    import mlip_parallel.comm as comm

    summed = comm.RankSum.__call__
    if fault:
        comm.RankSum.__call__ = lambda self, x: x
    try:
        return _simulate(bridged, SHIFTED if shift else MODEL, NATIVE + ("pair_modify shift yes\n" if shift else ""),
                         runs)
    finally:
        comm.RankSum.__call__ = summed


def _simulate(bridged: bool, model, native: str, runs):
    lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"], comm=world)
    lmp.commands_string(DECK + (BRIDGED if bridged else native))
    bridge = Bridge(lmp, model, "ext", elements=["Na", "Cl"]) if bridged else None
    lmp.command("thermo_style custom step pe etotal press")
    rows = []
    for command in runs:
        lmp.command(command)
        ids = np.ctypeslib.as_array(lmp.gather_atoms("id", 0, 1)).copy()
        x = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3)).reshape(-1, 3).copy()
        f = np.ctypeslib.as_array(lmp.gather_atoms("f", 1, 3)).reshape(-1, 3).copy()
        order = np.argsort(ids)
        rows.append(dict(pe=lmp.get_thermo("pe"), etotal=lmp.get_thermo("etotal"), press=lmp.get_thermo("press"),
                         x=x[order], f=f[order]))
    del bridge
    lmp.close()
    return rows


def relative(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(b), 1e-300))


native, bridged = simulate(False), simulate(True)
L = ATOMS.cell[0, 0]
dx = bridged[1]["x"] - native[1]["x"]
dx -= L * np.round(dx / L)
checks = [("step 0 forces", relative(bridged[0]["f"], native[0]["f"]), 1e-6),
          ("step 0 pe", relative(bridged[0]["pe"], native[0]["pe"]), 1e-6),
          ("step 0 press", relative(bridged[0]["press"], native[0]["press"]), 1e-6),
          ("step 100 |dx| (A)", float(np.abs(dx).max()), 1e-5),
          ("step 100 pe", relative(bridged[1]["pe"], native[1]["pe"]), 1e-6),
          ("NVE drift (eV/atom)", abs(bridged[1]["etotal"] - bridged[0]["etotal"]) / len(ATOMS), 1e-4)]
native_shifted, bridged_shifted = (simulate(bridged, shift=True, runs=("run 0",)) for bridged in (False, True))
checks.append(("shifted pairs: step 0 pe", relative(bridged_shifted[0]["pe"], native_shifted[0]["pe"]), 1e-6))
checks.append(("shifted pairs: 1e-3 eV / the shift's change of pe",
               1e-3 / abs(native_shifted[0]["pe"] - native[0]["pe"]), 1.0))
if world.size > 1:  # the same comparison without the sums over ranks must fail by orders of magnitude
    faulty = simulate(True, fault=True)
    checks.append(("faulty sums: 1e-3 / step 0 forces' difference", 1e-3 / max(relative(faulty[0]["f"],
                                                                                        native[0]["f"]), 1e-300), 1.0))
failures = [name for name, error, bound in checks if not error <= bound]  # a NaN fails
if world.rank == 0:
    for name, error, bound in checks:
        print(f"{'OK ' if error <= bound else 'FAIL'} {name}: {error:.3e} (bound {bound:g})", flush=True)
    print(f"alpha {ALPHA:.6f} 1/A; pe {native[0]['pe']:.6f} eV, press {native[0]['press']:.3f} bar", flush=True)
    print(f"lammps born P={world.size}: {len(failures)} failures {failures}", flush=True)
    shutil.rmtree(os.path.dirname(DATA))
