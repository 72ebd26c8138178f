"""SevenNet-0 through mlip_parallel (evaluate and the ASE calculator) == sevenn's own calculator on
one process: energy, forces, stress to 1e-5 relative (float32). Run under mpiexec -n P."""
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
from md import MLIPCalculator  # noqa: E402
from potentials.adapters.sevennet import SevenNet  # noqa: E402
from systems import SEVENNET_STRUCTURES, exit_with_verdict, max_relative_error, sevennet_reference  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
model = SevenNet("7net-0")
failures, worst = [], 0.0
# sevenn's references, each structure's computed by one rank (no rank repeats another's work)
names = list(SEVENNET_STRUCTURES)
mine = {n: sevennet_reference(SEVENNET_STRUCTURES[n]()) for k, n in enumerate(names) if k % world.size == world.rank}
references = {n: r for part in world.allgather(mine) for n, r in part.items()}
for name, build in SEVENNET_STRUCTURES.items():
    atoms = build()
    reference = references[name]
    # wide mode needs a 5 x 5 A ghost shell: affordable for the cluster, not for small periodic cells
    for mode in ("layerwise", "wide") if name == "silicon_cluster" else ("layerwise",):
        result = mlip_parallel.evaluate(model, atoms, mode=mode)
        result.pop("energies")
        errors = max_relative_error(result, reference)
        calc_atoms = atoms.copy()
        calc_atoms.calc = MLIPCalculator(model, mode=mode)
        via_calculator = {"energy": calc_atoms.get_potential_energy(), "forces": calc_atoms.get_forces()}
        if "stress" in reference:
            via_calculator["stress"] = calc_atoms.get_stress()
        calc_errors = max_relative_error(via_calculator, reference)
        case_worst = max(max(errors.values()), max(calc_errors.values()))
        worst = max(worst, case_worst)
        if case_worst > 1e-5:
            failures.append(f"{name} {mode}: evaluate {errors}, calculator {calc_errors}")
        if world.rank == 0:
            print(f"{name:16s} {mode:9s} max rel err vs SevenNetCalculator {case_worst:.2e}", flush=True)
exit_with_verdict(world, failures, lambda count: f"P={world.Get_size()}: SevenNet-0 {count} failures, max rel err "
                                                 f"{worst:.2e}")
