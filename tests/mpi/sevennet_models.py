"""SevenNet-0 through mlip_parallel (evaluate and the ASE calculator) == sevenn's own calculator on one process, run
by tests/mpi/families.py: energy, forces, stress to 1e-5 relative (float32); its halo's faults planted on 2 and 3
ranks. Grids, lean and backend scopes: every structure on the automatic grid, layerwise (and the faults)."""
import mlip_parallel
from faults import caught
from md import MLIPCalculator
from potentials.adapters.sevennet import SevenNet
from systems import SEVENNET_STRUCTURES, sevennet_reference


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
    return run.verdict("SevenNet-0", len(SEVENNET_STRUCTURES) + run.full)
