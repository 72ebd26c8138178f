"""What an ``mlip-md`` run starts from, checked on every rank before anything is written or any collective runs:
the model its config names (through the model families), the integrator, the structure (a file or a built
crystal: finite positions, a real cell, no two atoms too close, a size every rank can hold) or the restart it
continues, and the structure's elements against the model's (``prepare``: all of it)."""
from __future__ import annotations

import math
from pathlib import Path

from mlip_parallel.config import ConfigError, check_output_directory
from mlip_parallel.launch import ranks_on_node
from mlip_parallel.model_section import chosen_family, load_section_committee, load_section_model, model_families
from potentials import UnknownSpeciesError
from potentials.errors import InvalidStructureError

from .outputs import check_recorded

DEFAULT_MODEL = "cu-emt"  # a potentials checkpoint: the bundled PaiNN for Cu


def build_model(section):
    """The model the validated model ``section`` names (the bundled cu-emt where it names none; a
    ``potentials.Committee`` for ``model.committee``); potentials checkpoints run in float64 unless
    ``model.dtype`` says otherwise."""
    if section.get("committee") is not None:
        return load_section_committee(section, checkpoint_dtype="float64")
    name = chosen_family(section)
    if name is None:
        name, section = "checkpoint", dict(section, checkpoint=DEFAULT_MODEL)
    return load_section_model(section, name, checkpoint_dtype="float64")


def build_integrator(config):
    from .integrators import MTK, Bussi, Langevin, NoseHoover, VelocityVerlet  # (torch: at first use)

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
    from ase.build import bulk
    from ase.io import read

    from potentials.graph import check_min_distance, check_positions, complete_cell  # (torch: at first use)

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
        thermalize(atoms, config["temperature_K"], config["seed"])
    return atoms


def thermalize(atoms, temperature_K: float, seed: int) -> None:
    """Maxwell-Boltzmann velocities at ``temperature_K`` drawn from ``seed`` (ASE's ``thermalize_momenta``), the same
    on every rank: an mlip-md start, and a batch's MD start (md.batch)."""
    import numpy as np
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.parallel import DummyMPI

    thermalize_momenta(atoms, temperature_K=temperature_K, rng=np.random.default_rng(seed), comm=DummyMPI())


HOST_BYTES_PER_ATOM = 2_000  # the start structure every rank holds (ASE's arrays, velocities, the copies made)


def check_structure_fits(n_atoms: int) -> None:
    """ConfigError when every rank of this node holding a start structure of ``n_atoms`` atoms would
    take more than the node's memory (before it is built: ``structure.repeat`` can ask for billions)."""
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
    try:
        model.species_index(numbers)
    except UnknownSpeciesError as exc:
        name = None if section.get("committee") is not None else chosen_family(section)
        named = "the committee" if section.get("committee") is not None else \
            f"{DEFAULT_MODEL}, the default" if name is None else section[name]
        keys = [f"model.{f.name}" for f in model_families()]
        raise ConfigError(f"structure: {exc} (model: {named}); set {', '.join(keys[:-1])} or {keys[-1]} for these "
                          f"elements") from None


def check_uncertainty(section, model) -> None:
    """ConfigError for an uncertainty section that does not fit: set without a committee (the deviation is the
    committee members'), or a select range that is not [low, high] with 0 <= low <= high."""
    from potentials.committee import Committee  # (torch: at first use)

    given = [k for k in ("select", "stop_above") if section[k] is not None] + (["every"] if section["every"] else [])
    if given and not isinstance(model, Committee):
        raise ConfigError(f"uncertainty.{given[0]} reads a committee's model deviation: name its members with "
                          f"model.committee: [{{checkpoint: a.pt}}, {{checkpoint: b.pt}}, ...]")
    select = section["select"]
    if select is not None:
        numbers = len(select) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           and math.isfinite(v) and v >= 0 for v in select)
        if not numbers or select[0] > select[1]:
            raise ConfigError(f"uncertainty.select must be [low, high] eV/Å with 0 <= low <= high, got {select}")


def read_restart(path, key: str = "restart_from") -> dict:
    """{"numbers", "step", "outputs"} of the restart file ``path`` ("outputs": what the run's output files
    held when it was written, ``md.outputs.RunFiles.record``; None in a restart written without it). Every array
    is read once here (each checked against its checksum), so that a damaged or cut-short file is one ConfigError
    before the run starts, not an error on some rank later."""
    import json
    import zipfile

    import numpy as np

    from .engine import PER_ATOM  # (torch: at first use)

    try:
        with np.load(path) as data:
            arrays = {name: data[name] for name in data.files}
    except FileNotFoundError as exc:
        raise ConfigError(f"{key}: cannot read {str(path)!r}: {exc.strerror}") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # numpy and zipfile raise these for damage
        reason = (str(exc).split(". ")[0] or type(exc).__name__).rstrip(".")
        raise ConfigError(f"{key}: {str(path)!r} is not a whole restart file ({type(exc).__name__}: {reason}): "
                          "damaged, cut short, or not an mlip-md restart.npz") from None
    missing = [name for name in ("step", "cell", "pbc", *PER_ATOM) if name not in arrays]
    if missing:
        raise ConfigError(f"{key}: {str(path)!r} is not a restart file of mlip-md: it lacks {', '.join(missing)}")
    try:
        outputs = json.loads(str(arrays["outputs"])) if "outputs" in arrays else None
    except ValueError:
        raise ConfigError(f"{key}: {str(path)!r}: its record of the outputs is damaged") from None
    return {"numbers": arrays["numbers"], "step": int(arrays["step"]), "outputs": outputs}


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
    check_uncertainty(config["uncertainty"], model)
    return {"model": model, "integrator": integrator, "atoms": atoms, "restart": restart, "steps": steps,
            "continues": continues}
