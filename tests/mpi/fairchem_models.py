"""fairchem models (the random-weight fixtures of tests/data/fairchem) through mlip_parallel.evaluate == fairchem's own
FAIRChemCalculator on the same checkpoint (its results saved in tests/data/fairchem/references.npz, checked against
the calculator in tests/test_fairchem.py), run by tests/mpi/families.py: every geometry, layerwise and, where its
shell stays small, wide; float64 to 1e-9 relative, float32 to 1e-5. The UMA-S-1.2-shaped model (omol task with a
charge and a spin, experts routed by composition, max_neighbors cutting every metal's edges) on every grid and its
halo's faults planted (2 and 3 ranks), and on the automatic grid its edge steps in many chunks (500-edge chunks, a
1-byte budget: several per block on every rank; the chunked code is the same for every fairchem model) compared with
one pass over all edges to 1e-12; the UMA-S-shaped one and the eSEN one on the automatic grid and four of the
geometries (``OTHERS``); float32 once; the ASE calculator once per model. Grids, lean and backend scopes: the first model alone
(and the faults)."""
import mlip_parallel
import potentials.messages as messages
import torch
from faults import caught
from md import MLIPCalculator
from systems import GEOMETRIES, cached_fairchem_reference, fairchem_model

WIDE = ("clusters", "small_cell")  # wide mode's shell ((layers + 1) × cutoff) stays affordable here
# the geometries of the fixtures after the first (the first holds every geometry, grid and mode; the code paths are
# the same): triclinic, sheared, a slab and clusters with a rank of no atoms on 3 ranks
OTHERS = ("hcp_triclinic", "sheared", "slab", "clusters")


def run(run) -> tuple:
    """``run``: families.AdapterRun. Returns its verdict."""
    world = run.world
    chunk_edges, messages.MIN_CHUNK_EDGES = messages.MIN_CHUNK_EDGES, 500  # fairchem's edge step costs much per chunk
    try:
        # first (every grid, the faults): UMA-S-1.2's shape, whose experts are routed by the whole structure's
        # composition (summed over the ranks) and whose max_neighbors cut reaches into the ghosts; 2 layers
        fixtures = ["uma-dense", "uma-moe", "esen"] if run.full else ["uma-dense"]
        for name in fixtures:
            model = fairchem_model(name)
            for geometry, build in GEOMETRIES.items():
                if name != fixtures[0] and geometry not in OTHERS:
                    continue
                atoms = build()
                reference = cached_fairchem_reference(name, geometry)
                for grid in run.grids_for(name == fixtures[0]):
                    modes = ("layerwise", "wide") if geometry in WIDE and grid is None and name == fixtures[0] and \
                        run.full else ("layerwise",)
                    for mode in modes:
                        run.case(f"{name} {geometry}", model, atoms, reference, 1e-9, grid, mode,
                                 chunked=name == fixtures[0])
            if run.full:
                atoms = GEOMETRIES["hcp_triclinic"]()
                atoms.calc = MLIPCalculator(model)
                via = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(),
                       "stress": atoms.get_stress()}
                run.check(f"{name} MLIPCalculator hcp_triclinic", via,
                          cached_fairchem_reference(name, "hcp_triclinic"), 1e-9)
            if world.rank == 0:
                print(f"{name}: max rel err vs FAIRChemCalculator {run.worst[name]:.2e}", flush=True)
            if name == fixtures[0] and world.size in (2, 3):  # the halo's faults: each caught by the comparison
                atoms, grid = GEOMETRIES["fcc_bulk"](), run.grids[1]
                run.failures += caught(world, f"{name} fcc_bulk grid={grid}",
                                       lambda: mlip_parallel.evaluate(model, atoms, grid=grid),
                                       cached_fairchem_reference(name, "fcc_bulk"), 1e-9)
        if run.full:
            single = fairchem_model("uma-moe", dtype=torch.float32)
            for geometry in ("sheared", "slab"):
                run.case(f"uma-moe-float32 {geometry}", single, GEOMETRIES[geometry](),
                         cached_fairchem_reference("uma-moe", geometry, torch.float32), 1e-5, plain_tolerance=1e-5)
    finally:
        messages.MIN_CHUNK_EDGES = chunk_edges
    # the first model: 7 geometries × its grids (+ 2 wide); the other two: OTHERS; float32: 2
    per_grid = 7 * len(run.grids_for(True))
    expected = per_grid + len(WIDE) + 2 * len(OTHERS) + 2 if run.full else per_grid
    return run.verdict("fairchem", expected)
