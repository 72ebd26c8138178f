"""Model contracts for every potential: symmetry (rotation, translation, permutation, e3nn's own
equivariance check), smoothness at the cutoff, per-species scale/shift, dtypes, safe checkpoints."""
import os
import pickle

import numpy as np
import pytest
import torch
from ase import Atoms

import potentials
from comparison import assert_close
from potentials.graph import AtomGraph
from systems import GEOMETRIES, SPECIES

torch.set_num_threads(1)
ML_MODELS = ["SchNet", "PaiNN", "NequIP"]


def build(name, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    if name == "LennardJones":
        return potentials.LennardJones(epsilon=0.4, sigma=2.3, cutoff=5.0)
    cls = getattr(potentials, name)
    model = cls(SPECIES, cutoff=4.0, features=8, layers=3)
    model.scale_shift.shift.copy_(torch.tensor([-2.1, -3.4]))
    model.scale_shift.scale.copy_(torch.tensor([0.7, 1.3]))
    return model.to(dtype)


def random_rotation(seed):
    q = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))[0]
    return q * np.sign(np.linalg.det(q))  # proper rotation


@pytest.mark.parametrize("name", ML_MODELS)
@pytest.mark.parametrize("geometry", ["sheared", "clusters"])
def test_rotation_translation_permutation(name, geometry):
    model = build(name)
    atoms = GEOMETRIES[geometry]()
    ref = potentials.predict(model, atoms)
    rot = random_rotation(7)
    perm = np.random.default_rng(3).permutation(len(atoms))
    moved = atoms[perm]
    moved.positions = moved.positions @ rot.T + [1.3, -2.2, 0.7]
    if atoms.cell.rank == 3:
        moved.set_cell(atoms.cell[:] @ rot.T, scale_atoms=False)
    out = potentials.predict(model, moved)
    scale = np.abs(ref["forces"]).max()
    assert_close(out["energy"], ref["energy"], 1e-10, scale="each", label="energy")
    assert_close(out["energies"], ref["energies"][perm], 1e-10, label="energies")
    assert_close(out["forces"], ref["forces"][perm] @ rot.T, 1e-10 * scale, scale="absolute", label="forces")
    if "stress" in ref:
        def full(v):
            return np.array([[v[0], v[5], v[4]], [v[5], v[1], v[3]], [v[4], v[3], v[2]]])
        assert_close(full(out["stress"]), rot @ full(ref["stress"]) @ rot.T, 1e-10 * np.abs(ref["stress"]).max(),
                     scale="absolute", label="stress")


def test_nequip_interaction_passes_e3nn_equivariance_check():
    from e3nn.util.test import assert_equivariant

    model = build("NequIP")
    block = model.interactions["1"]
    n, e = 6, 12
    g = torch.Generator().manual_seed(0)
    sender, receiver = torch.randint(0, n, (e,), generator=g), torch.randint(0, n, (e,), generator=g)
    attr = torch.nn.functional.one_hot(torch.randint(0, 2, (n,), generator=g), 2).double()
    radial = torch.rand(e, 8, generator=g, dtype=torch.float64)
    h = model.irreps_hidden.randn(n, -1, dtype=torch.float64)
    vec = torch.randn(e, 3, generator=g, dtype=torch.float64)

    def func(h, vec):
        from e3nn import o3

        graph = AtomGraph(species=torch.zeros(n, dtype=torch.long), edge_index=torch.stack([sender, receiver]),
                          edge_vec=vec, n_local=n)
        return block(h, attr, graph, lambda v: (
            o3.spherical_harmonics(model.irreps_sh, v, normalize=True, normalization="component"), radial))

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # e3nn draws its test rotations in the default dtype
    try:
        assert_equivariant(func, args_in=[h, vec], irreps_in=[model.irreps_hidden, "1o"],
                           irreps_out=[block.linear_out.irreps_out], tolerance=1e-8)
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("name", ML_MODELS)
def test_energy_and_forces_continuous_across_cutoff(name):
    model = build(name)
    rc = model.cutoff

    def dimer(r):
        return Atoms("CuAg", positions=[[0, 0, 0], [r, 0, 0]], pbc=False)

    apart = potentials.predict(model, dimer(rc + 1.0))
    for delta in (1e-3, 1e-5):
        inside = potentials.predict(model, dimer(rc - delta))
        assert_close(inside["energy"], apart["energy"], 1e-4 * (delta / 1e-3) ** 2, scale="absolute",
                     label=f"energy at cutoff - {delta}")
        assert_close(inside["forces"], np.zeros_like(inside["forces"]), 1e-3 * (delta / 1e-3), scale="absolute",
                     label=f"forces at cutoff - {delta}")
    assert np.abs(apart["forces"]).max() == 0.0


