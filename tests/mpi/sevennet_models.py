"""SevenNet-0 through mlip_parallel (evaluate and the ASE calculator) == sevenn's own calculator on one process, run
by tests/mpi/families.py: energy, forces, stress to 1e-5 relative (float32); its halo's faults planted on 2 and 3
ranks; in full on 2 ranks, ASE's NEB(parallel=True) with our calculator, an image per rank, == the band relaxed with
sevenn's calculator in one process. Grids, lean and backend scopes: every structure on the automatic grid, layerwise
(and the faults)."""
import numpy as np

import mlip_parallel
from comparison import compare
from faults import caught
from md import MLIPCalculator
from potentials.adapters.sevennet import SevenNet
from systems import SEVENNET_STRUCTURES, copper_vacancy_hop, sevennet_reference


def run(run) -> tuple:
    """``run``: families.AdapterRun. Returns its verdict."""
    world = run.world
    model = SevenNet("7net-0")
    # sevenn's references, each structure's computed by one rank (no rank repeats another's work)
    names = list(SEVENNET_STRUCTURES)
    mine = {n: sevennet_reference(SEVENNET_STRUCTURES[n]()) for k, n in enumerate(names)
            if k % world.size == world.rank}
    references = {n: r for part in world.allgather(mine) for n, r in part.items()}
    for name, build in SEVENNET_STRUCTURES.items():
        atoms = build()
        # wide mode needs a 5 x 5 A ghost shell: affordable for the cluster, not for small periodic cells
        for mode in ("layerwise", "wide") if name == "silicon_cluster" and run.full else ("layerwise",):
            run.case(f"SevenNet-0 {name}", model, atoms, references[name], 1e-5, None, mode, plain_tolerance=1e-5)
            if not run.full:
                continue
            calc_atoms = atoms.copy()
            calc_atoms.calc = MLIPCalculator(model, mode=mode)
            via = {"energy": calc_atoms.get_potential_energy(), "forces": calc_atoms.get_forces()}
            if "stress" in references[name]:
                via["stress"] = calc_atoms.get_stress()
            run.check(f"{name} {mode} MLIPCalculator", via, references[name], 1e-5)
    if world.rank == 0:
        print(f"SevenNet-0: max rel err vs SevenNetCalculator {run.worst['SevenNet-0']:.2e}", flush=True)
    if world.size in (2, 3):  # the halo's faults: each caught by the comparison above
        atoms, grid = SEVENNET_STRUCTURES["silicon_diamond"](), (world.size, 1, 1)
        run.failures += caught(world, f"silicon_diamond grid={grid}",
                               lambda: mlip_parallel.evaluate(model, atoms, grid=grid), references["silicon_diamond"],
                               1e-5)
    if run.full and world.size == 2:
        ours, theirs = neb_band(model, parallel=True), neb_band(model, parallel=False)
        c = compare(ours, theirs, 1e-5, scale="absolute")
        if world.rank == 0:
            print(f"SevenNet-0 NEB(parallel=True), an image per rank: highest image {ours['energies'].max():.6f} eV, "
                  f"SevenNetCalculator's band in one process {theirs['energies'].max():.6f} eV; max difference "
                  f"(positions, energies) {c.error:.2e}", flush=True)
        if not c.ok:
            run.failures.append(c.message("NEB(parallel=True) vs SevenNetCalculator's band"))
    return run.verdict("SevenNet-0", len(SEVENNET_STRUCTURES) + run.full)


def neb_band(model, parallel: bool) -> dict:
    """A vacancy hop's band of 2 moving images (8 FIRE steps; no climbing image: the two tie by the hop's symmetry)
    relaxed by ASE's NEB: ``parallel``, NEB(parallel=True) over this launch's 2 ranks, each image's MLIPCalculator on
    its own communicator (examples/neb_parallel.py), the end points' on every rank together; else sevenn's
    SevenNetCalculator on every image, one process.
    {"positions": [4, N, 3] Å, "energies": [2] eV of the moving images}, every rank alike."""
    from ase.mep import NEB
    from ase.optimize import FIRE
    from ase.parallel import MPI4PY, DummyMPI
    from mpi4py import MPI
    from sevenn.calculator import SevenNetCalculator

    initial, final = copper_vacancy_hop()
    images = [initial] + [initial.copy() for _ in range(2)] + [final]
    world = MPI.COMM_WORLD
    if parallel:  # the end points, one structure each, on every rank together
        mine = world.rank + 1
        images[mine].calc = MLIPCalculator(model, comm=world.Split(mine))
        for end in (images[0], images[-1]):
            end.calc = MLIPCalculator(model)
    else:
        for image in images:
            image.calc = SevenNetCalculator("7net-0")
    neb = NEB(images, parallel=parallel, world=MPI4PY(world) if parallel else DummyMPI())
    neb.interpolate()
    FIRE(neb, logfile=None).run(fmax=1e-3, steps=8)
    positions = np.array([image.positions for image in images])  # (NEB broadcasts each image's positions)
    return {"positions": positions, "energies": np.asarray(neb.energies[1:-1], dtype=float)}
