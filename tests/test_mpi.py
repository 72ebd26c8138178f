"""Distributed contracts, each a batch of cases in one mpiexec (or torchrun) launch (see tests/mpi/).

The MPI backend runs every contract; the torch.distributed backend (gloo here) runs the equivalence suite on 4 ranks
and every package family's on 3 (torchrun, no MPI), the double-backward suite under torchrun and under mpiexec with
MLIP_PARALLEL_BACKEND=torch, plus the self-check and the abort path. On 2 and 3 ranks every equality launch also plants
the halo's faults (tests/faults.py) and must catch each."""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import MPI_DIR, ROOT, assert_job_aborted, launch_sections, missing, mpiexec_path, require

# Other packages' models (tests/mpi/families.py): each family in full on 2 ranks; the first model of each on every
# 3-rank grid (fairchem's under torch.distributed); every family in one lean launch on 4 ranks and one under
# torch.distributed (torchrun, 3 ranks): what those runs add is the grids or the backend.
FAMILIES = {"mace": ("MACE", 3), "nequip": ("nequip framework", 4), "fairchem": ("fairchem", 3),
            "sevennet": ("SevenNet-0", 3)}  # family: (its summary's title, the faults planted on 2 and 3 ranks)
FAMILY_PACKAGES = {"mace": ("mace",), "nequip": ("nequip", "allegro"), "fairchem": ("fairchem",),
                   "sevennet": ("sevenn",)}

# The scripts that run on the same number of ranks with the same backend share one launch (tests/mpi/several.py): each
# rank imports torch and the package once for all of them. {ranks: [(section name, script and its arguments)]};
# chunked.py last (it shrinks the chunks for the rest of its process).
SHARED = {2: [("equivalence", ["equivalence.py"]), ("double_backward", ["double_backward.py"]),
              ("comm_contracts", ["comm_contracts.py"]), ("bad_input", ["bad_input.py", "caught"]),
              ("check", ["-m", "mlip_parallel.check", "--repeat", "3"]),
              ("check-painn", ["-m", "mlip_parallel.check", "--repeat", "3", "--models", "PaiNN"]),
              ("ase_dynamics", ["ase_dynamics.py"]),
              ("md_engine", ["md_engine.py", "--restarts", "1", "--gas-steps", "0"]),
              ("families", ["families.py", *FAMILIES])],
          3: [("equivalence", ["equivalence.py"]), ("double_backward", ["double_backward.py"]),
              ("comm_contracts", ["comm_contracts.py"]), ("pipeline", ["pipeline.py"]),
              ("families", ["families.py", "--grids", "mace", "nequip", "sevennet"]), ("chunked", ["chunked.py"])],
          4: [("equivalence", ["equivalence.py"]), ("comm_contracts", ["comm_contracts.py"]),
              ("ase_dynamics", ["ase_dynamics.py"]),
              ("md_engine", ["md_engine.py", "--restarts", "0", "--gas-steps", "750", "--ensembles", "short"]),
              ("pipeline", ["pipeline.py"]), ("families", ["families.py", "--lean", *FAMILIES])]}


@pytest.fixture(scope="module")
def shared(mpirun):
    """``shared(ranks, name)`` → (exit status, output) of section ``name`` of the launch of ``SHARED[ranks]`` (run at
    the first request for ``ranks``; ``conftest.launch_sections``)."""
    launches = {}

    def section(ranks, name):
        if ranks not in launches:
            launches[ranks] = launch_sections(mpirun, ranks, SHARED[ranks])
        return launches[ranks](name)

    return section


def assert_faults_caught(out: str, ranks: int, planted: int) -> None:
    """On 2 ranks and on 3 (an odd grid), the launch planted ``planted`` halo faults (tests/faults.py) and its
    comparison caught each; on other rank counts it planted none."""
    expected = planted if ranks in (2, 3) else 0
    assert f"faults caught {expected} of {expected}" in out and "fault MISSED" not in out, out


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_distributed_equals_reference(shared, ranks):
    """Every geometry × grid × {LJ vs ASE, SchNet float64/float32 × layerwise/wide vs predict}."""
    rc, out = shared(ranks, "equivalence")
    assert rc == 0, out
    assert f"P={ranks}:" in out and " 0 failures" in out, out
    assert_faults_caught(out, ranks, 10)  # SchNet, PaiNN, NequIP: 3 faults each; Lennard-Jones: its ghost gradients
    if ranks >= 3:  # the cluster geometry leaves middle subdomains empty
        assert " 0 (geometry, grid, rank) with no atoms" not in out, out


