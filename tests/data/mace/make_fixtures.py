"""Make the MACE fixtures of the test suite: random-weight MACE models saved as MACE saves them
(``torch.save(model)``, a ``.model`` pickle) under mace-torch's own pinned e3nn 0.4.4, and MACE's own
``MACECalculator`` results for them on the suite's geometries (the oracle of potentials.MACE).

Run it in a separate venv (mace-torch pins e3nn==0.4.4; the project's environment has e3nn >= 0.6):

    python3 -m venv /tmp/venv-mace && . /tmp/venv-mace/bin/activate
    pip install torch==2.13.0 mace-torch==0.3.16     # brings e3nn 0.4.4
    python tests/data/mace/make_fixtures.py          # writes tests/data/mace/*.model and *.npz

Each model is written with its references: ``NAME.model`` and ``NAME.npz``, whose keys are
``GEOMETRY/numbers|positions|cell|pbc`` (the structure, as evaluated) and ``GEOMETRY/HEAD/energy|forces|
stress|virial``: MACECalculator's energy, forces and (cells periodic in three dimensions) stress, and
the model's own virial output (structures with a cell, slabs included: MACE's calculator divides a
slab's virial by a volume of its own). The CI does not run this script.
"""
from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")
os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"  # e3nn 0.4.4 reads its constants with a pre-2.6 torch.load
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "..", "..")]  # tests/systems.py: the geometries

import e3nn  # noqa: E402
from e3nn import o3  # noqa: E402
from mace import modules  # noqa: E402
from mace.calculators import MACECalculator  # noqa: E402

from systems import GEOMETRIES  # noqa: E402

Z = [29, 47]  # Cu, Ag (the suite's species)


def build(name: str, dtype, seed: int, interaction_first: str, interaction: str, hidden: str, max_ell: int,
          correlation: int, heads=None, pair_repulsion=False, r_max=4.5, num_interactions=2, **extra):
    torch.set_default_dtype(dtype)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    heads = heads or ["Default"]
    n_heads = len(heads)
    energies = rng.uniform(-4.0, -2.0, size=(n_heads, len(Z)))
    model = modules.ScaleShiftMACE(
        r_max=r_max, num_bessel=8, num_polynomial_cutoff=5, max_ell=max_ell,
        interaction_cls=modules.interaction_classes[interaction],
        interaction_cls_first=modules.interaction_classes[interaction_first],
        num_interactions=num_interactions, num_elements=len(Z), hidden_irreps=o3.Irreps(hidden),
        MLP_irreps=o3.Irreps("16x0e"), gate=torch.nn.functional.silu,
        atomic_energies=energies if n_heads > 1 else energies[0], avg_num_neighbors=18.0, atomic_numbers=Z,
        correlation=correlation, pair_repulsion=pair_repulsion, radial_MLP=[16, 16], heads=heads,
        atomic_inter_scale=rng.uniform(0.8, 1.5, n_heads).tolist() if n_heads > 1 else 1.3,
        atomic_inter_shift=rng.uniform(-0.2, 0.2, n_heads).tolist() if n_heads > 1 else 0.05, **extra)
    with torch.no_grad():  # every weight away from its initial value (some start at zero)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    path = os.path.join(HERE, f"{name}.model")
    torch.save(model, path)
    return path, heads


FIXTURES = {
    # L = 2 hidden irreps, max_ell 3, correlation 2 then 3, ZBL pair repulsion; MACE-MP-0's block classes.
    # (Correlation 3 on the L = 2 product with max_ell 3 would store 16 MB of U matrices: too large to commit.)
    "mace-zbl-f64": dict(dtype=torch.float64, seed=1, interaction_first="RealAgnosticInteractionBlock",
                         interaction="RealAgnosticResidualInteractionBlock", hidden="6x0e+6x1o+6x2e",
                         max_ell=3, correlation=[2, 3], pair_repulsion=True),
    # two heads; density-normalised blocks (another interaction class); L = 2, max_ell 2, correlation 3
    "mace-heads-f64": dict(dtype=torch.float64, seed=2, interaction_first="RealAgnosticDensityInteractionBlock",
                           interaction="RealAgnosticDensityResidualInteractionBlock", hidden="6x0e+6x1o+6x2e",
                           max_ell=2, correlation=3, heads=["pbe", "default"]),
    # MACE-MP-0 small's shape (scalars only, max_ell 3), float32, three interactions
    "mace-small-f32": dict(dtype=torch.float32, seed=3, interaction_first="RealAgnosticResidualInteractionBlock",
                           interaction="RealAgnosticResidualInteractionBlock", hidden="16x0e", max_ell=3,
                           correlation=3, num_interactions=3, r_max=5.0),
}


def virial(path: str, atoms, head: str, heads, dtype) -> np.ndarray:
    """MACE's own virial (-dE/dstrain, eV) from the model's ``virials`` output on MACE's own graph:
    the quantity to compare where MACE's calculator's stress divides by a volume of its own (a slab's
    non-periodic cell vector is replaced by a long one before the neighbour search)."""
    from mace import data
    from mace.tools import AtomicNumberTable, torch_geometric

    model = torch.load(path, weights_only=False)
    torch.set_default_dtype(dtype)
    graph = data.AtomicData.from_config(data.config_from_atoms(atoms, head_name=head), z_table=AtomicNumberTable(Z),
                                        cutoff=float(model.r_max), heads=heads)
    batch = next(iter(torch_geometric.dataloader.DataLoader([graph], batch_size=1))).to_dict()
    return model(batch, compute_virials=True)["virials"][0].detach().numpy()


def references(path: str, heads, dtype) -> dict:
    out = {}
    for geometry, make in GEOMETRIES.items():
        atoms = make()
        out[f"{geometry}/numbers"] = atoms.numbers
        out[f"{geometry}/positions"] = atoms.positions
        out[f"{geometry}/cell"] = np.asarray(atoms.cell[:])
        out[f"{geometry}/pbc"] = atoms.pbc
        for head in heads:
            atoms.calc = MACECalculator(model_paths=path, device="cpu", default_dtype=str(dtype).split(".")[1],
                                        head=head)
            out[f"{geometry}/{head}/energy"] = atoms.get_potential_energy()
            out[f"{geometry}/{head}/forces"] = atoms.get_forces()
            if atoms.pbc.all():
                out[f"{geometry}/{head}/stress"] = atoms.get_stress()
            if atoms.cell.rank == 3:
                out[f"{geometry}/{head}/virial"] = virial(path, atoms, head, heads, dtype)
    return out


def main():
    print(f"e3nn {e3nn.__version__}, torch {torch.__version__}")
    for name, spec in FIXTURES.items():
        path, heads = build(name, **spec)
        np.savez(os.path.join(HERE, f"{name}.npz"), **references(path, heads, spec["dtype"]),
                 e3nn_version=e3nn.__version__, heads=np.array(heads))
        print(f"{name}: {os.path.getsize(path) / 1e3:.0f} kB, heads {heads}")


if __name__ == "__main__":
    main()
