"""mlip-md CONFIG.yaml: a native distributed MD job (run it under mpiexec -n P).

Every rank reads the same config and builds the same start; each rank then holds only its own atoms.
The config, the output directory and the structure's elements are checked before anything is written
(``start``). Writes OUTPUT/thermo.csv, OUTPUT/trajectory.extxyz or .traj (atoms in global id order, with step,
time, energy, forces and stress), OUTPUT/final.extxyz (full precision), OUTPUT/restart.npz and OUTPUT/thermo.png,
and prints a thermo table with a progress bar and a closing summary on rank 0 (the run: ``job.MDJob``; its
summary: ``report``). Here: the configuration's keys and the command.
"""
from __future__ import annotations

import sys

from mlip_parallel.allocator import keep_freed_memory
from mlip_parallel.config import ConfigError, ConfigTable, config_parser, read_job, report_error
from mlip_parallel.errors import SimulationError
from mlip_parallel.launch import end_job
from mlip_parallel.model_section import COMMITTEE_KEYS, COMMITTEE_RULES, model_rules, model_schema
from potentials.errors import OutputError
from potentials.families import FamilyError

from .start import DEFAULT_MODEL

# key: (types, default, help); a dict value is a nested section. Missing keys take the defaults. The model section
# comes from the model families (model_section.model_schema): one key per family, its options beside it, dtype.
SECTIONS = {
    "structure": {
        "file": (str, None, "any ASE-readable structure file"),
        "element": (str, "Cu", "built structure: element symbol"),
        "crystal": (str, "fcc", "built structure: ase.build.bulk crystal structure"),
        "a": (float, 3.61, "built structure: lattice constant, Å"),
        "repeat": (list, [10, 10, 10], "built structure: cubic cells per direction"),
        "min_distance": (float, 0.5, "atoms closer than this (Å, periodic images included) are an error in the "
                                     "structure, named with the pair (0: not checked)"),
    },
    "temperature_K": (float, 300.0, "initial Maxwell-Boltzmann temperature (seeded); 0 keeps the file's velocities"),
    "ensemble": (str, "nve", "nve, langevin (BAOAB), bussi (stochastic velocity rescaling), nose-hoover "
                 "(Nose-Hoover chain) or npt (MTK barostat + Nose-Hoover chains)"),
    "thermostat": {
        "temperature_K": (float, 300.0, "langevin/bussi/nose-hoover/npt: target temperature"),
        "friction_per_fs": (float, 0.01, "langevin: friction, 1/fs"),
        "tau_fs": (float, 100.0, "bussi: relaxation time, fs"),
        "tdamp_fs": (float, 100.0, "nose-hoover/npt: thermostat damping time, fs (about 100 time steps)"),
    },
    "barostat": {
        "pressure_GPa": (float, 0.0, "npt: target pressure, GPa"),
        "pdamp_fs": (float, 1000.0, "npt: barostat damping time, fs (about 1000 time steps)"),
        "isotropic": (bool, True, "npt: true scales the cell uniformly, false lets every cell component move"),
    },
    "timestep_fs": (float, 2.0, "time step, fs"),
    "steps": (int, 1000, "number of steps"),
    "seed": (int, 0, "seed of the initial velocities and of the thermostat noise"),
    "skin": (float, 1.0, "neighbour skin, Å: rebuild when an atom moved more than skin/2"),
    "mode": (str, "layerwise", "layerwise or wide halo"),
    "memory_budget_gb": (float, None, "GB one chunk of a block's per-edge temporaries may take on a rank (default: "
                                      "every edge at once where the memory pre-flight predicts that fits half the "
                                      "memory a rank has, else chunks of 5 % of the device's free memory, at most "
                                      "2 GiB on a GPU and 8 MiB on a CPU); bounds memory, never changes results"),
    "keep_freed_memory": (bool, True, "glibc's malloc keeps freed tensors' memory for reuse instead of returning it "
                                      "to the system and faulting it in again (less system time; the resident size "
                                      "stays at its peak); your own MALLOC_*_ variables or glibc.malloc tunables win"),
    "device": (str, "auto", "where each rank's model and atoms live: auto (cuda:<local rank> where CUDA exists, "
                            "else cpu), cpu or cuda"),
    "balance_every": (int, 0, "load balance: 0 keeps uniform cut planes; N > 0 shifts them so ranks own similar "
                              "atom counts, at the start and every N steps (slabs, droplets)"),
    "verify": (bool, False, "compare the first step's energy, forces and stress with one process's evaluation of the "
                            "same structure (python -m mlip_parallel.check's comparison) and stop, naming the "
                            "difference, when they differ beyond floating-point summation order"),
    "resume": (bool, False, "continue from OUTPUT/restart.npz when there is one, else start; steps is then the "
                            "run's total, so the same command, run again after a crash, finishes the run"),
    "restart_from": (str, None, "continue from a restart.npz (structure, velocities and step come from it) for "
                                "steps more steps; in its own directory the outputs continue, elsewhere they start"),
    "uncertainty": {
        "every": (int, 0, "committee: its model deviation every N steps (0: at the thermo rows, output.thermo_every) "
                          "into OUTPUT/model_devi.csv: step, max_devi_f, min_devi_f, avg_devi_f (σ_F over the atoms, "
                          "eV/Å), devi_e (the members' standard deviation of the energy per atom, eV)"),
        "select": (list, None, "committee: [low, high] eV/Å: the frames whose max_devi_f lies within go to "
                               "OUTPUT/candidates.extxyz (σ_F per atom as the array devi_f), for labelling"),
        "stop_above": (float, None, "committee: end the run (status 1, restart.npz written) at a step whose max_devi_f "
                                    "is above this, eV/Å"),
    },
    "output": {
        "directory": (str, "md_output", "output directory"),
        "thermo_every": (int, 10, "thermo row every N steps"),
        "trajectory_every": (int, 100, "trajectory frame every N steps (0: none)"),
        "trajectory_format": (str, "extxyz", "extxyz (OUTPUT/trajectory.extxyz) or traj (ASE's OUTPUT/trajectory.traj)"),
        "restart_every": (int, 0, "write OUTPUT/restart.npz every N steps and at the end (0: at the end only)"),
        "overwrite": (bool, False, "write over a non-empty output directory (refused otherwise, unless resume "
                                   "or restart_from continues a run there)"),
        "progress": (bool, True, "report progress on stderr: a bar on a terminal, a line every 30 s in a log file "
                                 "(step, rate, ETA); false (or --no-progress): none"),
    },
}
# allowed values (a tuple) or the range of a number (mlip_parallel.config.obeys); other numbers: finite, >= 0
RULES = {"ensemble": ("nve", "langevin", "bussi", "nose-hoover", "npt"), "mode": ("layerwise", "wide"),
         "device": ("auto", "cpu", "cuda"), "output.trajectory_format": ("extxyz", "traj"),
         "structure.a": "> 0", "thermostat.tau_fs": "> 0", "thermostat.tdamp_fs": "> 0",
         "barostat.pressure_GPa": "finite", "barostat.pdamp_fs": "> 0", "timestep_fs": "> 0",
         "memory_budget_gb": "> 0", "uncertainty.stop_above": "> 0"}