@pytest.mark.parametrize("ranks", [1, 3])
def test_chunked_evaluation_equals_plain(mpirun, shared, ranks):
    """Memory-bounded edge sums (many chunks per block) == one pass over all edges: SchNet float64/32,
    PaiNN, NequIP, every geometry (a cell smaller than two cutoffs, an empty rank on 3), both modes,
    and predict on one rank; float64 to 1e-12."""
    rc, out = shared(ranks, "chunked") if ranks in SHARED else mpirun(ranks, MPI_DIR / "chunked.py")[:2]
    assert rc == 0, out
    assert f"P={ranks}:" in out and " 0 failures" in out and " 0 chunked edge sums" not in out, out
    if ranks == 3:
        assert " 0 (geometry, rank) with no atoms" not in out, out


def test_distributed_equals_reference_torch_backend(torchrun):
    """equivalence.py under torchrun (no MPI; gloo) on 2 ranks, lean (the float64 models, every geometry on two grids:
    the backend is what is new; every family runs under torch.distributed on 3 ranks below): mpiexec with
    MLIP_PARALLEL_BACKEND=torch runs in test_double_backward_through_halo_torch_backend."""
    ranks = 2
    rc, out, _ = torchrun(ranks, MPI_DIR / "equivalence.py", "--lean", backend="torch")
    assert rc == 0, out
    assert f"P={ranks}:" in out and " 0 failures" in out and "communication: torch.distributed gloo" in out, out
    assert_faults_caught(out, ranks, 10)


@pytest.mark.parametrize("launcher, ranks", [("torchrun", 3), ("mpiexec", 2)])
def test_double_backward_through_halo_torch_backend(mpirun, torchrun, launcher, ranks):
    run = torchrun if launcher == "torchrun" else mpirun
    rc, out, _ = run(ranks, MPI_DIR / "double_backward.py", backend="torch")
    assert rc == 0, out
    assert "0 parameter-gradient mismatches" in out and "communication: torch.distributed gloo" in out, out


@pytest.mark.parametrize("ranks", [2, 3])
def test_double_backward_through_halo(shared, ranks):
    rc, out = shared(ranks, "double_backward")
    assert rc == 0, out
    assert "0 parameter-gradient mismatches" in out, out


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_comm_verbs(shared, ranks):
    rc, out = shared(ranks, "comm_contracts")
    assert rc == 0, out
    assert "comm contracts, 0 failures" in out, out


def test_oversubscribed_ranks_sleep_while_waiting():
    """Under mpiexec with more ranks than CPUs, importing mlip_parallel sets ``MPICH_YIELD`` before MPI
    starts, keeping what the user set; with no more ranks than CPUs it sets nothing. (Launched here, not
    through ``mpirun``, which sets it itself.)"""
    from mlip_parallel.launch import MPICH_YIELD, usable_cpus

    (name, value), = MPICH_YIELD.items()
    code = ("import os, mlip_parallel; from mpi4py import MPI; "  # one write per line: ranks' lines never mix
            "os.write(1, ('rank %d %s\\n' % (MPI.COMM_WORLD.Get_rank(), os.environ.get(" + repr(name) + "))).encode())")
    env = {k: v for k, v in os.environ.items() if k not in MPICH_YIELD}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cpus = usable_cpus()
    for ranks, user, expected in [(cpus + 1, {}, value), (cpus + 1, {name: "0"}, "0"), (1, {}, "None")]:
        proc = subprocess.run([mpiexec_path(), "-n", str(ranks), sys.executable, "-c", code], capture_output=True,
                              text=True, timeout=120, env={**env, **user}, cwd=ROOT)
        lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
        assert proc.returncode == 0 and lines == sorted(f"rank {r} {expected}" for r in range(ranks)), \
            proc.stdout + proc.stderr


def test_bad_input_raises_on_every_rank(shared):
    rc, out = shared(2, "bad_input")
    assert rc == 0, out
    assert out.count("OK ") == 5, out


