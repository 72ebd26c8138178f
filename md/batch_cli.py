"""mlip-batch CONFIG.yaml: single points, relaxations or MD of many structures, batched, over ranks (mpiexec -n P).

The configuration's keys and the command; the run is ``batch_job.BatchJob`` (what it reads, writes and resumes).
``results.extxyz`` holds one frame per input structure in input order, with ``info["index"]`` (its position in the
input), "energy", "converged", "steps", forces and stress as ASE's single-point calculator keeps them (a committee's
deviation beside them); for MD its last frame, and ``trajectory.extxyz`` every structure's frames.
"""
from __future__ import annotations

import sys

from mlip_parallel.config import ConfigError, ConfigTable, config_parser, read_job, report_error
from mlip_parallel.errors import MLIPError
from mlip_parallel.launch import end_job
from potentials.errors import OutputError
from potentials.families import FamilyError

from .cli import model_keys

SECTIONS = {
    "structures": ((str, list), None, "the structures: an extxyz file, an ASE database (.db) or an ASE-LMDB "
                                      "(.aselmdb), or a list of them read as one set in order (required)"),
    "task": (str, "single_point", "single_point (energy, forces, stress of each structure), relax (ASE's FIRE, "
                                  "each structure to its own fmax or step limit) or md (mlip-md's integrators, each "
                                  "structure with its own temperature, pressure and seed)"),
    "relax": {
        "fmax": (float, 0.05, "relax: converged when the largest force (with cell: the largest component of "
                              "FrechetCellFilter's gradient, stress × volume included) is below this, eV/Å"),
        "max_steps": (int, 1000, "relax: at most this many FIRE steps per structure (then converged: false)"),
        "cell": (bool, False, "relax: also relax the cell (ASE's FrechetCellFilter, at zero pressure)"),
    },
    "md": {
        "ensemble": (str, "nve", "md: nve, langevin, bussi, nose-hoover or npt, as mlip-md's"),
        "temperature_K": (float, 300.0, "md: the start temperature (Maxwell-Boltzmann velocities drawn from the "
                                        "structure's seed; 0 keeps the file's velocities) and the thermostat's; a "
                                        "structure's own info['temperature_K'] wins"),
        "timestep_fs": (float, 1.0, "md: time step, fs"),
        "steps": (int, 1000, "md: steps per structure"),
        "seed": (int, 0, "md: structure k's seed is this + k (velocities and thermostat noise), unless its "
                         "info['seed'] gives one"),
        "friction_per_fs": (float, 0.01, "md: langevin friction, 1/fs"),
        "tau_fs": (float, 100.0, "md: bussi relaxation time, fs"),
        "tdamp_fs": (float, 100.0, "md: nose-hoover/npt thermostat damping time, fs"),
        "pressure_GPa": (float, 0.0, "md: npt target pressure, GPa; a structure's own info['pressure_GPa'] wins"),
        "pdamp_fs": (float, 1000.0, "md: npt barostat damping time, fs"),
        "isotropic": (bool, True, "md: npt: true scales the cell uniformly, false lets every component move"),
        "trajectory_every": (int, 100, "md: a frame of each structure every N steps (and its last) into "
                                       "OUTPUT/trajectory.extxyz, tagged by info['index'] and info['step'] (0: none)"),
    },
    "decompose_above": (int, None, "structures of more atoms than this run spatially decomposed over all ranks "
                                   "together, one after another, before the rest are batched (default: those the "
                                   "memory pre-flight finds too large for one rank)"),
    "max_atoms": (int, None, "the most atoms evaluated together as one graph on a rank (default: the size found "
                             "fastest while running, from one structure per graph up, within the memory model)"),
    "memory_budget_gb": (float, None, "GB one chunk of a block's per-edge temporaries may take (default: every edge "
                                      "at once where the memory pre-flight predicts that fits); never changes results"),
    "min_distance": (float, 0.5, "atoms closer than this (Å, periodic images included) are an error naming the "
                                 "structure and the pair (0: not checked)"),
    "device": (str, "auto", "auto (cuda:<local rank> where CUDA exists, else cpu), cpu or cuda"),
    "resume": (bool, False, "continue the run in output.directory: the structures it finished are kept and skipped, "
                            "the rest are done (the config must be the one that run had)"),
    "output": {
        "directory": (str, "batch_output", "output directory: results.extxyz at the end, parts/ while it runs"),
        "overwrite": (bool, False, "write over a non-empty output directory (refused otherwise, unless resume)"),
        "progress": (bool, True, "report progress on stderr (structures done, structures/s, ETA); false "
                                 "(or --no-progress): none"),
    },
}
RULES = {"task": ("single_point", "relax", "md"), "device": ("auto", "cpu", "cuda"), "relax.fmax": "> 0",
         "md.ensemble": ("nve", "langevin", "bussi", "nose-hoover", "npt"), "md.timestep_fs": "> 0",
         "md.tau_fs": "> 0", "md.tdamp_fs": "> 0", "md.pdamp_fs": "> 0", "md.pressure_GPa": "finite",
         "max_atoms": "> 0", "memory_budget_gb": "> 0", "decompose_above": "> 0"}
TABLE = ConfigTable(SECTIONS, RULES, model_keys)


def main(argv=None) -> int:
    try:
        keys = TABLE.schema()
    except FamilyError as exc:
        report_error("mlip-batch", exc)
        return 2
    args = config_parser("mlip-batch", __doc__.splitlines()[0], keys).parse_args(argv)
    try:
        config = read_job(args, keys, TABLE.all_rules())
    except ConfigError as exc:
        report_error("mlip-batch", exc)
        return 2
    from .batch_job import RESULTS, BatchJob  # (torch: at first use)

    try:
        job = BatchJob(config)
    except (ConfigError, MLIPError) as exc:  # alike on every rank, before anything is written
        report_error("mlip-batch", exc)
        return 2
    try:
        job.run()
    except (OutputError, MLIPError) as exc:  # a structure that cannot be evaluated, an output that cannot be written
        end_job("mlip-batch", exc)
        return 1
    if job.backend.rank == 0:
        print(f"mlip-batch: {len(job.sizes)} structures in {job.out / RESULTS} ({job.seconds:.2f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
