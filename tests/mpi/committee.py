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
* the faults the comparison catches: one member's halo refresh skipped, and σ taken from the forces before the
  ghost gradients come home (each moves σ_F by far more than the tolerance).

Prints one line per check and "committee: N failures, M checks".
"""
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


def worst(result, expected, keys):
    """Max |Δ| over ``keys``, each relative to the largest value of the reference (σ keys: absolute, eV/Å)."""
    errors = {}
    for key in keys:
        diff = np.max(np.abs(np.asarray(result[key]) - np.asarray(expected[key])), initial=0.0)
        scale = 1.0 if key.startswith(("devi", "max_devi", "min_devi", "avg_devi")) else \
            max(np.max(np.abs(expected[key])), 1e-300)
        errors[key] = float(diff / scale)
    return errors


def on_ranks(p):
    """A communicator of the first ``p`` ranks (None on the others)."""
    sub = world.Split(0 if world.rank < p else MPI.UNDEFINED, world.rank)
    return None if sub == MPI.COMM_NULL else sub


def compare(label, committee, atoms, expected, comm, mode, tolerance=TOLERANCE):
    result = mlip_parallel.evaluate(committee, atoms, mode=mode, comm=comm)
    keys = [k for k in expected if k != "member_energies"] + ["member_energies"]
    errors = worst(result, expected, keys)
    bad = {k: v for k, v in errors.items() if not v <= tolerance}
    return result, errors, bad


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
                _, errors, bad = compare(name, committee, atoms, expected[name], comm, mode)
                if comm.rank == 0:
                    print(f"{'OK ' if not bad else 'FAIL'} 4 members, {p} rank(s), {name}, {mode}: worst "
                          f"{max(errors, key=errors.get)} {max(errors.values()):.1e} (σ_F max "
                          f"{expected[name]['max_devi_f']:.3f} eV/A)", flush=True)
                if bad:
                    failures.append(f"{p} ranks {name} {mode}: {bad}")
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
_, errors, bad = compare("first", first, atoms, reference(members, atoms, "first"), world, "layerwise")
report(not bad, f"forces=first on {world.size} ranks: the first member's energy, forces, stress; σ of all "
                f"({max(errors.values()):.1e})")
result = mlip_parallel.evaluate(members[:1], atoms, comm=world)
alone = potentials.predict(members[0], atoms)
report(float(np.max(result["devi_f"])) == 0.0 and abs(result["energy"] - alone["energy"]) <= 1e-12 * abs(alone["energy"]),
       "a committee of one: σ_F = 0, its member's energy")

# 3. the faults the comparison catches
class SkippedHalo(Committee):
    """Member 1 (three layers) reads stale ghost features: its ghost rows are refreshed once only."""

    def member_graph(self, k, graph):
        graph = super().member_graph(k, graph)
        if k == 0:
            import dataclasses

            graph = dataclasses.replace(graph, halo=StaleHalo(graph.halo, graph.n_local))
        return graph


class StaleHalo:
    """A halo that refreshes the ghost rows once, then hands back those rows (stale) at every later layer."""

    def __init__(self, halo, n_local):
        self.halo, self.n_local, self.ghosts = halo, n_local, None

    def __call__(self, h):
        if self.ghosts is None:
            self.ghosts = self.halo(h)[self.n_local:]
        return torch.cat([h[:self.n_local], self.ghosts])

    def __getattr__(self, name):
        return getattr(self.halo, name)


_, errors, bad = compare("skipped halo", SkippedHalo(members), atoms, expected["slab"], world, "layerwise")
report(errors["devi_f"] > 1e3 * TOLERANCE, f"fault: one member's halo refresh skipped moves σ_F by "
                                           f"{errors['devi_f']:.1e} eV/A (caught: > {1e3 * TOLERANCE:.0e})")
from mlip_parallel.comm import _ForwardComm  # noqa: E402

backward = _ForwardComm.backward  # the ghost positions' gradients dropped on their way home
_ForwardComm.backward = staticmethod(lambda ctx, grad: (grad.new_zeros(ctx.comm.n_local, *grad.shape[1:]), None))
try:
    _, errors, bad = compare("ghost gradients dropped", committee, atoms, expected["slab"], world, "layerwise")
finally:
    _ForwardComm.backward = backward
report(errors["devi_f"] > 1e3 * TOLERANCE or world.size == 1,
       f"fault: the ghosts' gradients dropped on their way home move σ_F by {errors['devi_f']:.1e} eV/A")

# 4. two package families and ours, on 1-4 ranks
packages = []
try:
    packages.append(("MACE", potentials.load_model(f"mace:{MACE_DIR / 'mace-zbl-f64.model'}")))
except ImportError as exc:
    report(False, f"MACE not installed: {exc}")
if sys.argv[1:2] != ["-"] and len(sys.argv) > 1:
    packages.append(("SevenNet", potentials.load_model(f"sevennet:{os.path.join(sys.argv[1], 'sevennet.pth')}",
                                                       "float64")))
packages.append(("SchNet", members[0]))
mixed = Committee([m for _, m in packages])
names = "+".join(n for n, _ in packages)
for name in ("hcp_triclinic", "clusters"):
    atoms = structures[name]
    want = reference(mixed.members, atoms)
    for p in range(1, world.size + 1):
        comm = on_ranks(p)
        if comm is not None:
            _, errors, bad = compare(name, mixed, atoms, want, comm, "layerwise", tolerance=TOLERANCE)
            if comm.rank == 0:
                print(f"{'OK ' if not bad else 'FAIL'} {names} on {p} rank(s), {name}: worst "
                      f"{max(errors, key=errors.get)} {max(errors.values()):.1e} (σ_F max {want['max_devi_f']:.3f})",
                      flush=True)
            if bad:
                failures.append(f"{names} {p} ranks {name}: {bad}")
        world.Barrier()
report(len(packages) == 3, f"committee of {names} ({len(packages)} families) ran on 1-{world.size} ranks")

# 5. the LAMMPS bridge with a committee
from mlip_parallel.lammps import Bridge, lammps_class  # noqa: E402

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
from ase import Atoms  # noqa: E402

atoms = Atoms(numbers=np.where(types == 1, 29, 47), positions=x - np.array(boxlo),
              cell=np.diag(np.array(boxhi) - np.array(boxlo)), pbc=True)
want = reference(members, atoms)
errors = {"devi_f": np.max(np.abs(devi_f - want["devi_f"])), "devi_energies": np.max(np.abs(devi_e - want["devi_energies"])),
          "vector": np.max(np.abs(np.array(vector) - [want[k] for k in ("max_devi_f", "min_devi_f", "avg_devi_f", "devi_e")])),
          "energy": abs(bridge.energy - want["energy"]) / abs(want["energy"])}
report(max(errors.values()) <= TOLERANCE and len(atoms) == 108 and want["max_devi_f"] > 0.01,
       f"LAMMPS committee on {world.size} ranks, step 0: d_mlip_devi_f, d_mlip_devi_e, f_ext[1..4] and the energy == "
       f"the serial committee (worst {max(errors.values()):.1e}; σ_F max {want['max_devi_f']:.3f} eV/A)")
lmp.close()

checks[0] = world.allreduce(checks[0], op=MPI.MAX)
failures = world.allreduce(len(failures), op=MPI.MAX)
if world.rank == 0:
    print(f"committee: {failures} failures, {checks[0]} checks", flush=True)
sys.exit(1 if failures else 0)