def test_uncaught_bad_input_aborts_job(mpirun):
    rc, out, seconds = mpirun(3, MPI_DIR / "bad_input.py", "uncaught", timeout=60)
    assert_job_aborted(rc, out, seconds, "InvalidStructureError: non-finite positions")


@pytest.mark.parametrize("launcher, process_group", [("mpiexec", False), ("torchrun", False), ("mpiexec", True)])
def test_exception_on_one_rank_aborts_all(mpirun, torchrun, launcher, process_group):
    run = torchrun if launcher == "torchrun" else mpirun
    rc, out, seconds = run(3, MPI_DIR / "raise_on_one_rank.py", *(["--process-group"] if process_group else []),
                           timeout=60)
    assert_job_aborted(rc, out, seconds, "rank 1: RuntimeError: deliberate failure on rank 1")


def test_self_check_entry_point(shared):
    """The self-check checks what README says: Lennard-Jones, SchNet, PaiNN and NequIP in both halo modes
    (``--models`` chooses); the device-direct line only where a rank has a GPU."""
    rc, out = shared(2, "check")
    assert rc == 0, out
    for text in ("2 rank(s)", "communication: MPICH", "rank 1: host", "largest force difference", "OK"):
        assert text in out, out
    for name in ("LennardJones", "SchNet", "PaiNN", "NequIP"):
        for mode in ("layerwise", "wide"):
            assert re.search(rf"{name} +{mode} *: max \|F_distributed - F_serial\| = ", out), (name, mode, out)
    assert ("device-direct" in out) == torch.cuda.is_available(), out
    rc, out = shared(2, "check-painn")
    assert rc == 0 and "PaiNN" in out and "SchNet" not in out, out


def test_self_check_under_torchrun_without_mpi(torchrun):
    rc, out, _ = torchrun(2, MPI_DIR / "check_without_mpi.py", "--repeat", "3")
    assert rc == 0, out
    for text in ("2 rank(s)", "communication: torch.distributed gloo", "largest force difference", "OK"):
        assert text in out, out


@pytest.mark.parametrize("ranks", [2, 4])
def test_ase_dynamics_with_distributed_calculator_equal_serial(shared, ranks):
    """ASE's integrators, BFGS, FIRE and FIRE on FrechetCellFilter, and phonopy's frequencies with the distributed
    calculator == one process; ASE's NEB(parallel=True), 2 images
    each on its own communicator of P / 2 ranks (examples/neb_parallel.py) == the band in one process; ranks that pass
    different structures (the band's calculators on the whole world; velocities drawn on each rank) end in one
    RanksDisagreeError naming the way out (tests/mpi/ase_dynamics.py)."""
    require("phonopy")
    rc, out = shared(ranks, "ase_dynamics")
    assert rc == 0, out
    assert "ASE dynamics 0 failures" in out, out
    assert f"NEB, 2 images x {ranks // 2} rank(s)" in out and "phonopy: highest frequency" in out, out
    assert "fire-cell: max |x_P - x_serial|" in out, out
    assert out.count("ranks of this communicator were given") == 2, out


@pytest.mark.parametrize("ranks", [2, 4])
def test_md_engine_rank_independent_and_conserves_atoms(shared, ranks):
    """Every ensemble and the balanced droplet on 2 ranks, NVE/Langevin/anisotropic NPT and the droplet
    on 4; restarts on 2; the hot gas on 4 (``SHARED``'s options)."""
    rc, out = shared(ranks, "md_engine")
    assert rc == 0, out
    assert "MD engine 0 failures" in out, out
    assert ("NPT restart" in out) if ranks == 2 else ("gas: 750 steps" in out and "ids conserved: True" in out), out
    if ranks == 4:  # the gas's atoms travel farther than the cell (27 Å): each crosses every rank's subdomain
        assert float(re.search(r"farthest travel ([\d.]+) A", out).group(1)) > 27.0, out


