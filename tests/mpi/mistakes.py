"""A user's inputs, many in one launch (run under mpiexec -n P): ``mistakes.py TOOL SCRATCH [accepted]`` with TOOL
mlip-md, mlip-train or mlip-lammps calls the tool's ``main`` once per case of the tool's table, each in its own
empty directory under SCRATCH, under an address-space limit (``LIMIT_GB`` per process: an input that tries to
allocate what the machine does not have fails here with MemoryError instead of exhausting the machine).

The mistakes (the default): each case must end with exit status 2 on every rank, exactly one line on rank 0's
stderr containing every expected word (and nothing on stdout, nothing from the other ranks) and an empty
directory: nothing written. ``accepted``: good inputs at their legal limits; each case must end with exit status 0
on every rank, no error line, and the files it names written. Prints "OK case" or "FAIL case: why" per case, then
"mistakes: N of M" (or "accepted: N of M") on rank 0; exits 1 when any case failed.
"""
import contextlib
import importlib.util
import io
import os
import resource
import sys

LIMIT_GB = int(os.environ.get("LIMIT_GB", 5))
resource.setrlimit(resource.RLIMIT_AS, (LIMIT_GB * 2**30, resource.RLIM_INFINITY))

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from ase.build import bulk  # noqa: E402
from ase.calculators.emt import EMT  # noqa: E402
from ase.calculators.singlepoint import SinglePointCalculator  # noqa: E402
from ase.io import write  # noqa: E402
from mpi4py import MPI  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
tool, scratch = sys.argv[1], os.path.abspath(sys.argv[2])
accepted = sys.argv[3:] == ["accepted"]
ARGON = {"lennard_jones": {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 8.5}}


def skipped(case: str, module: str) -> None:
    """Say (rank 0) that ``case`` is left out for want of ``module``: the pytest side skips or fails on it."""
    if world.rank == 0:
        print(f"skipped: {case} (needs {module})", flush=True)


def structures(name, change=None, count=1):
    """A structure file (extxyz) in SCRATCH of ``count`` rattled Cu cells labelled by ASE's EMT, after
    ``change(atoms, k)`` where given; written by rank 0."""
    path = os.path.join(scratch, name)
    if world.rank == 0:
        frames = []
        for k in range(count):
            atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
            atoms.rattle(0.05, seed=k)
            atoms.calc = EMT()
            energy, forces, stress = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
            atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces, stress=stress)
            if change is not None:
                change(atoms, k)
            frames.append(atoms)
        write(path, frames, format="extxyz", parallel=False)  # (ASE would broadcast: rank 0 alone writes)
    world.Barrier()
    return path


def moved(index, position):
    def change(atoms, k):
        atoms.positions[index] = position
    return change


def nan_label(quantity, structure):
    def change(atoms, k):
        if k == structure:
            results = atoms.calc.results
            if quantity == "energy":
                results["energy"] = float("nan")
            else:
                results[quantity] = results[quantity].copy()
                results[quantity].flat[4] = float("inf" if quantity == "stress" else "nan")
    return change


