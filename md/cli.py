"""mlip-md CONFIG.yaml: a native distributed MD job (run it under mpiexec -n P).

Every rank reads the same config and builds the same start; each rank then holds only its own atoms.
The config, the output directory and the structure's elements are checked before anything is written.
Writes OUTPUT/thermo.csv, OUTPUT/trajectory.extxyz or .traj (atoms in global id order, with step, time,
energy, forces and stress), OUTPUT/final.extxyz (full precision), OUTPUT/restart.npz and OUTPUT/thermo.png,
and prints a thermo table with a progress bar and a closing summary on rank 0.
"""
from __future__ import annotations

import csv
import math
import sys
import time
from pathlib import Path

from mlip_parallel.config import ConfigError, check_output_directory, config_parser, read_job, report_error, \
    schema_help as config_help, validate as config_validate
from mlip_parallel.errors import MemoryLimitError, SimulationError
from mlip_parallel.launch import end_job
from mlip_parallel.model_section import chosen_family, load_section_model, model_families, model_rules, model_schema
from potentials.errors import OutputError
from potentials.families import FamilyError

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
                                      "5 % of the device's free memory, at most 2 GiB on a GPU and 8 MiB on a CPU); "
                                      "bounds memory, never changes results"),
    "device": (str, "auto", "where each rank's model and atoms live: auto (cuda:<local rank> where CUDA exists, "
                            "else cpu), cpu or cuda"),
    "balance_every": (int, 0, "load balance: 0 keeps uniform cut planes; N > 0 shifts them so ranks own similar "
                              "atom counts, at the start and every N steps (slabs, droplets)"),
    "resume": (bool, False, "continue from OUTPUT/restart.npz when there is one, else start; steps is then the "
                            "run's total, so the same command, run again after a crash, finishes the run"),
    "restart_from": (str, None, "continue from a restart.npz (structure, velocities and step come from it) for "
                                "steps more steps; in its own directory the outputs continue, elsewhere they start"),
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
         "memory_budget_gb": "> 0"}


def schema() -> dict:
    """mlip-md's configuration keys: the model section (from the model families), then ``SECTIONS``."""
    model = model_schema()
    types, default, text = model["checkpoint"]
    model["checkpoint"] = (types, default, f"{text}; with no model given, {DEFAULT_MODEL}")
    return {"model": model, **SECTIONS}


def rules() -> dict:
    return {**model_rules(), **RULES}


def validate(config) -> dict:
    """Fill defaults and check every key and type; raise ConfigError naming the key."""
    return config_validate(config, schema(), rules())


def schema_help() -> str:
    return config_help(schema())


DEFAULT_MODEL = "cu-emt"  # a potentials checkpoint: the bundled PaiNN for Cu


def build_model(section):
    """The model the validated model ``section`` names (the bundled cu-emt where it names none); potentials
    checkpoints run in float64 unless ``model.dtype`` says otherwise."""
    name = chosen_family(section)
    if name is None:
        name, section = "checkpoint", dict(section, checkpoint=DEFAULT_MODEL)
    return load_section_model(section, name, checkpoint_dtype="float64")


def build_integrator(config):
    from .integrators import MTK, Bussi, Langevin, NoseHoover, VelocityVerlet

    dt, t, b, ensemble = config["timestep_fs"], config["thermostat"], config["barostat"], config["ensemble"]
    if ensemble != "nve" and t["temperature_K"] <= 0:
        raise ConfigError(f"thermostat.temperature_K must be > 0 for ensemble {ensemble}, got {t['temperature_K']}")
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
    import numpy as np
    from ase.build import bulk
    from ase.io import read
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.parallel import DummyMPI

    from potentials.errors import InvalidStructureError
    from potentials.graph import check_min_distance, check_positions, complete_cell

    section = config["structure"]
    if section["file"] is not None:
        try:
            atoms = read(section["file"])
        except Exception as exc:  # ASE raises many types for unreadable files
            raise ConfigError(f"structure.file: cannot read {section['file']!r}: {exc}") from None
    else:
        repeat = section["repeat"]
        if len(repeat) != 3 or not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in repeat):
            raise ConfigError(f"structure.repeat must be three positive integers, got {repeat}")
        try:
            cell = bulk(section["element"], section["crystal"], a=section["a"], cubic=True)
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"structure: cannot build {section['element']} {section['crystal']}: {exc}") from None
        check_structure_fits(len(cell) * math.prod(repeat))
        atoms = cell.repeat(repeat)
    where = section["file"] or "the built structure"
    try:
        positions, cell = check_positions(atoms.positions), complete_cell(atoms.cell[:], atoms.pbc)
    except InvalidStructureError as exc:
        raise ConfigError(f"structure: {where}: {exc}") from None
    try:
        check_min_distance(positions, cell, atoms.pbc, section["min_distance"])
    except InvalidStructureError as exc:
        raise ConfigError(f"structure: {where}: {exc}; structure.min_distance sets the limit") from None
    if config["temperature_K"] > 0:
        thermalize_momenta(atoms, temperature_K=config["temperature_K"], rng=np.random.default_rng(config["seed"]),
                           comm=DummyMPI())  # every rank draws the same velocities
    return atoms