def model_keys() -> tuple:
    """(keys, rules) of mlip-md's model section: a key per model family and its options, dtype, the committee's."""
    model = {**model_schema(), **COMMITTEE_KEYS}
    types, default, text = model["checkpoint"]
    model["checkpoint"] = (types, default, f"{text}; with no model given, {DEFAULT_MODEL}")
    return model, {**model_rules(), **COMMITTEE_RULES}


TABLE = ConfigTable(SECTIONS, RULES, model_keys)  # mlip-md's configuration: the model section first, then SECTIONS


def validate(config) -> dict:
    """Fill defaults and check every key and type; raise ConfigError naming the key."""
    return TABLE.validate(config)


def schema_help() -> str:
    return TABLE.help()


def simulate(config) -> list:
    """Run the validated ``config`` (``job.MDJob``); return the thermo rows (every rank)."""
    from .job import MDJob  # (torch: at first use)

    if config["keep_freed_memory"]:
        keep_freed_memory()
    return MDJob(config).run()


def main(argv=None) -> int:
    try:
        keys = TABLE.schema()
    except FamilyError as exc:  # an installed package's model family that cannot be registered
        report_error("mlip-md", exc)
        return 2
    args = config_parser("mlip-md", __doc__.splitlines()[0], keys).parse_args(argv)
    try:
        simulate(read_job(args, keys, TABLE.all_rules()))
    except ConfigError as exc:  # raised alike on every rank by prepare(), before any output and any collective
        report_error("mlip-md", exc)
        return 2
    except OutputError as exc:  # rank 0 could not write: one line, and the whole job ends
        end_job("mlip-md", exc)
        return 1
    except SimulationError as exc:  # the dynamics blew up, alike on every rank: one line, status 1
        report_error("mlip-md", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