def md_cases():
    nan_file = structures("nan_position.extxyz", moved(5, [1.0, float("nan"), 2.0]))
    close_file = structures("close_pair.extxyz", moved(9, [0.2, 0.1, 0.0]))  # 0.22 Å from atom 0
    flat = structures("flat_cell.extxyz", lambda atoms, k: atoms.set_cell([[7.22, 0, 0], [0, 7.22, 0], [0, 0, 0]]))
    cases = [
        ("nan time step", {"timestep_fs": float("nan")}, ["timestep_fs", "nan"]),
        ("infinite time step", {"timestep_fs": float("inf")}, ["timestep_fs", "inf"]),
        ("negative time step", {"timestep_fs": -1}, ["timestep_fs", "> 0"]),
        ("negative steps", {"steps": -5}, ["steps", ">= 0", "-5"]),
        ("nan temperature", {"temperature_K": float("nan")}, ["temperature_K", "nan"]),
        ("infinite thermostat temperature", {"ensemble": "langevin", "thermostat": {"temperature_K": float("inf")}},
         ["thermostat.temperature_K", "inf"]),
        ("negative friction", {"ensemble": "langevin", "thermostat": {"friction_per_fs": -0.1}},
         ["thermostat.friction_per_fs", "-0.1"]),
        ("zero bussi tau", {"ensemble": "bussi", "thermostat": {"tau_fs": 0}}, ["thermostat.tau_fs", "> 0"]),
        ("nan barostat damping", {"ensemble": "npt", "barostat": {"pdamp_fs": float("nan")}}, ["barostat.pdamp_fs"]),
        ("infinite pressure", {"ensemble": "npt", "barostat": {"pressure_GPa": float("-inf")}},
         ["barostat.pressure_GPa", "-inf"]),
        ("nan skin", {"skin": float("nan")}, ["skin", "nan"]),
        ("zero memory budget", {"memory_budget_gb": 0}, ["memory_budget_gb", "> 0"]),
        ("infinite memory budget", {"memory_budget_gb": float("inf")}, ["memory_budget_gb", "inf"]),
        ("negative seed", {"seed": -1}, ["seed", "-1"]),
        ("fractional seed", {"seed": 1.5}, ["seed", "int", "1.5"]),
        ("negative thermo interval", {"output": {"thermo_every": -10}}, ["output.thermo_every", "-10"]),
        ("string time step", {"timestep_fs": "2fs"}, ["timestep_fs", "float", "2fs"]),
        ("zero lattice constant", {"structure": {"a": 0}}, ["structure.a", "> 0"]),
        ("nan lattice constant", {"structure": {"a": float("nan")}}, ["structure.a", "nan"]),
        ("zero repeat", {"structure": {"repeat": [10, 0, 10]}}, ["structure.repeat", "positive integers"]),
        ("two repeats", {"structure": {"repeat": [10, 10]}}, ["structure.repeat", "three"]),
        ("negative min distance", {"structure": {"min_distance": -1}}, ["structure.min_distance", "-1"]),
        ("a billion atoms", {"structure": {"repeat": [1000, 1000, 1000]}}, ["structure.repeat", "4,000,000,000",
                                                                             "GB"]),
        ("atoms on top of each other", {"structure": {"a": 0.5}}, ["atoms 0 and 1", "0.354 Å", "min_distance"]),
        ("dense beyond memory", {"structure": {"a": 0.5, "min_distance": 0}}, ["not enough memory", "more ranks",
                                                                               "atoms/Å³"]),
        ("cutoff far beyond the cell", {"model": {"lennard_jones": {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 100}},
                                        "structure": {"element": "Ar", "a": 5.26, "repeat": [3, 3, 3]}},
         ["not enough memory", "101 Å", "smaller cutoff"]),
        ("negative LJ cutoff", {"model": {"lennard_jones": {"epsilon": 0.0104, "sigma": 3.4, "cutoff": -1}}},
         ["model.lennard_jones", "cutoff", "-1"]),
        ("nan LJ sigma", {"model": {"lennard_jones": {"epsilon": 0.0104, "sigma": float("nan"), "cutoff": 8}}},
         ["model.lennard_jones", "sigma", "nan"]),
        ("unknown LJ key", {"model": {"lennard_jones": {"epsilon": 1, "sigma": 1, "rcut": 3}}},
         ["model.lennard_jones", "rcut"]),
        ("nan position in file", {"structure": {"file": nan_file}}, ["non-finite", "5"]),
        ("close pair in file", {"structure": {"file": close_file}}, ["atoms 0 and 9", "Å apart", "close_pair", "min_distance"]),
        ("zero periodic cell vector", {"structure": {"file": flat}}, ["zero-volume", "periodic"]),
        ("unknown element", {"structure": {"element": "Fe", "crystal": "bcc", "a": 2.87}}, ["Fe", "Cu"]),
        ("non-periodic npt", {"ensemble": "npt", "structure": {"file": structures(
            "cluster.extxyz", lambda atoms, k: atoms.set_pbc(False))}}, ["npt", "periodic"]),
        *committee_cases(),
        *damaged_file_cases(),
    ]
    for label, config, words, *placed in cases:  # (no model: the default cu-emt; no structure: the default Cu crystal)
        config.setdefault("steps", 5)
        config.setdefault("output", {})["directory"] = "out"
        yield label, config, words, *placed


