"""NequIP (with ZBL) and Allegro models of the nequip framework (tests/data/nequip: package and checkpoint) through
mlip_parallel.evaluate == the framework's own ASE calculator on one process, run by tests/mpi/families.py: every
geometry, layerwise (NequIP's ghost exchange slots over our halo; Allegro, strictly local, without) and wide where its
shell stays small; float64 to 1e-9 relative. Each model's package on every grid, its checkpoint on the automatic one;
on the automatic grid in many chunks (a 1-byte budget, 61-edge chunks: NequIP's convolutions through
chunked_tp_scatter, Allegro in groups of atoms through messages.chunked_local) and compared with one pass over all
edges to 1e-12; the ASE calculator once per model; the halo's faults planted on 2 and 3 ranks (Allegro, which calls
no halo refresh: its ghost gradients). Grids, lean and backend scopes: each model's package on every geometry, NequIP on
its grids, Allegro on the automatic one (and the faults). Allegro's
cases need nequip-allegro (left out, and said, without it)."""
import importlib.util
import logging

import mlip_parallel
import potentials
from faults import FAULTS, FEATURE_FAULTS, caught, planted
from md import MLIPCalculator
from systems import GEOMETRIES, NEQUIP_DIR, NEQUIP_FIXTURES, nequip_reference

WIDE = ("clusters", "small_cell", "slab")  # NequIP's wide shell (3 × r_max) stays affordable here


def run(run) -> tuple:
    """``run``: families.AdapterRun. Returns its verdict."""
    world, P = run.world, run.world.size
    logging.disable(logging.INFO)
    fixtures = NEQUIP_FIXTURES if importlib.util.find_spec("allegro") is not None else NEQUIP_FIXTURES[:1]
    if fixtures != NEQUIP_FIXTURES and world.rank == 0:
        print("skipped: nequip's Allegro (needs allegro)", flush=True)
    for name in fixtures:
        files = [NEQUIP_DIR / f"{name}.nequip.zip", NEQUIP_DIR / f"{name}.ckpt"]
        # the framework's references, each geometry's computed by one rank
        mine = {g: nequip_reference(files[0], make()) for k, (g, make) in enumerate(GEOMETRIES.items())
                if k % P == world.rank}
        references = {g: r for part in world.allgather(mine) for g, r in part.items()}
        for path in files if run.full else files[:1]:
            model = potentials.NequIPFramework(path)
            if run.full:  # each package on every grid, its checkpoint (the same model) on the automatic one
                grids = run.grids if path == files[0] else run.grids[:1]
            else:  # NequIP's package on its grids, Allegro's on the automatic one
                grids = run.grids_for(True) if name == fixtures[0] else run.grids[:1]
            for geometry, make in GEOMETRIES.items():
                atoms = make()
                for grid in grids:
                    modes = ("layerwise", "wide") if geometry in WIDE and grid is None and run.full else \
                        ("layerwise",)
                    for mode in modes:
                        run.case(f"{name} {path.name} {geometry}", model, atoms, references[geometry], 1e-9, grid,
                                 mode)
        if run.full:
            atoms = GEOMETRIES["hcp_triclinic"]()
            atoms.calc = MLIPCalculator(model)
            via = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
            run.check(f"{name} MLIPCalculator", via, references["hcp_triclinic"], 1e-9)
        if world.rank == 0:
            print(f"{name} ({model.layers} layer(s)): max rel err vs NequIPCalculator {run.worst[name]:.2e}",
                  flush=True)
        if P in (2, 3):  # the halo's faults; Allegro exchanges no node features (strictly local): it must call no
            # halo refresh, and only the ghost positions' gradients (not sent home) can reach it
            atoms, grid, calls = GEOMETRIES["fcc_bulk"](), run.grids[1], []
            with planted("none", calls):
                mlip_parallel.evaluate(model, atoms, grid=grid)
            if (calls == []) != model.state_per_edge:
                run.failures.append(f"{name}: {len(calls)} halo refreshes in one evaluation")
            run.failures += caught(world, f"{name} fcc_bulk grid={grid}",
                                   lambda: mlip_parallel.evaluate(model, atoms, grid=grid), references["fcc_bulk"],
                                   1e-9, [f for f in FAULTS if not (model.state_per_edge and f in FEATURE_FAULTS)])
    # full, each model: its package on every grid + 3 wide, its checkpoint on the automatic grid + 3 wide; grids and
    # lean, backend: NequIP's package on its grids, Allegro's on one
    if run.full:
        expected = len(fixtures) * (7 * (len(run.grids) + 1) + 2 * len(WIDE))
    else:
        expected = 7 * len(run.grids_for(True)) + 7 * (len(fixtures) - 1)
    return run.verdict("nequip framework", expected)
