"""NequIP (with ZBL) and Allegro models of the nequip framework (tests/data/nequip: checkpoint and package)
through mlip_parallel.evaluate == the framework's own ASE calculator on one process: every geometry ×
grid, layerwise (NequIP's ghost exchange slots over our halo; Allegro, strictly local, without) and
wide; the ASE calculator once per model. Float64 to 1e-9 relative. Every evaluation runs memory-bounded in
many chunks (a 1-byte budget, 61-edge chunks: NequIP's convolutions through chunked_tp_scatter, Allegro in
groups of atoms through messages.chunked_local); with the default grid it is also compared with one pass over
all edges (memory_budget_gb=inf) to 1e-12. Run under mpiexec -n P or torchrun."""
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import logging  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mlip_parallel  # noqa: E402
import potentials  # noqa: E402
from md import MLIPCalculator  # noqa: E402
from comparison import compare  # noqa: E402
from faults import FAULTS, FEATURE_FAULTS, caught, planted, tally  # noqa: E402
from systems import GEOMETRIES, NEQUIP_DIR, NEQUIP_FIXTURES, exit_with_verdict, in_many_chunks, nequip_reference  # noqa: E402

logging.disable(logging.INFO)
torch.set_num_threads(1)
chunks = in_many_chunks()  # chunked calls seen: NequIP's edge sums, Allegro's groups of atoms (checkpoints)
TINY, PLAIN = 1e-9, float("inf")
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
                    result = mlip_parallel.evaluate(model, atoms, mode=mode, grid=grid, memory_budget_gb=TINY)
                    result.pop("energies")
                    label = f"{path.name} {geometry} grid={grid} {mode}"
                    if grid is None:
                        try:
                            plain = mlip_parallel.evaluate(model, atoms, mode=mode, memory_budget_gb=PLAIN)
                        except mlip_parallel.MemoryLimitError:  # the host's free memory (read per rank) is short
                            # of the pre-flight's (safe-side) estimate of one pass: 1 GB chunks, still far from TINY's
                            plain = mlip_parallel.evaluate(model, atoms, mode=mode, memory_budget_gb=1.0)
                        plain.pop("energies")
                        chunked = compare(result, plain, 1e-12)
                        if not chunked.ok:
                            failures.append(chunked.message(f"{label}: chunked vs plain"))
                    comparison = compare(result, references[geometry], 1e-9)
                    cases += 1
                    worst[name] = np.max([worst.get(name, 0.0), comparison.error])
                    if not comparison.ok:
                        failures.append(comparison.message(label))
    atoms = GEOMETRIES["hcp_triclinic"]()
    atoms.calc = MLIPCalculator(model)
    via = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    comparison = compare(via, references["hcp_triclinic"], 1e-9)
    if not comparison.ok:
        failures.append(comparison.message(f"{name} MLIPCalculator"))
    if world.rank == 0:
        print(f"{name} ({model.layers} layer(s)): max rel err vs NequIPCalculator {worst[name]:.2e} (evaluate), "
              f"{comparison.error:.2e} (MLIPCalculator)", flush=True)
    if P in (2, 3):  # the halo's faults, planted; Allegro exchanges no node features (strictly local): it must
        # call no halo refresh, and only the ghost positions' gradients (not sent home) can reach it
        atoms, grid, calls = GEOMETRIES["fcc_bulk"](), GRIDS[1], []
        with planted("none", calls):
            mlip_parallel.evaluate(model, atoms, grid=grid)
        if (calls == []) != model.state_per_edge:
            failures.append(f"{name}: {len(calls)} halo refreshes in one evaluation")
        failures += caught(world, f"{name} fcc_bulk grid={grid}", lambda: mlip_parallel.evaluate(model, atoms, grid=grid),
                           references["fcc_bulk"], 1e-9,
                           [f for f in FAULTS if not (model.state_per_edge and f in FEATURE_FAULTS)])
seen = {k: sum(world.allgather(v)) for k, v in chunks.items()}
if not all(seen.values()):
    failures.append(f"the memory-bounded paths did not run in chunks: {seen}")
expected = len(NEQUIP_FIXTURES) * (len(GEOMETRIES) * (len(GRIDS) + 1) + 2 * len(WIDE))
if cases != expected:
    failures.append(f"{cases} cases ran, expected {expected}")
exit_with_verdict(world, failures, lambda count: f"P={P}: nequip framework {cases} cases, {count} failures; chunked "
                                                 f"calls {seen}; {tally()}; communication: {world.library}")
