"""Make the fairchem fixtures: random-weight checkpoints in the format a user downloads (fairchem's
``MLIPInferenceCheckpoint``: ``model_config``, ``model_state_dict``, ``ema_state_dict``, ``tasks_config``), each
built by fairchem's own constructors from a Hydra config of the shape of a released model, tiny channels:

* ``uma-moe.pt``: a UMA-S-shaped model (``eSCNMDMoeBackbone`` with 4 experts routed by composition, charge,
  spin and task; a dataset-specific mixture-of-experts energy head), tasks omat, omol, oc20; ``model_id``
  UMA-S-1.1.
* ``uma-dense.pt``: the same shape tagged ``UMA-S-1.2`` (its expert routing also depends on the atom count) with
  ``max_neighbors`` 16, so that fcc metals at a 5 Å cutoff (42 neighbours) have their edges cut; one energy head
  shared by its tasks (``DatasetSpecificSingleHeadWrapper``).
* ``esen.pt``: an eSEN-shaped model (``eSCNMDBackbone``, no experts, no task embedding) with a plain
  ``MLP_EFS_Head``; its one task is omat.

The EMA weights (which inference uses) differ from the model weights, so that reading the wrong ones fails.
Every element's reference energy and the normaliser are set, so that their use is checked too.

Run from the project root, in the project's environment with the fairchem extra installed
(``pip install -e .[fairchem]``): ``python tests/data/fairchem/make_fixtures.py``. fairchem-core 2.24.0 made the
committed files.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

HERE = Path(__file__).parent
DATASETS = ["oc20", "omat", "omol"]


def backbone(model: str, **changes) -> dict:
    config = dict(model=model, max_num_elements=100, sphere_channels=16, lmax=2, mmax=2, otf_graph=True,
                  max_neighbors=300, cutoff=5.0, edge_channels=16, distance_function="gaussian",
                  num_distance_basis=32, direct_forces=False, regress_forces=True, regress_stress=True,
                  num_layers=3, hidden_channels=16, norm_type="rms_norm_sh", act_type="gate", ff_type="spectral",
                  chg_spin_emb_type="rand_emb", cs_emb_grad=True, dataset_emb_grad=True, dataset_list=DATASETS,
                  use_dataset_embedding=True, activation_checkpointing=False)
    if config.get("dataset_list") is not None:  # fairchem's current spelling of the same
        config["dataset_mapping"] = {d: d for d in config.pop("dataset_list")}
    config.update(changes)
    return config


def moe(**changes) -> dict:
    return backbone("fairchem.core.models.uma.escn_moe.eSCNMDMoeBackbone", **{
        "num_experts": 4, "use_composition_embedding": True, "moe_layer_type": "pytorch", "model_version": 1.1,
        **changes})


def tasks(datasets, rmsd: float, mean: float, seed: int, prefixed: bool = True) -> list:
    """Energy, forces and stress tasks per dataset, as fairchem's training configs write them."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for dataset in datasets:
        name = f"{dataset}_" if prefixed else ""
        references = (-3.0 * torch.rand(100, generator=generator, dtype=torch.float64)).tolist()
        references[0] = 0.0
        normalizer = {"_target_": "fairchem.core.modules.normalization.normalizer.Normalizer", "mean": mean,
                      "rmsd": rmsd}
        unshifted = dict(normalizer, mean=0.0)
        for prop, level, dim, norm, refs in (("energy", "system", [1], normalizer, references),
                                             ("forces", "atom", [3], unshifted, None),
                                             ("stress", "system", [1, 9], unshifted, None)):
            task = {"_target_": "fairchem.core.units.mlip_unit.mlip_unit.Task", "name": f"{name}{prop}",
                    "level": level, "property": prop, "datasets": [dataset], "normalizer": norm,
                    "out_spec": {"_target_": "fairchem.core.units.mlip_unit.mlip_unit.OutputSpec", "dim": dim,
                                 "dtype": "float32"}}
            if refs is not None:
                task["element_references"] = {
                    "_target_": "fairchem.core.modules.normalization.element_references.ElementReferences",
                    "element_references": {"_target_": "torch.DoubleTensor", "_args_": [refs]}}
            out.append(task)
    return out


