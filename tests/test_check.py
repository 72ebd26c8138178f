"""A user's own check that a model is exact when distributed: ``python -m mlip_parallel.check --model SPEC`` and the
``verify`` of mlip-md and mlip-lammps catch a model whose layer reads its neighbours' features without
``graph.halo`` (a family registered for this test, ``broken``: the example's toy model with the halo left out), and
pass every shipped model and the packages' test fixtures."""
import json
import subprocess
import sys

import pytest
import yaml

from conftest import MPI_DIR, ROOT, importable, needs, require
from systems import FAIRCHEM_DIR, MACE_DIR, NEQUIP_DIR
from test_families import PLUGIN, installed

BROKEN = '''from potentials import Family
from toy_family import ToyPotential


class Unhaloed(ToyPotential):
    """The toy model with the halo left out: its layers read the ghost rows as this rank computed them."""

    def forward(self, graph):
        return self.scale * self.net(graph.species, graph.edge_index, graph.edge_vec.to(self.dtype))[: graph.n_local]


FAMILY = Family("broken", lambda spec: Unhaloed(spec), help="the toy model with its halo left out")
'''


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """A directory with a toy model file (three layers), and the path entries that make the toy and the broken
    families visible (their packages' entry points)."""
    root = tmp_path_factory.mktemp("check")
    (root / "broken_family.py").write_text(BROKEN)
    installed(root / "site", "mlip-toy-family", {"toy": "toy_family:FAMILY"})
    installed(root / "site", "mlip-broken", {"broken": "broken_family:FAMILY"})
    code = (f"import sys; sys.path[:0] = [{str(PLUGIN)!r}]; import toy_family; "
            f"toy_family.write_model({str(root / 'toy.pt')!r}, species=['Cu', 'Ag'], layers=3)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return root, (PLUGIN, root / "site", root)


def test_check_catches_a_model_that_skips_the_halo(mpirun, families):
    """On 2 ranks: the broken model fails in layerwise mode (exit 1, the verdict names it) and passes in wide mode
    (which needs no halo); the same model with its halo passes in both."""
    root, path = families
    rc, out, _ = mpirun(2, "-m", "mlip_parallel.check", "--model", f"broken:{root / 'toy.pt'}", "--model",
                        f"toy:{root / 'toy.pt'}", "--repeat", "2", pythonpath=path)
    assert rc == 1, out
    assert f"FAILED (broken:{root / 'toy.pt'} layerwise: distributed differs from one process" in out, out
    lines = [line for line in out.splitlines() if "max |F_distributed - F_serial|" in line]
    assert len(lines) == 4 and sum("BEYOND" in line for line in lines) == 1, lines


def test_check_passes_every_shipped_model(mpirun, families):
    """On 2 ranks, both halo modes, a rattled crystal of each model's elements: cu-emt, Lennard-Jones, the example
    family, and the packages' test fixtures of each installed family (MACE, the nequip framework's NequIP and
    Allegro, fairchem's eSEN): every difference within summation order, exit 0."""
    root, path = families
    models = ["cu-emt", "lj:0.0104,3.4,8.5", f"toy:{root / 'toy.pt'}"]
    for module, spec in (("mace", f"mace:{MACE_DIR / 'mace-zbl-f64.model'}"),
                         ("nequip", f"nequip:{NEQUIP_DIR / 'nequip-zbl.ckpt'}"),
                         ("allegro", f"nequip:{NEQUIP_DIR / 'allegro.ckpt'}"),
                         ("fairchem", f"fairchem:{FAIRCHEM_DIR / 'esen.pt'}")):
        if importable(module):
            models.append(spec)
    arguments = [a for spec in models for a in ("--model", spec)]
    rc, out, _ = mpirun(2, "-m", "mlip_parallel.check", *arguments, "--repeat", "2", pythonpath=path)
    assert rc == 0 and "largest force difference" in out and out.rstrip().endswith("OK"), out
    assert sum("max |F_distributed - F_serial|" in line for line in out.splitlines()) == 2 * len(models), out
    require("mace", "nequip", "allegro", "fairchem")  # the families left out above: the test is skipped or fails


@needs("lammps")
def test_verify_stops_mlip_md_and_mlip_lammps_on_a_model_that_skips_the_halo(mpirun, families, tmp_path):
    """``verify: true`` / ``--verify`` on 2 ranks: the broken model ends mlip-md (status 1) and mlip-lammps (status
    2) at the first step with one line naming the differences, before mlip-md writes anything; the toy model runs
    and both print the comparison."""
    root, path = families
    for name, family in (("broken", "broken"), ("good", "toy")):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({
            "model": {family: str(root / "toy.pt")}, "structure": {"element": "Cu", "repeat": [3, 3, 3]},
            "steps": 2, "verify": True, "output": {"directory": f"md-{name}"}}))
    (tmp_path / "in.deck").write_text("units metal\nlattice fcc 3.61\nregion box block 0 3 0 3 0 3\ncreate_box 2 box\n"
                                      "create_atoms 1 box\nmass 1 63.546\nmass 2 107.8682\n"
                                      "set type 1 type/fraction 2 0.3 1\nvelocity all create 300 1\nfix nve all nve\n"
                                      "run 2\n")
    deck = ["-in", str(tmp_path / "in.deck"), "--add-fix", "--verify", "-screen", "none", "-log", "none"]
    jobs = [["mlip-md", "broken.yaml", "--no-progress"], ["mlip-md", "good.yaml", "--no-progress"],
            ["mlip-lammps", *deck, "--model", f"toy:{root / 'toy.pt'}"]]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    rc, out, _ = mpirun(2, MPI_DIR / "cli_jobs.py", tmp_path, pythonpath=path)
    assert "cli jobs exit codes [1, 0, 0]" in out, out
    # (an error inside LAMMPS's callback ends the process: the broken model's deck in a launch of its own)
    rc, broken, _ = mpirun(2, "-m", "mlip_parallel.lammps", *deck, "--model", f"broken:{root / 'toy.pt'}",
                           pythonpath=path)
    assert rc == 2, broken
    errors = [line for line in (out + broken).splitlines() if ": error: verify: step 0 on 2 rank(s)" in line]
    assert [line.split(":")[0] for line in errors] == ["mlip-md", "mlip-lammps"], out + broken
    assert all("BEYOND" in line and "graph.halo" in line for line in errors), errors
    assert not (tmp_path / "md-broken").exists() and (tmp_path / "md-good" / "final.extxyz").exists()
    assert out.count("verify: step 0 on 2 rank(s) against one process") == 3 and out.count("(within ") == 2, out