@pytest.mark.parametrize("name", ML_MODELS)
def test_per_species_scale_and_shift(name):
    model = build(name)
    atoms = GEOMETRIES["fcc_bulk"]()
    before = potentials.predict(model, atoms)["energies"]
    model.scale_shift.shift.add_(torch.tensor([1.0, 0.5], dtype=torch.float64))
    after = potentials.predict(model, atoms)["energies"]
    assert_close(after - before, np.where(atoms.numbers == 47, 1.0, 0.5), 1e-12, scale="absolute", label="shift")


@pytest.mark.parametrize("name", ML_MODELS)
def test_float32_matches_float64(name):
    atoms = GEOMETRIES["hcp_triclinic"]()
    e64 = potentials.predict(build(name, torch.float64), atoms)
    e32 = potentials.predict(build(name, torch.float32), atoms)
    assert_close(e32["energy"], e64["energy"], 1e-5, scale="each", label="energy")
    assert_close(e32["forces"], e64["forces"], 1e-4, label="forces")


def test_schnet_blocks_are_torch_geometrics():
    """SchNet's interaction blocks and shifted softplus (potentials.schnet) are torch-geometric's as parameter
    holders: from the same seed the same state-dict keys and weights bit for bit (so every SchNet checkpoint loads and
    a seed builds the same model as before), and the same buffers of the Gaussian basis; a SchNet made of
    torch-geometric's blocks gives the same energy and forces; no torch_geometric import in a process that runs SchNet
    and PaiNN."""
    import subprocess
    import sys

    from torch_geometric.nn.models import schnet as pyg

    from potentials.radial import GaussianBasis
    from potentials.schnet import InteractionBlock, ShiftedSoftplus

    for args in ((64, 50, 64, 5.0), (16, 8, 24, 4.0)):
        torch.manual_seed(7)
        ours = InteractionBlock(*args).state_dict()
        torch.manual_seed(7)
        theirs = pyg.InteractionBlock(*args).state_dict()
        assert list(ours) == list(theirs), (list(ours), list(theirs))
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), args
    x = torch.linspace(-30, 30, 101, dtype=torch.float64)
    assert torch.equal(ShiftedSoftplus()(x), pyg.ShiftedSoftplus()(x))
    basis, smearing = GaussianBasis(0.0, 4.5, 50), pyg.GaussianSmearing(0.0, 4.5, 50)
    assert basis.coeff == smearing.coeff and torch.equal(basis.offset, smearing.offset)

    model = potentials.SchNet(["Cu", "Ag"], cutoff=4.5, features=16, layers=2, seed=3).double()
    atoms = GEOMETRIES["hcp_triclinic"]()
    atoms.numbers[::2] = 47
    ours = potentials.predict(model, atoms)
    for k, block in model.interactions.items():  # the same weights in torch-geometric's own modules
        theirs = pyg.InteractionBlock(16, 50, 16, 4.5).double()
        theirs.load_state_dict(block.state_dict())
        model.interactions[k] = theirs
    assert_close(potentials.predict(model, atoms)["forces"], ours["forces"], 0.0, label="torch-geometric's blocks")
    code = ("import sys, potentials, mlip_parallel, ase.build; m = potentials.SchNet(['Cu'], cutoff=4.0); "
            "potentials.PaiNN(['Cu'], cutoff=4.0); mlip_parallel.evaluate(m, ase.build.bulk('Cu', cubic=True)); "
            "print(sorted(k for k in sys.modules if k.startswith(('torch_geometric', 'torch._dynamo')))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_gaussian_basis_equals_torch_geometric_smearing():
    """SchNet's exp2-evaluated Gaussians equal torch-geometric's exp ones, with their r-derivatives (the
    force path), to float rounding, in float32 and float64, on distances past the cutoff too."""
    from torch_geometric.nn.models.schnet import GaussianSmearing

    from potentials.radial import GaussianBasis
    for dtype, tol in ((torch.float32, 2e-6), (torch.float64, 1e-14)):
        ours, theirs = GaussianBasis(0.0, 4.5, 50).to(dtype), GaussianSmearing(0.0, 4.5, 50).to(dtype)
        r = torch.linspace(0.5, 6.0, 2001, dtype=dtype, requires_grad=True)
        a, b = ours(r), theirs(r)
        assert a.shape == b.shape == (2001, 50) and a.dtype == dtype
        assert_close(a, b, tol, scale="absolute", label=f"{dtype} basis")
        assert ((a - b).abs() <= 64 * tol * b.abs() + 1e-37).all()
        seed = torch.linspace(-1, 1, a.numel(), dtype=dtype).reshape(a.shape)
        da, db = (torch.autograd.grad(x, r, seed)[0] for x in (a, b))
        assert_close(da, db, 10 * tol, label=f"{dtype} basis derivative")
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["offset"]  # checkpoints read as before


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", ["LennardJones"] + ML_MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_checkpoint_round_trip(tmp_path, name, dtype):
    model = build(name, dtype, seed=5)
    path = tmp_path / "model.pt"
    potentials.save(model, path)
    loaded = potentials.load(path)
    assert type(loaded) is type(model) and loaded.dtype == model.dtype
    state, back = model.state_dict(), loaded.state_dict()
    assert state.keys() == back.keys() and all(torch.equal(state[k], back[k]) for k in state)  # bit for bit
    atoms = GEOMETRIES["sheared"]()
    a, b = potentials.predict(model, atoms), potentials.predict(loaded, atoms)
    # the same weights; predictions agree to the dtype's rounding (a multi-threaded index_add in float32
    # does not sum in a fixed order, so two calls of one model may differ in the last bits)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    assert_close(b, a, tolerance, label="loaded")


@pytest.mark.parametrize("name", ML_MODELS)
def test_save_parts_writes_save_s_checkpoint_one_tensor_at_a_time(tmp_path, name):
    """potentials.save_parts (a pipeline's merged checkpoint): entries given one at a time in any order give
    the weights potentials.save writes, bit for bit, in a zip archive whose CRC-32s check; a wrong or
    missing entry is refused by name."""
    import random
    import zipfile

    model = build(name, torch.float64, seed=3)
    state = model.state_dict()
    layout = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    order = list(state.items())
    random.Random(0).shuffle(order)
    given = []

    def tensors():  # as a pipeline's rank 0 receives them: one at a time, each dropped once written
        for key, value in order:
            given.append(key)
            yield key, value.clone()
    potentials.save_parts(model, tmp_path / "parts.pt", layout, tensors(), extra={"epoch": 7})
    potentials.save(model, tmp_path / "whole.pt")
    assert given == [k for k, _ in order]
    parts, whole = potentials.load(tmp_path / "parts.pt"), potentials.load(tmp_path / "whole.pt")
    assert all(torch.equal(parts.state_dict()[k], whole.state_dict()[k]) for k in state)
    assert torch.load(tmp_path / "parts.pt", weights_only=True)["epoch"] == 7
    with zipfile.ZipFile(tmp_path / "parts.pt") as archive:
        assert archive.testzip() is None  # every record's CRC-32 matches its bytes
    assert not list(tmp_path.glob(".*partial"))

    key, value = order[0]
    wrong = [(key, value.to(torch.float32))] + order[1:]
    with pytest.raises(potentials.CheckpointError, match=f"{key}.*float32.*layout says"):
        potentials.save_parts(model, tmp_path / "bad.pt", layout, iter(wrong))
    with pytest.raises(potentials.CheckpointError, match="no tensor given for"):
        potentials.save_parts(model, tmp_path / "bad.pt", layout, iter(order[1:]))
    with pytest.raises(potentials.CheckpointError, match="given twice"):
        potentials.save_parts(model, tmp_path / "bad.pt", layout, iter(order + order[:1]))
    without = {k: v for k, v in layout.items() if model.part_of(k) != "readout"}
    with pytest.raises(potentials.CheckpointError, match="no piece holds the parts.*readout"):
        potentials.save_parts(model, tmp_path / "bad.pt", without, iter(order))
    assert not (tmp_path / "bad.pt").exists() and not list(tmp_path.glob(".*partial"))


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('EXPLOIT_MARKER', '/tmp/exploit')}",))