def write(name: str, model_config: dict, tasks_config: list, seed: int, directory: Path = HERE) -> Path:
    import hydra

    from fairchem.core.units.mlip_unit.api.inference import MLIPInferenceCheckpoint

    torch.manual_seed(seed)
    model = hydra.utils.instantiate(copy.deepcopy(model_config))
    with torch.no_grad():  # random weights of a trained model's scale (fairchem initialises some at ±0.001)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ema = torch.optim.swa_utils.AveragedModel(model)
    with torch.no_grad():
        for p in ema.module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    checkpoint = MLIPInferenceCheckpoint(model_config=model_config, model_state_dict=model.state_dict(),
                                         ema_state_dict=ema.state_dict(), tasks_config=tasks_config)
    torch.save(checkpoint, Path(directory) / f"{name}.pt")
    print(f"{name}.pt: {sum(p.numel() for p in model.parameters())} parameters")
    return Path(directory) / f"{name}.pt"


def uma_s_sized(directory: Path) -> Path:
    """A random model of UMA-S's published shape (sphere and hidden channels 128, lmax = mmax = 2, 4 layers, 32
    experts, cutoff 6 Å; float32 weights), tasks omat, omol, oc20: the benchmarks' model."""
    config = {"_target_": "fairchem.core.models.base.HydraModel", "pass_through_head_outputs": True,
              "model_id": "UMA-S-1.1",
              "backbone": moe(sphere_channels=128, hidden_channels=128, edge_channels=128, num_distance_basis=64,
                              num_layers=4, num_experts=32, cutoff=6.0),
              "heads": {"energyandforcehead": {
                  "module": "fairchem.core.models.uma.escn_moe.DatasetSpecificMoEWrapper",
                  "head_cls": "fairchem.core.models.uma.escn_md.MLP_EFS_Head",
                  "dataset_mapping": {d: d for d in DATASETS}, "head_kwargs": {"wrap_property": False}}}}
    return write("uma-s-sized", config, tasks(DATASETS, rmsd=1.0, mean=0.0, seed=4), seed=4, directory=directory)


def main() -> None:
    head_mapping = {d: d for d in DATASETS}
    write("uma-moe", {
        "_target_": "fairchem.core.models.base.HydraModel", "pass_through_head_outputs": True, "model_id": "UMA-S-1.1",
        "backbone": moe(),
        "heads": {"energyandforcehead": {
            "module": "fairchem.core.models.uma.escn_moe.DatasetSpecificMoEWrapper",
            "head_cls": "fairchem.core.models.uma.escn_md.MLP_EFS_Head", "dataset_mapping": head_mapping,
            "head_kwargs": {"wrap_property": False}}},
    }, tasks(DATASETS, rmsd=1.3, mean=0.0, seed=1), seed=1)
    write("uma-dense", {
        "_target_": "fairchem.core.models.base.HydraModel", "pass_through_head_outputs": True, "model_id": "UMA-S-1.2",
        "backbone": moe(max_neighbors=16, num_layers=2, ff_type="grid"),
        "heads": {"energyandforcehead": {
            "module": "fairchem.core.models.uma.escn_moe.DatasetSpecificSingleHeadWrapper",
            "head_cls": "fairchem.core.models.uma.escn_md.MLP_EFS_Head", "dataset_names": DATASETS,
            "head_kwargs": {"wrap_property": False}}},
    }, tasks(DATASETS, rmsd=0.8, mean=0.7, seed=2), seed=2)
    write("esen", {
        "_target_": "fairchem.core.models.base.HydraModel", "pass_through_head_outputs": True,
        "backbone": backbone("fairchem.core.models.uma.escn_md.eSCNMDBackbone", use_dataset_embedding=False,
                             dataset_list=None),
        "heads": {"energyandforcehead": {"module": "fairchem.core.models.uma.escn_md.MLP_EFS_Head"}},
    }, tasks(["omat"], rmsd=1.1, mean=0.0, seed=3, prefixed=False), seed=3)


if __name__ == "__main__":
    main()