def test_a_structure_one_process_cannot_hold_is_compared_through_a_carve_out(monkeypatch):
    """Where the memory pre-flight says one process cannot hold the structure (made to say so above 40 atoms), the
    comparison runs on a carve-out: the atoms nearest the centre, as many as one process holds (256 halved to 32), as
    a cluster; a run's first step is checked the same way."""
    import numpy as np
    from ase.build import bulk

    import potentials
    from mlip_parallel.backend import SerialBackend
    from mlip_parallel import verify

    monkeypatch.setattr(verify, "fits_one_process", lambda model, atoms: len(atoms) <= 40)
    model = potentials.load_model("cu-emt", "float64")
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(4)
    atoms.rattle(0.05, seed=3)
    compared, results = verify.check(model, atoms, SerialBackend(), ("layerwise",))
    assert len(compared) == 32 and not compared.pbc.any() and results[0][1].ok, (len(compared), results)
    spread = compared.positions - compared.positions.mean(axis=0)
    assert np.linalg.norm(spread, axis=1).max() < 6.0  # a compact ball of 32 atoms (fcc Cu: radius ~4.7 Å)
    step = verify.check_step(model, atoms, None, SerialBackend())
    assert step.ok


def test_check_reports_a_nan_difference_as_nan_and_fails(monkeypatch, capsys):
    """A distributed result whose forces came out NaN: the verdict line prints nan (not the 0 that a max() skipping
    it printed) and FAILED, exit 1."""
    import mlip_parallel.verify as verify
    from mlip_parallel.check import main

    def nan_forces(model, atoms, backend, modes):
        nan = verify.Comparison(0.0, float("nan"), 0.0, {"forces": 1e-8}, False)
        return atoms, [(mode, nan) for mode in modes]

    monkeypatch.setattr(verify, "check", nan_forces)
    assert main(["--models", "LennardJones", "--repeat", "2"]) == 1
    out = capsys.readouterr().out
    assert "largest force difference nan eV/A: FAILED (LennardJones layerwise, LennardJones wide" in out, out

