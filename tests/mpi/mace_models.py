"""MACE models (the e3nn 0.4.4 fixtures of tests/data/mace) through mlip_parallel.evaluate == MACE's own
MACECalculator (its results saved beside the fixtures), run by tests/mpi/families.py: every geometry, layerwise (ghost
features through MACE's exchange hook) and, where its shell stays small, wide; float64 to 1e-9 relative, float32 to
1e-5. The first model (ZBL) on every grid and its halo's faults planted (2 and 3 ranks); every model and head on the
automatic grid, in many chunks (61-edge chunks, a 1-byte budget) and compared with one pass over all edges (float64
1e-12, float32 1e-5); the ASE calculator once per model. Grids, lean and backend scopes: the first model alone (and the
faults)."""
import mlip_parallel
import potentials
from faults import caught
from md import MLIPCalculator
from systems import MACE_FIXTURES, mace_fixture, mace_view

WIDE = ("clusters", "small_cell", "slab")  # wide mode's shell (layers × r_max) stays affordable here


def run(run) -> tuple:
    """``run``: families.AdapterRun. Returns its verdict."""
    world = run.world
    fixtures = MACE_FIXTURES if run.full else MACE_FIXTURES[:1]
    for name in fixtures:
        path, heads, geometries = mace_fixture(name)
        tolerance = 1e-5 if name.endswith("f32") else 1e-9
        for head in heads if run.full else heads[:1]:
            model = potentials.MACE(path, head=head)
            for geometry, (atoms, references) in geometries.items():
                reference = references[head]
                for grid in run.grids_for(name == fixtures[0] and head == heads[0]):
                    modes = ("layerwise", "wide") if geometry in WIDE and grid is None and run.full else \
                        ("layerwise",)
                    for mode in modes:
                        run.case(f"{name} head={head} {geometry}", model, atoms, reference, tolerance, grid, mode,
                                 view=lambda r: mace_view(r, reference, atoms),
                                 plain_tolerance=1e-5 if name.endswith("f32") else 1e-12)
        if run.full:
            atoms, references = geometries["hcp_triclinic"]
            atoms = atoms.copy()
            atoms.calc = MLIPCalculator(model)  # the last head
            via = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
            run.check(f"{name} MLIPCalculator hcp_triclinic", mace_view(via, references[heads[-1]], atoms),
                      references[heads[-1]], tolerance)
        if world.rank == 0:
            print(f"{name}: max rel err vs MACECalculator {run.worst[name]:.2e}", flush=True)
        if name == "mace-zbl-f64" and world.size in (2, 3):  # the halo's faults: each caught by the comparison
            atoms, reference = geometries["fcc_bulk"]
            model, grid = potentials.MACE(path, head=heads[0]), run.grids[1]
            run.failures += caught(world, f"{name} fcc_bulk grid={grid}", lambda: mace_view(
                mlip_parallel.evaluate(model, atoms, grid=grid), reference[heads[0]], atoms), reference[heads[0]],
                tolerance)
    # the first model: 7 geometries × its grids (full: + 3 wide, and each other model and head, three: 7 + 3 wide)
    per_grid = 7 * len(run.grids_for(True))
    expected = per_grid + 3 + 3 * (7 + 3) if run.full else per_grid
    return run.verdict("MACE", expected)
