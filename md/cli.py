"""``mlip-md CONFIG.yaml``: a native distributed MD job (run it under ``mpiexec -n P``).

Every rank reads the same config and builds the same start; each rank then holds only its own atoms.
Writes OUTPUT/thermo.csv, OUTPUT/trajectory.extxyz or .traj (atoms in global id order), OUTPUT/final.extxyz
and OUTPUT/restart.npz, and prints a thermo table with a progress bar on rank 0.
"""
from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

import numpy as np

from mlip_parallel.config import ConfigError, config_parser, read_config, schema_help as config_help, \
    validate as config_validate

# key: (types, default, help); a dict value is a nested section. Missing keys take the defaults.
SCHEMA = {
    "model": {
        "lennard_jones": (dict, None, "Lennard-Jones parameters {epsilon: eV, sigma: Å, cutoff: Å}"),
        "checkpoint": (str, None, "path of a potentials checkpoint (potentials.save) or a bundled model name; "
                                  "with no model given, the bundled cu-emt (Cu, trained on EMT data)"),
        "sevennet": (str, None, "a SevenNet checkpoint name or path, e.g. 7net-0 (needs the sevenn extra)"),
        "dtype": (str, "float64", "float32 or float64 for the ML models"),
    },
    "structure": {
        "file": (str, None, "any ASE-readable structure file"),
        "element": (str, "Cu", "built structure: element symbol"),
        "crystal": (str, "fcc", "built structure: ase.build.bulk crystal structure"),
        "a": (float, 3.61, "built structure: lattice constant, Å"),
        "repeat": (list, [10, 10, 10], "built structure: cubic cells per direction"),
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
    "balance_every": (int, 0, "load balance: 0 keeps uniform cut planes; N > 0 shifts them so ranks own similar "
                              "atom counts, at the start and every N steps (slabs, droplets)"),
    "restart_from": (str, None, "continue from a restart.npz (structure, velocities and step come from it)"),
    "output": {
        "directory": (str, "md_output", "output directory"),
        "thermo_every": (int, 10, "thermo row every N steps"),
        "trajectory_every": (int, 100, "trajectory frame every N steps (0: none)"),
        "trajectory_format": (str, "extxyz", "extxyz (OUTPUT/trajectory.extxyz) or traj (ASE's OUTPUT/trajectory.traj)"),
        "restart_every": (int, 0, "write OUTPUT/restart.npz every N steps and at the end (0: at the end only)"),
    },
}
CHOICES = {"ensemble": ("nve", "langevin", "bussi", "nose-hoover", "npt"), "mode": ("layerwise", "wide"),
           "model.dtype": ("float32", "float64"), "output.trajectory_format": ("extxyz", "traj")}


def validate(config) -> dict:
    """Fill defaults and check every key and type; raise ConfigError naming the key."""
    return config_validate(config, SCHEMA, CHOICES)


def schema_help() -> str:
    return config_help(SCHEMA)


def build_model(section):
    import torch

    import potentials

    given = [k for k in ("lennard_jones", "checkpoint", "sevennet") if section[k] is not None]
    if len(given) > 1:
        raise ConfigError(f"model takes one of lennard_jones, checkpoint, sevennet (got {given})")
    if not given:
        section = dict(section, checkpoint="cu-emt")
    if section["lennard_jones"] is not None:
        try:
            return potentials.LennardJones(**section["lennard_jones"])
        except TypeError as exc:
            raise ConfigError(f"model.lennard_jones: {exc}") from None
    if section["checkpoint"] is not None:
        try:
            model = potentials.load(section["checkpoint"])
        except potentials.CheckpointError as exc:
            raise ConfigError(f"model.checkpoint: {exc}") from None
        return model.to(torch.float32 if section["dtype"] == "float32" else torch.float64)
    from potentials.sevennet import SevenNet

    return SevenNet(section["sevennet"])


def build_integrator(config):
    from .integrators import MTK, Bussi, Langevin, NoseHoover, VelocityVerlet

    dt, t, b, ensemble = config["timestep_fs"], config["thermostat"], config["barostat"], config["ensemble"]
    if dt <= 0:
        raise ConfigError(f"timestep_fs must be > 0, got {dt}")
    if ensemble != "nve" and t["temperature_K"] <= 0:
        raise ConfigError(f"thermostat.temperature_K must be > 0 for ensemble {ensemble}, got {t['temperature_K']}")
    for key, value in (("thermostat.tdamp_fs", t["tdamp_fs"]), ("thermostat.tau_fs", t["tau_fs"]),
                       ("barostat.pdamp_fs", b["pdamp_fs"])):
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    if ensemble == "langevin":
        return Langevin(dt, t["temperature_K"], t["friction_per_fs"], seed=config["seed"])
    if ensemble == "bussi":
        return Bussi(dt, t["temperature_K"], t["tau_fs"], seed=config["seed"])
    if ensemble == "nose-hoover":
        return NoseHoover(dt, t["temperature_K"], t["tdamp_fs"])
    if ensemble == "npt":
        return MTK(dt, t["temperature_K"], b["pressure_GPa"], t["tdamp_fs"], b["pdamp_fs"], isotropic=b["isotropic"])
    return VelocityVerlet(dt)


def build_atoms(config):
    from ase.build import bulk
    from ase.io import read
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.parallel import DummyMPI

    section = config["structure"]
    if section["file"] is not None:
        try:
            atoms = read(section["file"])
        except Exception as exc:  # ASE raises many types for unreadable files
            raise ConfigError(f"structure.file: cannot read {section['file']!r}: {exc}") from None
    else:
        repeat = section["repeat"]
        if len(repeat) != 3 or not all(isinstance(r, int) and r > 0 for r in repeat):
            raise ConfigError(f"structure.repeat must be three positive integers, got {repeat}")
        try:
            atoms = bulk(section["element"], section["crystal"], a=section["a"], cubic=True).repeat(repeat)
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"structure: cannot build {section['element']} {section['crystal']}: {exc}") from None
    if config["temperature_K"] > 0:
        thermalize_momenta(atoms, temperature_K=config["temperature_K"], rng=np.random.default_rng(config["seed"]),
                           comm=DummyMPI())  # every rank draws the same velocities
    return atoms


