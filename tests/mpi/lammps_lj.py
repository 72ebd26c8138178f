"""LAMMPS bridge == LAMMPS's own ``lj/cut`` + ``pair_modify shift yes`` (run under mpiexec -n P).

Each case runs one deck twice in this process, once with the native pair style and once with
``fix external`` driven by ``potentials.LennardJones`` (argon, cutoff 8.5 Å) through
``mlip_parallel.lammps.Bridge``, in 4 × ``run 50`` (200 steps of 4 fs); after every run the thermo pe
and press and the positions (by atom id, minimum image) must agree: positions ≤ 1e-10 Å, pe and press
≤ 1e-9 relative. Cases (``--cases`` picks some): ``cubic`` NVE; ``triclinic`` NVE; ``balance``, a slab
decomposed along z only (``processors 1 1 *``) whose cut planes ``fix balance`` moves every 20 steps;
``vacuum``, a slab in a box that is not periodic along z (shrink-wrapped, at least its initial
size: ``boundary p p m``), split along z without balance, so that some ranks own no atoms; ``npt``
(energy and virial reach the barostat); ``minimize``; ``relax``, 200 iterations of ``minimize`` with
``fix box/relax aniso`` (the virial drives the cell). Prints one line per case and
"lammps lj P=<ranks>: N failures".
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: comparison
import numpy as np  # noqa: E402
import torch  # noqa: E402

import potentials  # noqa: E402
from comparison import compare  # noqa: E402
from mlip_parallel.lammps import Bridge, lammps_class  # noqa: E402

torch.set_num_threads(1)
lammps = lammps_class()
from mpi4py import MPI  # noqa: E402

world = MPI.COMM_WORLD
EPS, SIGMA, CUT = 0.0104, 3.4, 8.5
MODEL = potentials.LennardJones(EPS, SIGMA, CUT)

BULK = """
units metal
atom_style atomic
boundary p p p
lattice fcc 5.26
region box block 0 3 0 3 0 3
create_box 1 box
create_atoms 1 box
mass 1 39.948
displace_atoms all random 0.3 0.3 0.3 8731 units box
velocity all create 150 4928459 loop geom
timestep 0.004
neighbor 1.0 bin
fix integrate all nve
"""
TRICLINIC = BULK.replace("region box block 0 3 0 3 0 3", "region box prism 0 3 0 3 0 3 1 -1 1")
SLAB = BULK.replace("boundary p p p", "boundary p p p\nprocessors 1 1 *").replace(
    "region box block 0 3 0 3 0 3\ncreate_box 1 box\ncreate_atoms 1 box",
    "region box block 0 3 0 3 0 6\ncreate_box 1 box\nregion slab block INF INF INF INF 0 2.5\n"
    "create_atoms 1 region slab") + "fix bal all balance 20 1.0 shift z 10 1.0\n"
VACUUM = BULK.replace("boundary p p p", "boundary p p m\nprocessors 1 1 *").replace(
    "region box block 0 3 0 3 0 3\ncreate_box 1 box\ncreate_atoms 1 box",
    "region box block 0 3 0 3 0 8\ncreate_box 1 box\nregion slab block INF INF INF INF 2 4.5\n"
    "create_atoms 1 region slab")
NPT = BULK.replace("fix integrate all nve", "fix integrate all npt temp 150 150 0.4 iso 500 500 2.0")
MINIMIZE = BULK.replace("velocity all create 150 4928459 loop geom", "")

NATIVE = f"pair_style lj/cut {CUT}\npair_coeff * * {EPS} {SIGMA}\npair_modify shift yes\n"
BRIDGED = "fix ext all external pf/callback 1 1\n"


def simulate(deck, bridged, runs=("run 50",) * 4):
    lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"], comm=world)
    lmp.commands_string(deck + (BRIDGED if bridged else NATIVE))
    bridge = Bridge(lmp, MODEL, "ext") if bridged else None
    lmp.command("thermo_style custom step pe press vol")
    rows = []
    for command in runs:
        lmp.command(command)
        x = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3)).reshape(-1, 3).copy()
        boxlo, boxhi, xy, yz, xz, _, _ = lmp.extract_box()
        cell = np.diag(np.array(boxhi) - np.array(boxlo))
        cell[1, 0], cell[2, 0], cell[2, 1] = xy, xz, yz
        rows.append((lmp.get_thermo("step"), lmp.get_thermo("pe"), lmp.get_thermo("press"), x, cell))
    info = (bridge.decomposition.rebuilds, bridge.decomposition.grid) if bridge else None
    lmp.close()
    return rows, info


failures = []
CASES = {"cubic": (BULK, ("run 50",) * 4), "triclinic": (TRICLINIC, ("run 50",) * 4),
         "balance": (SLAB, ("run 50",) * 4), "vacuum": (VACUUM, ("run 50",) * 4), "npt": (NPT, ("run 50",) * 4),
         "minimize": (MINIMIZE, ("minimize 0 1e-6 1000 10000",)),
         "relax": (MINIMIZE + "fix relax all box/relax aniso 0.0\n", ("minimize 0 0 200 2000",))}
ARGS = dict(zip(sys.argv[1::2], sys.argv[2::2]))  # --cases cubic,triclinic,...
for name in ARGS.get("--cases", ",".join(CASES)).split(","):
    deck, runs = CASES[name]
    native, _ = simulate(deck, False, runs)
    bridged, (rebuilds, grid) = simulate(deck, True, runs)
    worst, problems = np.zeros(3), []
    if len(native) != len(bridged) or not native:
        problems.append(f"{name}: {len(bridged)} bridged runs vs {len(native)} native")
        worst[:] = np.nan
    pairs = zip(native, bridged, strict=True) if not problems else ()
    for k, ((s0, pe0, p0, x0, c0), (s1, pe1, p1, x1, c1)) in enumerate(pairs):
        frac = (x1 - x0) @ np.linalg.inv(c0)
        dx = (frac - np.round(frac)) @ c0  # minimum image
        press_scale = float(np.maximum(np.abs(p0), 1.0))  # |Δ press| relative to |press|, at least 1 bar
        checks = [compare(dx, np.zeros_like(dx), 1e-10, scale="absolute"), compare(pe1, pe0, 1e-9, scale="each"),
                  compare(p1, p0, 1e-9 * press_scale, scale="absolute")]
        worst = np.max([worst, [checks[0].error, checks[1].error, checks[2].error / press_scale]], axis=0)  # NaN stays
        problems += [c.message(f"{name} run {k} {what}")
                     for what, c in zip(("|dx|", "pe", "press"), checks, strict=True) if not c.ok]
        if s0 != s1:
            problems.append(f"{name}: steps {s0} vs {s1}")
    ok = not problems
    if not ok:
        failures.append(name)
        failures += problems
    if world.rank == 0:
        print(f"{'OK ' if ok else 'FAIL'} {name}: {len(native)} runs to step {native[-1][0]}, "
              f"max |dx| {worst[0]:.2e} A, pe rel {worst[1]:.2e}, press rel {worst[2]:.2e}; "
              f"pe {native[-1][1]:.6f} eV press {native[-1][2]:.3f} bar; {rebuilds} halo rebuilds; "
              f"grid {grid.dims}, z planes {np.round(grid.planes[2], 3).tolist()}", flush=True)
if world.rank == 0:
    print(f"lammps lj P={world.size}: {len(failures)} failures {failures}", flush=True)