HOST_BYTES_PER_ATOM = 2_000  # the start structure every rank holds (ASE's arrays, velocities, the copies made)


def check_structure_fits(n_atoms: int) -> None:
    """ConfigError when every rank of this node holding a start structure of ``n_atoms`` atoms would
    take more than the node's memory (before it is built: ``structure.repeat`` can ask for billions)."""
    from mlip_parallel.launch import ranks_on_node

    try:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return
    need = n_atoms * HOST_BYTES_PER_ATOM * ranks_on_node()
    if need > total:
        raise ConfigError(f"structure.repeat: {n_atoms:,} atoms; every rank builds the start structure, "
                          f"{need / 1e9:.3g} GB on this node, more than its {total / 1e9:.3g} GB")


def check_species(model, numbers, section) -> None:
    """ConfigError naming the structure's elements that ``model`` was not built for (and the ones it
    knows); nothing to check for element-agnostic models (species None)."""
    from potentials import UnknownSpeciesError

    try:
        model.species_index(numbers)
    except UnknownSpeciesError as exc:
        name = chosen_family(section)
        named = f"{DEFAULT_MODEL}, the default" if name is None else section[name]
        keys = [f"model.{f.name}" for f in model_families()]
        raise ConfigError(f"structure: {exc} (model: {named}); set {', '.join(keys[:-1])} or {keys[-1]} for these "
                          f"elements") from None


def read_restart(path, key: str = "restart_from") -> dict:
    """{"numbers", "step", "outputs"} of the restart file ``path`` ("outputs": what the run's output files
    held when it was written, ``md.outputs.RunFiles.record``; None in a restart written without it)."""
    import json

    import numpy as np

    try:
        with np.load(path) as data:
            outputs = json.loads(str(data["outputs"])) if "outputs" in data else None
            return {"numbers": data["numbers"], "step": int(data["step"]), "outputs": outputs}
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot read {str(path)!r}: {exc}") from None


def continued_restart(config):
    """(path, key) of the restart this run continues from, or (None, None): ``restart_from``, or with
    ``resume`` OUTPUT/restart.npz where it exists."""
    if config["resume"] and config["restart_from"] is not None:
        raise ConfigError("resume continues OUTPUT/restart.npz and restart_from another restart file: give one")
    if config["restart_from"] is not None:
        return Path(config["restart_from"]), "restart_from"
    path = Path(config["output"]["directory"]) / "restart.npz"
    return (path, "resume") if config["resume"] and path.is_file() else (None, None)


def prepare(config) -> dict:
    """Everything that can fail on the validated ``config``, before anything is printed or written and
    before MPI starts (every rank alike): the output directory, the restart and the output files it
    continues, the integrator, the structure, the model and the structure's elements. Returns {"model",
    "integrator", "atoms" (None when continuing a restart), "restart" (its path or None), "steps" (the
    last step), "continues" (the outputs of the restart's run to cut back and append to, or None)}."""
    from .outputs import check_recorded

    out = config["output"]
    restart, key = continued_restart(config)
    directory = Path(out["directory"])
    in_place = restart is not None and restart.resolve().parent == directory.resolve()
    if not in_place and not config["resume"]:  # resume with no restart yet: a killed first attempt's files
        check_output_directory(directory, out["overwrite"])
    integrator = build_integrator(config)
    continues, steps = None, config["steps"]
    if restart is not None:
        saved = read_restart(restart, key)
        atoms, numbers = None, saved["numbers"]
        if config["resume"] and saved["step"] > steps:
            raise ConfigError(f"resume: {restart} is at step {saved['step']}, beyond steps ({steps}, the run's "
                              f"total under resume)")
        steps = steps if config["resume"] else saved["step"] + steps
        if in_place:
            continues = saved["outputs"] or {}
            check_recorded(directory, continues, restart)
    else:
        atoms = build_atoms(config)
        numbers = atoms.numbers
        if config["ensemble"] == "npt" and not atoms.pbc.all():
            raise ConfigError(f"ensemble npt needs a fully periodic structure, got pbc={atoms.pbc.tolist()}")
    if config["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device: cuda, but torch sees no CUDA device (use auto or cpu)")
    model = build_model(config["model"])
    check_species(model, numbers, config["model"])
    return {"model": model, "integrator": integrator, "atoms": atoms, "restart": restart, "steps": steps,
            "continues": continues}