@pytest.mark.parametrize("ranks", [3, 4])
def test_pipeline_parallel_equals_single_process(shared, ranks):
    """Stage-local models (each rank exactly its parts) equal one process: S = 3 stages on 3 ranks (GPipe,
    1F1B, recomputation, energy-only; SchNet, PaiNN, NequIP), 2 replicas × 2 stages on 4 ranks (DP × PP);
    ragged batches, AdamW steps, pipelined evaluation, 2BW, the merged checkpoint; one case with the stages (and
    replicas) talking through the MPI backend instead of torch.distributed (tests/mpi/pipeline.py;
    S = 2 runs through mlip-train in tests/test_training.py)."""
    rc, out = shared(ranks, "pipeline")
    assert rc == 0, out
    assert "pipeline 0 failures" in out and out.count("max rel err") == (16 if ranks == 3 else 13), out
    assert "merged checkpoint vs whole model" in out and "SchNet 1f1b forces, 7 structures, M=4: gradients (MPI " \
        "backend)" in out, out


def check_families(out: str, ranks: int, families, backend=None) -> None:
    """A tests/mpi/families.py launch on ``ranks`` ranks: each installed family's summary names no failure, ranks
    without atoms occurred from 3 ranks on (lean and full alike hold the clusters on an explicit grid), its faults
    were caught (2 and 3 ranks), ``backend`` "torch" communicated through torch.distributed; the families left out
    for a missing package are skipped (or failed, where the extras are required) after the others are checked."""
    assert not any(f"FAIL {family}:" in out for family in families), out
    absent = []
    for family in families:
        title, planted = FAMILIES[family]
        if missing(FAMILY_PACKAGES[family][0]):
            assert f"skipped: {family}" in out, out
            absent += FAMILY_PACKAGES[family]
            continue
        line = next((line for line in out.splitlines() if line.startswith(f"P={ranks}: {title} ")), None)
        assert line is not None and " 0 failures" in line, out
        if ranks >= 3 and family != "sevennet":  # (SevenNet's structures run on the automatic grid alone)
            assert " 0 (case, rank) with no atoms" not in line, line
        if family == "nequip" and missing("allegro"):
            planted, absent = planted - 1, absent + ["allegro"]
        expected = planted if ranks in (2, 3) else 0
        assert f"faults caught {expected} of {expected};" in line, line
        if backend == "torch":
            assert "communication: torch.distributed gloo" in line, line
    require(*absent)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_distributed_equals_its_packages_calculator(shared, family):
    """Each family in full on 2 ranks (mpiexec, one section of the shared launch for all): every model of its
    fixtures on every geometry (fairchem's second and third on four of them; the first on every grid), chunked and one
    pass, wide mode, the ASE calculator, the halo's faults == its package's own calculator (MACECalculator,
    NequIPCalculator, FAIRChemCalculator, SevenNetCalculator); SevenNet's NEB(parallel=True), an image per rank, ==
    the band with SevenNetCalculator in one process."""
    require(FAMILY_PACKAGES[family][0])
    rc, out = shared(2, "families")
    check_families(out, 2, [family])
    if family == "sevennet":  # ASE's NEB(parallel=True) with ours == the band with SevenNetCalculator
        assert "SevenNet-0 NEB(parallel=True), an image per rank" in out, out
    assert rc == 0 or "FAIL " in out, out  # (a launch that failed without naming a family: every family's test fails)


def test_families_on_three_ranks_grids(shared):
    """MACE, nequip and SevenNet in one section on 3 ranks (mpiexec), each's first model on every geometry and grid
    (the odd grids' several hops, empty ranks), the halo's faults on a 3-rank grid (fairchem's 3-rank grid runs under
    torch.distributed below)."""
    rc, out = shared(3, "families")
    assert rc == 0, out
    check_families(out, 3, ["mace", "nequip", "sevennet"])


@pytest.mark.parametrize("launcher, ranks", [("mpiexec", 4), ("torchrun", 3)])
def test_every_family_on_four_ranks_and_under_torch_distributed(shared, torchrun, launcher, ranks):
    """Every family in one run (each family's first model, every geometry): on 4 ranks on the automatic and the last
    explicit grid (2D grids, empty ranks) and under torch.distributed (torchrun without MPI, gloo) on an odd 3-rank
    grid, the faults planted (the 3-rank MPI launch holds the other grids)."""
    if launcher == "mpiexec":
        rc, out = shared(ranks, "families")
    else:
        rc, out, _ = torchrun(ranks, MPI_DIR / "families.py", "--backend", *FAMILIES)
    assert rc == 0, out
    check_families(out, ranks, FAMILIES, "torch" if launcher == "torchrun" else None)