def test_bad_checkpoints_raise_and_never_run_code(tmp_path, monkeypatch):
    good = tmp_path / "good.pt"
    potentials.save(build("SchNet"), good)
    data = good.read_bytes()

    def check(path, pattern):
        with pytest.raises(potentials.CheckpointError, match=pattern):
            potentials.load(path)

    check(tmp_path / "missing.pt", "no such checkpoint")
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    check(tmp_path / "truncated.pt", "truncated or corrupt")
    (tmp_path / "garbage.pt").write_bytes(os.urandom(4096))
    check(tmp_path / "garbage.pt", "truncated or corrupt")

    marker = tmp_path / "pwned"
    monkeypatch.setenv("EXPLOIT_MARKER", str(marker))
    with open(tmp_path / "exploit.pt", "wb") as f:
        pickle.dump({"config": "{}", "state_dict": _Exploit()}, f)
    check(tmp_path / "exploit.pt", "pickled|truncated or corrupt")
    torch.save({"config": "{}", "state_dict": _Exploit()}, tmp_path / "exploit_zip.pt")
    check(tmp_path / "exploit_zip.pt", "pickled")
    torch.save(build("PaiNN"), tmp_path / "module.pt")  # a whole pickled module
    check(tmp_path / "module.pt", "pickled")
    assert not marker.exists(), "loading a checkpoint executed code"

    payload = torch.load(good, weights_only=True)
    import json

    def variant(name, **changes):
        config = json.loads(payload["config"])
        config.update(changes)
        torch.save({"config": json.dumps(config), "state_dict": payload["state_dict"]}, tmp_path / name)
        return tmp_path / name

    check(variant("other_class.pt", **{"class": "PaiNN"}), "do not fit a PaiNN|do not build a PaiNN")
    check(variant("unknown_class.pt", **{"class": "Allegro"}), "unknown model class 'Allegro'")
    check(variant("future.pt", version=99), "version 99")
    check(variant("format.pt", format="something-else"), "format 'something-else'")
    torch.save({"weights": payload["state_dict"]}, tmp_path / "keys.pt")
    check(tmp_path / "keys.pt", "not an mlip-parallel-potential checkpoint")


def test_nequip_deep_copy_is_the_same_model():
    """An EMA copy (deepcopy) of NequIP with l_max = 3 has the same state and weights (e3nn's generated
    code would otherwise bring back extra buffers), also for a model holding only some parts."""
    import copy

    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    for parts in (None, potentials.stage_parts(3, [0, 1, 3], 1)):
        model = potentials.NequIP(["Cu"], cutoff=4.0, l_max=3, features=2, layers=3, seed=1, parts=parts).double()
        twin = copy.deepcopy(model)
        assert twin.state_dict().keys() == model.state_dict().keys() and twin.parts == model.parts
        assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), model.state_dict().values()))
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        ema.update_parameters(model)
        assert ema.module.dtype == torch.float64