THERMO_COLUMNS = ("step", "time_fs", "temperature_K", "epot_eV", "ekin_eV", "etot_eV", "pressure_GPa",
                  "volume_A3", "seconds_per_step", "force_s", "halo_s", "neighbour_s", "integrate_s", "output_s")
SCREEN_COLUMNS = THERMO_COLUMNS[:9]  # the phase times go to thermo.csv and the end-of-run table
SAMPLES = 10_000  # at most this many thermo samples (every max(1, steps // SAMPLES) steps) feed the summary


def simulate(config) -> list:
    """Run the validated ``config``; return the thermo rows (every rank). An output file that cannot be
    written raises OutputError on rank 0, naming the file, the reason and the last restart written."""
    start = prepare(config)
    import numpy as np
    from ase import Atoms, units
    from ase.calculators.singlepoint import SinglePointCalculator

    import torch

    from mlip_parallel import get_backend
    from mlip_parallel.backend import rank_device, set_threads
    from potentials.files import atomic_write, naming_errors
    from potentials.predict import voigt_stress

    from .engine import PHASES, MDSystem, run
    from .outputs import RunFiles, cut_back, write_extxyz

    backend = get_backend()
    threads = set_threads(backend)
    model, integrator, restart = start["model"], start["integrator"], start["restart"]
    model.to(torch.device("cpu") if config["device"] == "cpu" else rank_device(backend))  # atoms follow it
    options = dict(skin=config["skin"], mode=config["mode"], memory_budget_gb=config["memory_budget_gb"])

    def from_restart(path):
        return MDSystem.from_restart(model, path, integrator=integrator, **options)

    # From here on every rank takes part in collectives. The memory pre-flight (before the first ghosts) and
    # the first force call decide alike on every rank, before anything is written; after them an error
    # raised alike everywhere (SimulationError) ends the run with one line, any other through the abort hook.
    try:
        if restart is not None:
            system, first_step = from_restart(restart)
        else:
            system, first_step = MDSystem.from_atoms(model, start["atoms"], balance=config["balance_every"] > 0,
                                                     **options), 0
        system.compute_forces()
    except MemoryLimitError as exc:
        raise ConfigError(str(exc)) from None
    except SimulationError as exc:
        raise SimulationError(f"step {first_step if restart is not None else 0}: {exc}") from None
    out = config["output"]
    directory = Path(out["directory"])
    restart_path = directory / "restart.npz"
    every, traj_every, restart_every = max(1, out["thermo_every"]), out["trajectory_every"], out["restart_every"]
    steps = start["steps"]
    stride = max(1, (steps - first_step) // SAMPLES)
    continuing = start["continues"] is not None  # cut back to the restart, then append
    unrecorded = start["continues"] == {}
    last_restart = f"{restart} (step {first_step})" if continuing else "none yet"
    root = backend.rank == 0
    try:
        if root:
            with naming_errors(directory):
                directory.mkdir(parents=True, exist_ok=True)
            if continuing:
                cut_back(directory, start["continues"])
            files = RunFiles(directory, THERMO_COLUMNS, f"trajectory.{out['trajectory_format']}" if traj_every
                             else None, fresh=not continuing)
            via = f" ({backend.library.split(' (')[0]})" if backend.size > 1 else ""
            print(f"mlip-md: {system.n_atoms} atoms on {backend.size} rank(s){via} x {threads} thread(s), "
                  f"{system.device}, {config['ensemble']}, steps {first_step} to {steps} of {config['timestep_fs']} fs")
            print(" ".join(f"{c:>14s}" for c in SCREEN_COLUMNS), flush=True)
            from mlip_parallel.progress import Progress
            bar = Progress("mlip-md", steps, first_step, "step", None if out["progress"] else "off")

        def snapshot(step):  # collective: gathers in global id order; the frame on rank 0 (None elsewhere)
            positions, numbers, velocities, forces = (system.gather(k) for k in
                                                      ("positions", "numbers", "velocities", "forces"))
            if not root:
                return None
            frame = Atoms(numbers=numbers, positions=positions, cell=system.cell, pbc=system.pbc)
            frame.set_velocities(velocities)
            frame.info.update(step=step, time_fs=step * integrator.dt / units.fs)
            results = {"energy": system.energy, "forces": forces}
            if frame.cell.rank == 3:
                results["stress"] = voigt_stress(system.virial, frame.cell.volume)
            frame.calc = SinglePointCalculator(frame, **results)
            return frame

        rows, step = [], first_step
        stops = {steps} | {s for n in (every, traj_every, restart_every) if n for s in range(0, steps + 1, n)}
        samples = [system.thermo(first_step, integrator.dt)]  # for the summary: every `stride` steps
        start_time = time.perf_counter()
        last_timers, last_step = dict(system.timers), step
        for target in sorted(s for s in stops if s >= first_step):
            if target > step:
                t0 = time.perf_counter()
                chunk = run(system, integrator, target - step, thermo_every=stride, start_step=step,
                            balance_every=config["balance_every"])[1:]
                per_step = (time.perf_counter() - t0) / (target - step)
                samples += chunk
                step = target
                state = chunk[-1] if chunk and chunk[-1]["step"] == step else system.thermo(step, integrator.dt)
            else:
                state, per_step = system.thermo(step, integrator.dt), 0.0
            output_start = time.perf_counter()
            restart_due = step == steps or (restart_every and step % restart_every == 0)
            if restart_due and not (continuing and step == first_step):  # not again the one continued from
                # the restart holds the state at `step` and the files up to the step before; the run goes on
                # from the file, as a requeued job does, so that the two are bit-identical from here on
                system.save_restart(restart_path, step, integrator, outputs=files.record() if root else None)
                last_restart = f"{restart_path} (step {step})"
                timers, rebuilds = system.timers, system.rebuilds
                del system
                system, _ = from_restart(restart_path)
                system.timers, system.rebuilds = timers, rebuilds + system.rebuilds
                system.compute_forces()
                state = system.thermo(step, integrator.dt)
            # a restart written without a record of the outputs holds its own step's row and frame already
            written = unrecorded and step == first_step
            if (step % every == 0 or step == steps) and not written:
                span = max(1, step - last_step)  # seconds per step in each phase since the last row (rank 0's)
                row = dict(state, seconds_per_step=per_step,
                           **{f"{phase}_s": (system.timers[phase] - last_timers[phase]) / span for phase in PHASES})
                last_timers, last_step = dict(system.timers), step
                rows.append(row)
                if root:
                    files.row(row)
                    bar.clear()
                    print(" ".join(f"{row[c]:14.6g}" for c in SCREEN_COLUMNS), flush=True)
            if traj_every and step % traj_every == 0 and not written:
                frame = snapshot(step)
                if root:
                    files.frame(frame)
            if root:
                bar.update(step)
            system.timers["output"] += time.perf_counter() - output_start
        final = snapshot(steps)
        if root:
            with atomic_write(directory / "final.extxyz", "w") as f:
                write_extxyz(f, final)
            files.close()
            elapsed = time.perf_counter() - start_time
            close_bar(bar)
            plot_thermo(directory)
    except OutputError as exc:
        raise OutputError(f"{exc}; last restart written: {last_restart}") from None
    except SimulationError as exc:  # alike on every rank: thermo.csv and the trajectory end at the last row
        raise SimulationError(f"{exc}; last restart written: {last_restart}") from None
    phases = np.array([system.timers[phase] for phase in PHASES])
    slowest, mean = backend.allreduce(phases, op="max"), backend.allreduce(phases) / backend.size
    if root:
        print(f"mlip-md: done in {elapsed:.1f} s ({1e3 * elapsed / max(1, steps - first_step):.3g} ms/step), "
              f"{system.rebuilds} neighbour-list rebuilds; output in {directory}/")
        print(summary(samples, system.n_atoms, config["ensemble"]), flush=True)
        print(phase_table(mean, slowest), flush=True)
    return rows


def phase_table(mean, slowest) -> str:
    """Where the time went, as LAMMPS prints it after a run: seconds per phase (mean and slowest rank)
    and the share of the total."""
    from .engine import PHASES

    total = max(float(sum(mean)), 1e-300)
    lines = [f"{'phase':10s} {'mean s':>10s} {'max s':>10s} {'% of time':>10s}"]
    for phase, m, s in zip(PHASES, mean, slowest):
        lines.append(f"{phase:10s} {m:10.3f} {s:10.3f} {100 * m / total:10.1f}")
    return "\n".join(lines)


def close_bar(bar) -> None:
    """Close the progress bar (stderr) before the last lines go to stdout. Under mpiexec the two streams
    reach the terminal through separate pipes, in no fixed order: give the bar's last line a moment to
    arrive first, or the next line runs into it."""
    from mlip_parallel.backend import launched_by_mpiexec

    bar.close()
    sys.stderr.flush()
    if launched_by_mpiexec():
        time.sleep(0.2)


def block_average(values, blocks: int = 10) -> tuple:
    """(mean, standard error of the mean from ``blocks`` consecutive block means; nan below 2 blocks)."""
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    blocks = min(blocks, len(values))
    if blocks < 2:
        return float(values.mean()) if len(values) else float("nan"), float("nan")
    size = len(values) // blocks
    means = values[len(values) - blocks * size:].reshape(blocks, size).mean(axis=1)
    return float(values.mean()), float(means.std(ddof=1) / np.sqrt(blocks))


def summary(samples: list, n_atoms: int, ensemble: str) -> str:
    """Means ± block standard errors of T, P and the energies per atom (and V under npt) over the second
    half of the run; for nve, the drift of the total energy (least-squares slope over the whole run)."""
    import numpy as np

    first, last = samples[0]["step"], samples[-1]["step"]
    half = [s for s in samples if 2 * (s["step"] - first) >= last - first]
    quantities = [("temperature_K", "temperature_K", 1.0), ("pressure_GPa", "pressure_GPa", 1.0),
                  ("epot_eV/atom", "epot_eV", 1.0 / n_atoms), ("etot_eV/atom", "etot_eV", 1.0 / n_atoms)]
    if ensemble == "npt":
        quantities.append(("volume_A3", "volume_A3", 1.0))
    lines = [f"mlip-md: steps {half[0]['step']} to {last} (second half, {len(half)} samples), "
             f"mean ± standard error of 10 block means:"]
    for label, key, scale in quantities:
        mean, error = block_average([s[key] * scale for s in half])
        lines.append(f"  {label:14s} {mean:14.7g} ± {error:.2g}")
    if ensemble == "nve" and len(samples) > 1:
        t_ns = np.array([s["time_fs"] for s in samples]) * 1e-6
        drift = np.polyfit(t_ns, np.array([s["etot_eV"] for s in samples]) / n_atoms, 1)[0]
        lines.append(f"  energy drift   {drift:14.3g} eV/atom/ns (slope of etot over steps {first} to {last})")
    return "\n".join(lines)


def plot_thermo(directory: Path) -> None:
    """OUTPUT/thermo.png: temperature, energies per atom and pressure against time, from thermo.csv."""
    from matplotlib.figure import Figure  # renders PNG with Agg, without pyplot's global state

    with open(directory / "thermo.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    t_ps = [float(r["time_fs"]) / 1000 for r in rows]
    fig = Figure(figsize=(6, 7), layout="constrained")
    temperature, energy, pressure = fig.subplots(3, 1, sharex=True)
    temperature.plot(t_ps, [float(r["temperature_K"]) for r in rows])
    temperature.set_ylabel("T (K)")
    for key in ("epot_eV", "etot_eV"):
        energy.plot(t_ps, [float(r[key]) for r in rows], label=key.split("_")[0])
    energy.set_ylabel("E (eV)")
    energy.legend()
    pressure.plot(t_ps, [float(r["pressure_GPa"]) for r in rows])
    pressure.set_ylabel("P (GPa)")
    pressure.set_xlabel("time (ps)")
    from potentials.files import atomic_write

    with atomic_write(directory / "thermo.png") as f:
        fig.savefig(f, format="png", dpi=100)


def main(argv=None) -> int:
    try:
        keys = schema()
    except FamilyError as exc:  # an installed package's model family that cannot be registered
        report_error("mlip-md", exc)
        return 2
    args = config_parser("mlip-md", __doc__.splitlines()[0], keys).parse_args(argv)
    try:
        simulate(read_job(args, keys, rules()))
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
