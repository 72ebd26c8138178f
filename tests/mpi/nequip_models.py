"""NequIP (with ZBL) and Allegro models of the nequip framework (tests/data/nequip: checkpoint and package)
through mlip_parallel.evaluate == the framework's own ASE calculator on one process: every geometry ×
grid, layerwise (NequIP's ghost exchange slots over our halo; Allegro, strictly local, without) and
wide; the ASE calculator once per model. Float64 to 1e-9 relative. Run under mpiexec -n P or torchrun."""
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import logging  # noqa: E402

import torch  # noqa: E402

import mlip_parallel  # noqa: E402
import potentials  # noqa: E402
from md import MLIPCalculator  # noqa: E402
from systems import GEOMETRIES, NEQUIP_DIR, NEQUIP_FIXTURES, max_relative_error, nequip_reference  # noqa: E402

logging.disable(logging.INFO)
torch.set_num_threads(1)
world = mlip_parallel.get_backend()
P = world.size
GRIDS = {1: [None], 2: [None, (2, 1, 1), (1, 1, 2)], 3: [None, (3, 1, 1), (1, 3, 1), (1, 1, 3)],
         4: [None, (1, 1, 4), (2, 2, 1), (4, 1, 1), (1, 2, 2)]}[P]
WIDE = ("clusters", "small_cell", "slab")  # NequIP's wide shell (3 × r_max) stays affordable here

failures, cases, worst = [], 0, {}
for name in NEQUIP_FIXTURES:
    files = [NEQUIP_DIR / f"{name}.nequip.zip", NEQUIP_DIR / f"{name}.ckpt"]
    # the framework's references, each geometry's computed by one rank
    mine = {g: nequip_reference(files[0], make()) for k, (g, make) in enumerate(GEOMETRIES.items()) if k % P == world.rank}
    references = {g: r for part in world.allgather(mine) for g, r in part.items()}
    for path in files:
        model = potentials.NequIPFramework(path)
        for geometry, make in GEOMETRIES.items():
            atoms = make()
            grids = GRIDS if path == files[0] else GRIDS[:1]  # the checkpoint: the same model, checked once
            for grid in grids:
                for mode in ("layerwise", "wide") if geometry in WIDE and grid is None else ("layerwise",):
                    result = mlip_parallel.evaluate(model, atoms, mode=mode, grid=grid)
                    result.pop("energies")
                    errors = max_relative_error(result, references[geometry])
                    cases += 1
                    worst[name] = max(worst.get(name, 0.0), max(errors.values()))
                    if max(errors.values()) > 1e-9:
                        failures.append(f"{path.name} {geometry} grid={grid} {mode}: {errors}")
    atoms = GEOMETRIES["hcp_triclinic"]()
    atoms.calc = MLIPCalculator(model)
    via = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    errors = max_relative_error(via, references["hcp_triclinic"])
    if max(errors.values()) > 1e-9:
        failures.append(f"{name} MLIPCalculator: {errors}")
    if world.rank == 0:
        print(f"{name} ({model.layers} layer(s)): max rel err vs NequIPCalculator {worst[name]:.2e} (evaluate), "
              f"{max(errors.values()):.2e} (MLIPCalculator)", flush=True)
expected = len(NEQUIP_FIXTURES) * (len(GEOMETRIES) * (len(GRIDS) + 1) + 2 * len(WIDE))
if cases != expected:
    failures.append(f"{cases} cases ran, expected {expected}")
failures = sorted({f for mine in world.allgather(failures) for f in mine})
if world.rank == 0:
    print(f"P={P}: nequip framework {cases} cases, {len(failures)} failures; communication: {world.library}")
    for f in failures:
        print("FAIL", f)
sys.exit(1 if failures else 0)