THERMO_COLUMNS = ("step", "time_fs", "temperature_K", "epot_eV", "ekin_eV", "etot_eV", "pressure_GPa",
                  "volume_A3", "seconds_per_step")


def simulate(config) -> list:
    """Run the validated ``config``; return the thermo rows (every rank)."""
    from ase import Atoms
    from ase.io import write

    from mlip_parallel import get_backend

    from .engine import MDSystem, run

    backend = get_backend()
    model = build_model(config["model"])
    integrator = build_integrator(config)
    balance = config["balance_every"] > 0
    if config["restart_from"] is not None:
        try:
            system, first_step = MDSystem.from_restart(model, config["restart_from"], integrator=integrator,
                                                       skin=config["skin"], mode=config["mode"])
        except (OSError, KeyError, ValueError) as exc:
            raise ConfigError(f"restart_from: cannot read {config['restart_from']!r}: {exc}") from None
    else:
        atoms, first_step = build_atoms(config), 0
        if config["ensemble"] == "npt" and not atoms.pbc.all():
            raise ConfigError(f"ensemble npt needs a fully periodic structure, got pbc={atoms.pbc.tolist()}")
        system = MDSystem.from_atoms(model, atoms, skin=config["skin"], mode=config["mode"], balance=balance)
    out = config["output"]
    directory = Path(out["directory"])
    every, traj_every, restart_every = max(1, out["thermo_every"]), out["trajectory_every"], out["restart_every"]
    steps = first_step + config["steps"]
    trajectory = f"trajectory.{out['trajectory_format']}"
    root = backend.rank == 0
    continuing = config["restart_from"] is not None  # append to thermo.csv and the trajectory
    if root:
        directory.mkdir(parents=True, exist_ok=True)
        if not continuing:
            (directory / trajectory).unlink(missing_ok=True)
        csv_file = open(directory / "thermo.csv", "a" if continuing else "w", newline="")
        writer = csv.DictWriter(csv_file, fieldnames=THERMO_COLUMNS)
        if csv_file.tell() == 0:
            writer.writeheader()
        print(f"mlip-md: {system.n_atoms} atoms on {backend.size} rank(s), {config['ensemble']}, "
              f"steps {first_step} to {steps} of {config['timestep_fs']} fs")
        print(" ".join(f"{c:>14s}" for c in THERMO_COLUMNS))
        from tqdm import tqdm
        bar = tqdm(total=steps, initial=first_step, unit="step", file=sys.stderr, dynamic_ncols=True)

    def snapshot(name, append):  # collective: gathers in global id order, rank 0 writes
        positions, numbers, velocities = (system.gather(k) for k in ("positions", "numbers", "velocities"))
        if root:
            frame = Atoms(numbers=numbers, positions=positions, cell=system.cell, pbc=system.pbc)
            frame.set_velocities(velocities)
            if name.endswith(".traj"):  # ase.io.write cannot append to .traj files: use the Trajectory
                from ase.io.trajectory import Trajectory
                with Trajectory(directory / name, "a" if append else "w") as trajectory_file:
                    trajectory_file.write(frame)
            else:
                write(directory / name, frame, format="extxyz", append=append)

    rows, step = [], first_step
    stops = {steps} | {s for n in (every, traj_every, restart_every) if n for s in range(0, steps + 1, n)}
    system.compute_forces()
    start = time.perf_counter()
    for target in sorted(s for s in stops if s >= first_step):
        if target > step:
            t0 = time.perf_counter()
            state = run(system, integrator, target - step, thermo_every=target - step, start_step=step,
                        balance_every=config["balance_every"])[-1]
            per_step = (time.perf_counter() - t0) / (target - step)
            step = target
        else:
            state, per_step = system.thermo(step, integrator.dt), 0.0
        already_written = continuing and step == first_step  # the previous run's last row and frame
        if (step % every == 0 or step == steps) and not already_written:
            row = dict(state, seconds_per_step=per_step)
            rows.append(row)
            if root:
                writer.writerow(row)
                csv_file.flush()
                bar.clear()
                print(" ".join(f"{row[c]:14.6g}" for c in THERMO_COLUMNS), flush=True)
        if traj_every and step % traj_every == 0 and not already_written:
            snapshot(trajectory, append=True)
        if step == steps or (restart_every and step % restart_every == 0):
            system.save_restart(directory / "restart.npz", step, integrator)
        if root:
            bar.update(step - bar.n)
    snapshot("final.extxyz", append=False)
    if root:
        bar.close()
        csv_file.close()
        print(f"mlip-md: done in {time.perf_counter() - start:.1f} s, {system.rebuilds} neighbour rebuilds; "
              f"output in {directory}/")
    return rows


def main(argv=None) -> int:
    args = config_parser("mlip-md", __doc__.splitlines()[0], SCHEMA).parse_args(argv)
    try:
        simulate(validate(read_config(args.config)))
    except ConfigError as exc:  # raised alike on every rank, before any collective
        print(f"mlip-md: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