def cut_short(data: bytes) -> bytes:
    return data[: len(data) // 2]


def flipped(data: bytes, at: float = 0.5) -> bytes:
    """``data`` with the bits of one byte at the fraction ``at`` of its length inverted."""
    k = int(len(data) * at)
    return data[:k] + bytes([data[k] ^ 0xFF]) + data[k + 1:]


def scratch_file(name, write) -> str:
    """A file in SCRATCH written by ``write(path)`` on rank 0."""
    path = os.path.join(scratch, name)
    if world.rank == 0:
        write(path)
    world.Barrier()
    return path


def damaged_file_cases():
    """mlip-md given a model file cut short (SevenNet's .pth, fairchem's .pt; each where its package is installed)
    and a damaged restart.npz to resume from: (label, config, words[, placed files])."""
    import shutil

    from systems import FAIRCHEM_DIR, write_small_sevennet

    cases = []
    if importlib.util.find_spec("sevenn") is not None:
        def cut_sevennet(path):
            write_small_sevennet(path)
            with open(path, "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(cut_short(data))
        path = scratch_file("cut_sevennet.pth", cut_sevennet)
        cases.append(("a SevenNet checkpoint cut short", {"model": {"sevennet": path}},
                      ["model.sevennet", "cut_sevennet.pth", "is the file whole"]))
    else:
        skipped("a SevenNet checkpoint cut short", "sevenn")
    if importlib.util.find_spec("fairchem") is not None:
        def cut_fairchem(path):
            shutil.copy(FAIRCHEM_DIR / "esen.pt", path)
            with open(path, "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(cut_short(data))
        path = scratch_file("cut_esen.pt", cut_fairchem)
        cases.append(("a fairchem checkpoint cut short", {"model": {"fairchem": path, "task": "omat"}},
                      ["model.fairchem", "cut_esen.pt", "cannot read"]))
    else:
        skipped("a fairchem checkpoint cut short", "fairchem")
    buffer = io.BytesIO()  # a restart of the default Cu crystal's shape, then damaged
    np.savez(buffer, step=3, cell=np.eye(3) * 7.22, pbc=np.ones(3, bool), positions=np.zeros((32, 3)),
             velocities=np.zeros((32, 3)), masses=np.full(32, 63.5), numbers=np.full(32, 29), ids=np.arange(32),
             image=np.zeros((32, 3), int), outputs=np.array("{}"))
    restart = buffer.getvalue()
    for what, damaged in (("cut short", cut_short(restart)), ("with a flipped byte", flipped(restart, 0.3))):
        cases.append((f"a restart.npz {what} to resume", {"resume": True, "steps": 10},
                      ["resume", "out/restart.npz", "not a whole restart file"], {"out/restart.npz": damaged}))
    return cases


def committee_cases():
    """mlip-md's committee and uncertainty mistakes: (label, config, words)."""
    import potentials

    argon_model = os.path.join(scratch, "argon_schnet.pt")
    if world.rank == 0:
        torch.manual_seed(0)
        potentials.save(potentials.SchNet(["Ar"], cutoff=4.0, features=8, layers=2), argon_model)
    world.Barrier()
    two = {"committee": [{"checkpoint": "cu-emt"}, {"checkpoint": "cu-emt", "dtype": "float32"}]}
    argon = {"element": "Ar", "a": 5.26, "repeat": [3, 3, 3]}
    return [
        ("empty committee", {"model": {"committee": []}}, ["model.committee", "empty"]),
        ("committee member with other elements", {"model": {"committee": [ARGON, {"checkpoint": "cu-emt"}]},
                                                  "structure": argon}, ["committee member 2", "Ar", "Cu"]),
        ("committee members share no element", {"model": {"committee": [{"checkpoint": "cu-emt"},
                                                                         {"checkpoint": argon_model}]}},
         ["model.committee", "share no element", "Ar"]),
        ("committee member names no model", {"model": {"committee": [{"checkpoint": "cu-emt"}, {"dtype": "float32"}]}},
         ["model.committee[2]", "names no model"]),
        ("committee member not a section", {"model": {"committee": ["cu-emt"]}}, ["model.committee[1]", "cu-emt"]),
        ("committee member with a bad option", {"model": {"committee": [{"lennard_jones": {"epsilon": 0.0104,
                                                                                           "sigma": 3.4,
                                                                                           "cutoff": -1}}]},
                                                "structure": argon},
         ["model.committee[1].lennard_jones", "cutoff", "-1"]),
        ("a model beside the committee", {"model": {**two, "checkpoint": "cu-emt"}}, ["model.committee",
                                                                                      "model.checkpoint"]),
        ("unknown committee forces", {"model": {**two, "committee_forces": "median"}}, ["model.committee_forces",
                                                                                       "median"]),
        ("selection low above high", {"model": two, "uncertainty": {"select": [0.5, 0.1]}},
         ["uncertainty.select", "low <= high", "0.5"]),
        ("selection of one number", {"model": two, "uncertainty": {"select": [0.5]}}, ["uncertainty.select"]),
        ("negative deviation limit", {"model": two, "uncertainty": {"stop_above": -1}},
         ["uncertainty.stop_above", "> 0"]),
        ("uncertainty without a committee", {"uncertainty": {"select": [0.0, 1.0]}},
         ["uncertainty.select", "model.committee"]),
    ]


def train_cases():
    data = structures("labelled.extxyz", count=6)
    base = {"data": {"train": data, "validation_fraction": 0.34},
            "model": {"name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 8, "layers": 2}},
            "epochs": 1, "batch_size": 2}

    def job(**changes):
        config = {key: (dict(value) if isinstance(value, dict) else value) for key, value in base.items()}
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        return config

    labelled = [(quantity, structures(f"nan_{quantity}.extxyz", nan_label(quantity, 3), count=6))
                for quantity in ("energy", "forces", "stress")]
    cases = [
        ("zero epochs", job(epochs=0), ["epochs", ">= 1", "0"]),
        ("zero batch size", job(batch_size=0), ["batch_size", ">= 1"]),
        ("negative max_steps", job(max_steps=-1), ["max_steps", ">= 0", "-1"]),
        ("a warm-up under plateau", job(schedule={"name": "plateau", "warmup_steps": 5}),
         ["schedule.warmup_steps", "plateau", "cosine"]),
        ("nan learning rate", job(optimizer={"lr": float("nan")}), ["optimizer.lr", "nan"]),
        ("zero learning rate", job(optimizer={"lr": 0}), ["optimizer.lr", "> 0"]),
        ("infinite energy weight", job(loss={"energy_weight": float("inf")}), ["loss.energy_weight", "inf"]),
        ("negative forces weight", job(loss={"forces_weight": -1}), ["loss.forces_weight", "-1"]),
        ("a loss no trainer knows", job(loss={"type": "l1"}), ["loss.type", "mse", "huber", "l1"]),
        ("a learning-rate factor for no weight", job(optimizer={"lr_factors": {"nowhere.*": 2.0}}),
         ["optimizer.lr_factors", "'nowhere.*'", "parameter groups"]),
        ("a negative learning-rate factor", job(optimizer={"lr_factors": {"*": -1.0}}),
         ["optimizer.lr_factors.*", ">= 0", "-1.0"]),
        ("a Huber threshold of zero", job(loss={"type": "huber", "huber_delta": 0.0}), ["loss.huber_delta", "> 0"]),
        ("every weight zero", job(loss={"energy_weight": 0, "forces_weight": 0}), ["loss", "every weight is 0"]),
        ("a config_type weight that is text", job(loss={"config_type_weights": {"bulk": "high"}}),
         ["loss.config_type_weights.bulk", ">= 0", "'high'"]),
        ("stage two's keys without its start", job(stage_two={"forces_weight": 100.0}),
         ["stage_two", "start_epoch"]),
        ("stage two with every weight zero", job(stage_two={"start_epoch": 2, "energy_weight": 0.0,
                                                            "forces_weight": 0.0}),
         ["stage_two", "every weight is 0"]),
        ("a zero stage-two learning rate", job(stage_two={"start_epoch": 2, "lr": 0.0}), ["stage_two.lr", "> 0"]),
        ("a LoRA glob matching no weight", job(model={"lora": {"targets": ["nowhere.*"]}}),
         ["model.lora.targets", "'nowhere.*'", "parameter groups"]),
        ("LoRA on biases", job(model={"lora": {"targets": ["readout.*"]}}),
         ["model.lora.targets", "readout.0.bias", "not a linear layer's weight"]),
        ("a LoRA rank of zero", job(model={"lora": {"targets": ["readout.*.weight"], "rank": 0}}),
         ["model.lora.rank", ">= 1", "0"]),
        ("a LoRA glob matching no weight of any pipeline stage", job(model={"lora": {"targets": ["nowhere.*"]}},
                                                                      parallel="pipeline"),
         ["model.lora.targets", "'nowhere.*'", "parameter groups"]),
        ("LoRA leaving a pipeline stage nothing to train",
         job(model={"lora": {"targets": ["interactions.1.lin*.weight"]}}, parallel="pipeline"),
         ["model.lora.targets", "pipeline stage 0", "nothing to train"]),
        ("nan gradient clip", job(optimizer={"gradient_clip": float("nan")}), ["optimizer.gradient_clip", "nan"]),
        ("ema decay of one", job(ema_decay=1.0), ["ema_decay", "[0, 1)"]),
        ("plateau factor above one", job(schedule={"factor": 1.5}), ["schedule.factor", "(0, 1)"]),
        ("validation fraction one", job(data={"validation_fraction": 1.0}), ["data.validation_fraction", "1.0"]),
        ("nan test fraction", job(data={"test_fraction": float("nan")}), ["data.test_fraction", "nan"]),
        ("negative cutoff", job(model={"cutoff": -5.0}), ["model.cutoff", "> 0"]),
        ("nan cutoff", job(model={"cutoff": float("nan")}), ["model.cutoff", "nan"]),
        ("negative seed", job(seed=-3), ["seed", "-3"]),
        ("zero micro-batches", job(parallel="pipeline", pipeline={"microbatches": 0}), ["pipeline.microbatches"]),
        ("zero stages", job(parallel="pipeline", pipeline={"stages": 0}), ["pipeline.stages"]),
        ("bad hyper-parameter", job(model={"hyperparameters": {"feature": 8}}), ["model", "feature"]),
        *[(f"nan {quantity} label", job(data={"train": path}), [os.path.basename(path), "structure 3",
                                                               f"non-finite {quantity}"])
          for quantity, path in labelled],
        ("nan position in data", job(data={"train": structures("nan_pos_data.extxyz", moved(2, [np.nan, 0, 0]),
                                                               count=6)}), ["non-finite", "nan_pos_data", "structure 0"]),
        ("missing data", job(data={"train": "nowhere.extxyz"}), ["nowhere.extxyz"]),
        ("a label key that is no label", job(data={"keys": {"dipole": "q"}}),
         ["data.keys", "'dipole' is not a key it takes"]),
        ("a charge that is no whole number", job(data={"train": structures(
            "half_charge.extxyz", lambda atoms, k: atoms.info.update(charge=0.5 if k == 4 else 0), count=6)}),
         ["half_charge.extxyz", "structure 4", "charge 0.5", "whole number"]),
        ("a data list entry that is no path", job(data={"train": [data, 3]}), ["a data file is a path", "3"]),
        ("a sampled file without its share", job(data={"train": [data, {"file": data}]}),
         ["data.train[1]", "{file: PATH, share: S}"]),
        ("a share of one", job(data={"train": [data, {"file": data, "share": 1.0}]}),
         ["data.train[1]", "share", "(0, 1)"]),
        ("shares summing to one", job(data={"train": [data, {"file": data, "share": 0.5},
                                                       {"file": data, "share": 0.5}]}), ["data.train", "sum to 1"]),
        ("every file sampled", job(data={"train": [{"file": data, "share": 0.5}]}),
         ["data.train", "every file has a share"]),
        ("the forces under a name the file lacks", job(data={"keys": {"forces": "REF_forces"}, "stream": True}),
         ["labelled.extxyz", "structure", "no forces", "REF_forces"]),
        ("negative features", job(model={"hyperparameters": {"features": -4}}), ["model", "features"]),
        ("a model no machine holds", job(model={"hyperparameters": {"features": 100_000, "layers": 3}}),
         ["not enough memory", "SchNet", "weights", "hyperparameters"]),
        ("cutoff far beyond the cells", job(model={"cutoff": 100.0}), ["not enough memory", "100 Å", "batch_size"]),
        *[(label, job(data={"train": path}), words) for label, path, words in database_cases()],
    ]
    import potentials

    buffer = io.BytesIO()  # a last.pt of the job's model, then damaged: cut short, or one weight's byte flipped
    torch.save({"step": 3, "training": {"step": 3, "model": potentials.SchNet(["Cu"], cutoff=4.0, features=8, layers=2,
                                                                              seed=0).state_dict()}}, buffer)
    for what, damaged in (("cut short", cut_short(buffer.getvalue())), ("with a flipped byte",
                                                                         flipped(buffer.getvalue(), 0.6))):
        cases.append((f"a last.pt {what} to resume", job(resume=True),
                      ["resume", "out/last.pt", "not a whole checkpoint"], {"out/last.pt": damaged}))
    for label, config, words, *placed in cases:
        config["output"] = {"directory": "out"}
        yield label, config, words, *placed


@contextlib.contextmanager
def unlimited_address_space():
    """The address-space limit (``LIMIT_GB``) lifted inside, put back after."""
    limits = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)


def database_cases():
    """ASE databases of six labelled structures, each damaged in one row (row 3, structure 2): (label, path,
    words). SQLite (.db): a row without its energy, a row whose positions are not numbers; ASE-LMDB (.aselmdb,
    where ase-db-backends is installed): a row gone from under its index, a row whose body is not data."""
    import sqlite3

    import ase.db

    def database(name, kind, damage):
        def write(path):
            with unlimited_address_space():  # ASE-LMDB maps 2 TB to write (reading maps the file's size)
                written(path)

        def written(path):
            # (serial: rank 0 alone writes; ASE's databases would broadcast to the other ranks)
            db = ase.db.connect(path, type="db", serial=True) if kind == "db" else LMDBDatabase(path, serial=True)
            atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
            for k in range(6):
                frame = atoms.copy()
                frame.rattle(0.05, seed=k)
                frame.calc = EMT()
                energy, forces, stress = frame.get_potential_energy(), frame.get_forces(), frame.get_stress()
                frame.calc = SinglePointCalculator(frame, energy=energy, forces=forces, stress=stress)
                if k == 2 and damage == "no energy":
                    frame.calc = SinglePointCalculator(frame, forces=forces, stress=stress)
                db.write(frame)
            if kind == "aselmdb":
                db.close()
            if damage == "garbled positions":
                with contextlib.closing(sqlite3.connect(path)) as con:
                    con.execute("update systems set positions = ? where id = 3", (b"\x01\x02garbled",))
                    con.commit()
            elif damage in ("row gone", "garbled body"):
                import lmdb
                env = lmdb.open(path, subdir=False, lock=False)
                with env.begin(write=True) as txn:
                    txn.delete(b"3") if damage == "row gone" else txn.put(b"3", b"\x78\x9cgarbled")
                env.close()
        return scratch_file(name, write)

    cases = [("an ASE database with a row that lacks its energy", database("no_energy.db", "db", "no energy"),
              ["no_energy.db", "structure 2", "has no energy"]),
             ("an ASE database with a row's positions garbled", database("garbled.db", "db", "garbled positions"),
              ["garbled.db", "structure 2", "row id 3", "cannot be read"])]
    try:
        from ase_db_backends.aselmdb import LMDBDatabase
    except ImportError:
        skipped("ASE-LMDB databases with a row gone or garbled", "ase_db_backends")
        return cases
    cases += [("an ASE-LMDB database with a row gone from under its index", database("gone.aselmdb", "aselmdb",
                                                                                   "row gone"),
               ["gone.aselmdb", "structure 2", "row id 3", "cannot be read", "missing"]),
              ("an ASE-LMDB database with a row's body garbled", database("garbled.aselmdb", "aselmdb",
                                                                          "garbled body"),
               ["garbled.aselmdb", "structure 2", "row id 3", "cannot be read"])]
    return cases


def lammps_cases():
    deck = os.path.join(scratch, "in.lj")
    if world.rank == 0:
        with open(deck, "w") as f:
            f.write("units metal\nlattice fcc 5.26\nregion box block 0 3 0 3 0 3\ncreate_box 1 box\n"
                    "create_atoms 1 box\nmass 1 39.95\nfix ext all external pf/callback 1 1\nrun 0\n")
    world.Barrier()
    lj = ["--model", "lj:0.0104,3.4,8.5", "--elements", "Ar"]
    yield "nan skin", ["-in", deck, *lj, "--skin", "nan"], ["--skin", "nan"]
    yield "negative skin", ["-in", deck, *lj, "--skin", "-1"], ["--skin", ">= 0"]
    yield "zero memory budget", ["-in", deck, *lj, "--memory-budget-gb", "0"], ["--memory-budget-gb", "> 0"]
    yield "infinite memory budget", ["-in", deck, *lj, "--memory-budget-gb", "inf"], ["--memory-budget-gb", "inf"]
    yield "negative LJ cutoff", ["-in", deck, "--model", "lj:0.0104,3.4,-1", "--elements", "Ar"], ["lj:", "cutoff"]
    yield "nan LJ epsilon", ["-in", deck, "--model", "lj:nan,3.4,8", "--elements", "Ar"], ["lj:", "epsilon"]
    yield "missing deck", ["-in", "nowhere.lmp", *lj], ["nowhere.lmp"]
    committee = ["--committee", "lj:0.0104,3.4,8.5", "lj:0.0105,3.4,8.5", "--elements", "Ar"]
    yield "model and committee", ["-in", deck, *committee, "--model", "cu-emt"], ["--model", "--committee"]
    yield "bad committee member", ["-in", deck, "--committee", "lj:0.0104,3.4,8.5", "lj:0.0104,3.4,-1", "--elements",
                                   "Ar"], ["--committee", "member 2", "cutoff"]
    yield "option no member takes", ["-in", deck, *committee, "--head", "Default"], ["--committee", "head",
                                                                                    "no member"]


def argon_file(name, atoms):
    """An extxyz of ``atoms`` in SCRATCH (rank 0 writes it)."""
    path = os.path.join(scratch, name)
    if world.rank == 0:
        write(path, atoms, format="extxyz", parallel=False)
    world.Barrier()
    return path


def md_accepted():
    """mlip-md at its legal limits: (label, config, files written). Argon with Lennard-Jones unless said."""
    from ase import Atoms

    argon = {"model": ARGON, "structure": {"element": "Ar", "a": 5.26, "repeat": [3, 3, 3]}, "steps": 4}
    slab = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((2, 3, 3))
    slab.set_cell([21.04, 15.78, 15.78])  # the atoms in x < 10.5 of a 21 Å periodic cell: rank 1 of 2 owns none
    dimer = Atoms("Ar2", positions=[[1.0, 1.0, 1.0], [4.8, 1.0, 1.0]], cell=[7.6, 7.6, 7.6], pbc=True)
    tiny = bulk("Ar", "fcc", a=5.26, cubic=True)  # 4 atoms, a cell 5.26 Å wide, a cutoff of 8.5 Å: ghosts over hops
    flat = Atoms("Ar9", positions=[[3.8 * i, 3.8 * j, 0.0] for i in range(3) for j in range(3)])  # a layer, no cell
    cases = [
        ("zero temperature", {"temperature_K": 0}, ["final.extxyz"]),
        ("steps zero", {"steps": 0}, ["final.extxyz", "restart.npz"]),
        ("negative pressure", {"ensemble": "npt", "barostat": {"pressure_GPa": -0.5, "isotropic": False}},
         ["final.extxyz"]),
        ("zero friction", {"ensemble": "langevin", "thermostat": {"friction_per_fs": 0}}, ["final.extxyz"]),
        ("nose-hoover", {"ensemble": "nose-hoover", "thermostat": {"tdamp_fs": 10}}, ["final.extxyz"]),
        ("bussi", {"ensemble": "bussi", "thermostat": {"tau_fs": 1}}, ["final.extxyz"]),
        ("one atom per rank", {"structure": {"file": argon_file("dimer.extxyz", dimer)}}, ["final.extxyz"]),
        ("a rank that owns no atom", {"structure": {"file": argon_file("half.extxyz", slab)}}, ["final.extxyz"]),
        ("a cell smaller than the cutoff", {"structure": {"file": argon_file("tiny.extxyz", tiny)}}, ["final.extxyz"]),
        ("a flat cluster", {"structure": {"file": argon_file("flat.extxyz", flat)}, "temperature_K": 50},
         ["final.extxyz"]),
        ("no distance check", {"structure": {"min_distance": 0}}, ["final.extxyz"]),
        ("zero skin", {"skin": 0}, ["final.extxyz"]),
        ("wide halo", {"mode": "wide"}, ["final.extxyz"]),
        ("balance every step", {"balance_every": 1}, ["final.extxyz"]),
        ("every output every step", {"output": {"thermo_every": 1, "trajectory_every": 1, "restart_every": 1}},
         ["thermo.csv", "trajectory.extxyz", "restart.npz"]),
        ("ASE trajectory", {"output": {"trajectory_every": 2, "trajectory_format": "traj"}}, ["trajectory.traj"]),
        ("a tiny time step", {"timestep_fs": 1e-3}, ["final.extxyz"]),
        ("a tiny memory budget", {"memory_budget_gb": 1e-6}, ["final.extxyz"]),
        ("resume with nothing to resume", {"resume": True}, ["restart.npz"]),
        ("cu-emt in float32", {"model": {"checkpoint": "cu-emt", "dtype": "float32"},
                               "structure": {"element": "Cu", "a": 3.61, "repeat": [2, 2, 2]}}, ["final.extxyz"]),
        ("a committee of one, every frame selected", {"model": {"committee": [ARGON]},
                                                      "uncertainty": {"every": 1, "select": [0, 0]}},
         ["model_devi.csv", "candidates.extxyz"]),
        ("a committee of two kinds, the first's forces", {
            "model": {"committee": [ARGON, {"lennard_jones": {"epsilon": 0.0105, "sigma": 3.41, "cutoff": 6.0}}],
                      "committee_forces": "first"}, "uncertainty": {"stop_above": 1e6}}, ["model_devi.csv"]),
    ]
    if importlib.util.find_spec("fairchem") is None:
        skipped("an anion (charge -1)", "fairchem")
    else:
        water = Atoms("OH2", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]], cell=[9.0, 9.0, 9.0])
        fixture = os.path.join(ROOT, "tests", "data", "fairchem", "uma-moe.pt")
        cases.append(("an anion (charge -1)", {"model": {"fairchem": fixture, "task": "omol", "charge": -1, "spin": 2},
                                               "structure": {"file": argon_file("water.extxyz", water)}, "steps": 2},
                      ["final.extxyz"]))
    for label, changes, files in cases:
        config = {key: dict(value) if isinstance(value, dict) else value for key, value in argon.items()}
        for key, value in changes.items():
            config[key] = value if key == "model" or not isinstance(value, dict) else {**config.get(key, {}), **value}
        config.setdefault("output", {})["directory"] = "out"
        yield label, config, [os.path.join("out", f) for f in files]


def train_accepted():
    """mlip-train at its legal limits: (label, config, files written)."""
    data = structures("accepted.extxyz", count=6)
    validation = structures("accepted_validation.extxyz", count=2)
    base = {"data": {"train": data, "validation_fraction": 0.34},
            "model": {"name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 8, "layers": 2}},
            "epochs": 1, "batch_size": 2}
    cases = [
        ("one epoch, one batch of every structure", {"data": {"train": data, "validation": validation,
                                                              "validation_fraction": 0.0}, "batch_size": 6}),
        ("a batch of one", {"batch_size": 1}),
        ("a test share", {"data": {"train": data, "validation_fraction": 0.34, "test_fraction": 0.17}}),
        ("no EMA", {"ema_decay": 0.0}),
        ("no gradient clipping", {"optimizer": {"gradient_clip": 0.0}}),
        ("the Huber loss with AMSGrad, reference energies fitted to the labels", {
            "loss": {"type": "huber", "huber_delta": 1e-6}, "optimizer": {"amsgrad": True},
            "model": {"checkpoint": "cu-emt", "reference_energies": "fit"}}),
        ("the universal loss with config_type weights, a second stage averaged, no training errors", {
            "loss": {"type": "universal", "config_type_weights": {"nowhere": 2.0}}, "training_errors": 0,
            "stage_two": {"start_epoch": 2, "forces_weight": 1.0, "lr": 1e-4, "average": True}, "epochs": 2}),
        ("LoRA of rank 1 on SchNet's interaction matrices", {"model": {
            "name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 8, "layers": 2},
            "lora": {"targets": ["interactions.*.lin*.weight"], "rank": 1}}}),
        ("cosine schedule", {"schedule": {"name": "cosine"}, "epochs": 2}),
        ("no schedule", {"schedule": {"name": "none"}}),
        ("a step or two: one max step, a warm-up longer than the run, validation and last.pt every step",
         {"max_steps": 1, "validate_every": 1, "schedule": {"name": "cosine", "warmup_steps": 50},
          "output": {"checkpoint_every": 1}}),
        ("the stress alone", {"loss": {"energy_weight": 0.0, "forces_weight": 0.0, "stress_weight": 1.0}}),
        ("a tiny learning rate", {"optimizer": {"lr": 1e-12}}),
        ("float64", {"model": {**base["model"], "dtype": "float64"}}),
        ("graph parallel", {"parallel": "graph"}),
        ("pipeline of one micro-batch", {"parallel": "pipeline", "pipeline": {"stages": 2, "microbatches": 1}}),
        ("LoRA in pipeline stages", {
            "parallel": "pipeline", "model": {"name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 8,
                                                                                                    "layers": 2},
                                              "lora": {"targets": ["interactions.*.lin*.weight"], "rank": 1}}}),
        ("PaiNN, frozen embedding", {"model": {"name": "PaiNN", "cutoff": 4.0, "hyperparameters": {"features": 8,
                                                                                                  "layers": 2},
                                               "freeze": ["embedding.*"]}}),
        ("cu-emt refit", {"model": {"checkpoint": "cu-emt", "reference_energies": "refit"}}),
        ("streamed, two files as one set, the labels' names given", {"data": {
            "train": [data, validation], "validation_fraction": 0.25, "stream": True,
            "keys": {"energy": "energy", "forces": "forces", "stress": "stress"}}}),
        ("a file sampled at a tiny share (one structure an epoch), streamed", {"data": {
            "train": [data, {"file": validation, "share": 0.01}], "validation_fraction": 0.34, "stream": True}}),
    ]
    for label, changes in cases:
        config = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
        config.update(changes)
        config["output"] = {**changes.get("output", {}), "directory": "out"}
        yield label, config, ["out/best.pt", "out/last.pt", "out/metrics.csv"]


def lammps_accepted():
    """mlip-lammps at its legal limits: (label, argv, files written)."""
    deck = os.path.join(scratch, "in.accepted")
    half = os.path.join(scratch, "in.half")
    if world.rank == 0:
        with open(deck, "w") as f:
            f.write("units metal\nlattice fcc 5.26\nregion box block 0 3 0 3 0 3\ncreate_box 1 box\n"
                    "create_atoms 1 box\nmass 1 39.95\nrun 2\n")
        with open(half, "w") as f:  # atoms in the lower half of the box only: a rank with none
            f.write("units metal\nlattice fcc 5.26\nregion box block 0 6 0 3 0 3\ncreate_box 1 box\n"
                    "region lower block 0 2.9 0 3 0 3\ncreate_atoms 1 region lower\nmass 1 39.95\n"
                    "velocity all create 30 1\nfix nve all nve\nrun 2\n")
    world.Barrier()
    lj = ["--model", "lj:0.0104,3.4,8.5", "--add-fix", "-log", "log.lammps", "-screen", "none"]
    for label, extra, path in (("zero skin", ["--skin", "0"], deck), ("wide halo", ["--mode", "wide"], deck),
                               ("elements named", ["--elements", "Ar"], deck),
                               ("a tiny memory budget", ["--memory-budget-gb", "1e-6"], deck),
                               ("a rank that owns no atom", [], half),
                               ("cu-emt in float32", ["--dtype", "float32", "--elements", "Cu"], deck),
                               ("a committee of two cutoffs", ["--committee", "lj:0.0104,3.4,8.5", "lj:0.0105,3.4,6"],
                                deck)):
        argv = ["-in", path, *lj, *extra]
        if label.startswith("a committee"):
            del argv[argv.index("--model"):argv.index("--model") + 2]
        if label.startswith("cu-emt"):
            argv[argv.index("--model") + 1] = "cu-emt"
        yield label, argv, ["log.lammps"]


def files_under(directory) -> dict:
    """{relative path: bytes} of every file under ``directory``."""
    found = {}
    for top, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(top, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = f.read()
    return found


def run_case(label, argument, words, placed=None):
    """(ok, why) of one case, the same verdict on every rank. Refused: ``words`` in its one line; accepted: the
    files ``words`` names written. ``placed`` ({relative path: bytes}): files put in the case's directory first (a
    damaged file to resume from), which a refused case must leave as they were."""
    directory = os.path.join(scratch, tool, label.replace(" ", "_"))
    placed = placed or {}
    if world.rank == 0:
        os.makedirs(directory)
        for name, data in placed.items():
            os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
            with open(os.path.join(directory, name), "wb") as f:
                f.write(data)
    world.Barrier()
    os.chdir(directory)
    if tool == "mlip-lammps":
        from mlip_parallel.lammps import main
        argv = argument
    else:
        if tool == "mlip-md":
            from md.cli import main
        else:
            from mlip_parallel.train.cli import main
        if world.rank == 0:
            with open("job.yaml", "w") as f:
                yaml.safe_dump(argument, f)
        world.Barrier()
        argv = ["job.yaml", "--no-progress"]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException as exc:  # noqa: BLE001 - a regression: report it as this case's failure
        code = f"{type(exc).__name__}: {exc}"
    world.Barrier()
    lines = err.getvalue().splitlines()
    found = files_under(directory)
    left = sorted(name for name, data in found.items() if name != "job.yaml" and placed.get(name) != data) + \
        [f"{name} (gone)" for name in placed if name not in found]
    why = None
    if accepted:
        missing = [f for f in words if not os.path.exists(os.path.join(directory, f))]
        errors = [line for line in lines if "error" in line]
        why = f"exit {code!r}: {errors[:1] or lines[-3:]}" if code != 0 else f"no {missing}" if missing else \
            f"printed {errors[:1]}" if errors else None
        whys = [w for w in world.allgather(why) if w]
        os.chdir(scratch)
        return not whys, whys[0] if whys else "ran"
    if code != 2:
        why = f"exit {code!r}"
    elif out.getvalue():
        why = f"stdout {out.getvalue()!r}"
    elif world.rank == 0 and len(lines) != 1:
        why = f"{len(lines)} lines on stderr: {lines}"
    elif world.rank != 0 and lines:
        why = f"rank {world.rank} printed {lines}"
    elif world.rank == 0 and not all(w in lines[0] for w in words):
        why = f"missing {[w for w in words if w not in lines[0]]} in {lines[0]!r}"
    elif left:
        why = f"wrote {left}"
    whys = [w for w in world.allgather(why) if w]
    message = lines[0] if world.rank == 0 and lines else ""
    os.chdir(scratch)
    return not whys, whys[0] if whys else message


tables = {"mlip-md": (md_cases, md_accepted), "mlip-train": (train_cases, train_accepted),
          "mlip-lammps": (lammps_cases, lammps_accepted)}
cases = list(tables[tool][accepted]())
passed = 0
for label, argument, words, *placed in cases:
    ok, text = run_case(label, argument, words, *placed)
    passed += ok
    if world.rank == 0:
        print(f"{'OK' if ok else 'FAIL'} {label}: {text}", flush=True)
if world.rank == 0:
    print(f"{'accepted' if accepted else 'mistakes'}: {passed} of {len(cases)}", flush=True)
sys.exit(0 if passed == len(cases) else 1)
