"""Adapter: a fairchem (fairchem-core) UMA or eSEN checkpoint as a potentials model (``pip install -e .[fairchem]``).

The checkpoint is the file a user downloads and fairchem's ``load_predict_unit`` reads: an
``MLIPInferenceCheckpoint`` (``model_config``, ``model_state_dict``, ``ema_state_dict``, ``tasks_config``). It is
read without running its pickle (``pickled.read_module_tree``); the model is built by fairchem's own constructors
from its config (only fairchem's backbones and energy heads are accepted: a config naming other code is refused) and
given the EMA weights, as inference uses them.

The forward is the backbone's (``eSCNMDBackbone.forward``) written over our graph, with fairchem's own modules
for every step: the charge/spin/task embedding, the atom embedding, the edge-degree embedding, and per block
``norm_1``, the edge step (``Edgewise.forward_chunk``: Wigner rotation, SO(2) convolutions, gate), ``norm_2`` and
``atom_wise``; then the final norm and the energy head's ``energy_block``. The halo goes where fairchem's own graph
parallelism gathers: on the node embeddings entering each block's edge step, so ghosts lie within one cutoff. Both
edge steps (the edge-degree embedding's and each block's) run as ``messages.edge_sum``: in chunks recomputed in the
backward within the memory budget (fairchem's own activation checkpointing, with the project's automatic budget).

What is not local is made global exactly: the mixture-of-experts coefficients (UMA) come from the whole system's
composition (``AtomGraph.total`` of the owned atoms' element counts, then the backbone's own
``set_MOLE_coefficients`` on that composition, so UMA-S-1.2's atom-count-dependent routing is its own); charge,
spin and task are per-system constants (charge and spin each structure's own where the graph's ``system`` gives them:
training data); the task's normaliser and element references are applied as
``MLIPPredictUnit`` applies them (energy × rmsd + mean, plus each atom's reference energy); the
``max_neighbors`` truncation is fairchem's rule (``get_max_neighbors_mask``) applied per receiver, which holds
all its edges.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import types

import numpy as np
import torch
from ase.data import chemical_symbols

from ..base import BlockPotential, PackageModel, held_blocks
from ..errors import MLIPError
from ..exchange import default_dtype
from ..files import atomic_write
from ..graph import SYSTEM_RANGES, AtomGraph
from ..messages import edge_sum
from ..pickled import Pickled, PickleFileError, read_deferred, read_module_tree
from ..plain import decode, encode
from ..process import process_kept

# fairchem-core versions whose internals (block modules, Wigner helpers, MOLE globals) this adapter was proved on
KNOWN_VERSIONS = ("2.24",)
HYDRA_MODEL = "fairchem.core.models.base.HydraModel"
BACKBONES = {"escnmd_backbone": "eSCNMDBackbone", "fairchem.core.models.uma.escn_md.eSCNMDBackbone": "eSCNMDBackbone",
             "escnmd_moe_backbone": "eSCNMDMoeBackbone",
             "fairchem.core.models.uma.escn_moe.eSCNMDMoeBackbone": "eSCNMDMoeBackbone"}
ENERGY_HEAD = "fairchem.core.models.uma.escn_md.MLP_EFS_Head"
HEAD_WRAPPERS = ("fairchem.core.models.uma.escn_moe.DatasetSpecificMoEWrapper",
                 "fairchem.core.models.uma.escn_moe.DatasetSpecificSingleHeadWrapper")
CHARGED_TASKS = ("omol",)   # the tasks whose embedding reads the system's charge and spin multiplicity
DEFAULT_SPIN = {"omol": 1}  # FAIRChemCalculator's defaults (validate_uma_atoms_data): charge 0, spin 1 for omol
# fairchem's degeneracy tolerance of the max_neighbors cut (Å², on squared distances: get_max_neighbors_mask)
DEGENERACY_TOLERANCE = 0.01


class FAIRChemModelError(MLIPError, ValueError):
    """A fairchem checkpoint that cannot be run: not fairchem's, a task it does not have, an architecture or
    fairchem version this adapter does not know, charge/spin where the task takes none."""


def fairchem_version() -> str:
    """The installed fairchem-core's version; ImportError naming the extra when it is not installed, and
    FAIRChemModelError for a version outside ``KNOWN_VERSIONS`` (its internals may differ: never a wrong answer)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("fairchem-core")
    except PackageNotFoundError:
        raise ImportError("fairchem models need fairchem-core: pip install -e .[fairchem]") from None
    if ".".join(found.split(".")[:2]) not in KNOWN_VERSIONS:
        raise FAIRChemModelError(f"fairchem-core {found} is installed; this adapter knows fairchem-core "
                                 f"{', '.join(v + '.x' for v in KNOWN_VERSIONS)} (it runs fairchem's internal modules): "
                                 f"pip install -e .[fairchem]")
    return found


# what fairchem's import prints itself, from C, on a machine without a CUDA driver (NVIDIA Warp, a dependency)
IMPORT_NOISE = ("Warp CUDA warning: Could not find or load the NVIDIA CUDA driver",)


def import_fairchem() -> None:
    """Import the fairchem modules the adapter uses (once; ~4 s), keeping what they print at import out of the user's
    output: the process's stdout and stderr (file descriptors, where C code writes) are captured meanwhile and
    written back without the lines of ``IMPORT_NOISE``."""
    import os
    import sys
    import tempfile
    import warnings

    if "fairchem.core.models.base" in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile(mode="w+b") as captured:
        try:
            for fd in saved:
                os.dup2(captured.fileno(), fd)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import fairchem.core.models.base  # noqa: F401
                import fairchem.core.models.uma.escn_moe  # noqa: F401
                import fairchem.core.units.mlip_unit.utils  # noqa: F401
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(IMPORT_NOISE)]
            sys.stderr.write("".join(kept))


def read_checkpoint(path) -> dict:
    """{"model_config", "ema_state_dict", "tasks_config"} of a fairchem inference checkpoint, read without running its
    pickle; the EMA state dict's tensors not read yet (``pickled.Deferred``: ``read_weights`` reads those a model
    holds; its model state dict is never read). FAIRChemModelError when the file is not one (PickleFileError: not a
    torch archive at all)."""
    tree = read_module_tree(path, deferred=True)
    kind = type(tree).path if isinstance(tree, Pickled) else type(tree).__name__
    if not kind.endswith("MLIPInferenceCheckpoint"):
        raise FAIRChemModelError(f"{path} is not a fairchem checkpoint (an MLIPInferenceCheckpoint, as fairchem's "
                                 f"load_predict_unit reads): it holds a {kind}")
    fields = tree._fields()
    missing = [k for k in ("model_config", "ema_state_dict", "tasks_config") if not fields.get(k)]
    if missing:
        raise FAIRChemModelError(f"{path}: the fairchem checkpoint has no {', '.join(missing)}")
    if not isinstance(fields["ema_state_dict"], dict):
        raise FAIRChemModelError(f"{path}: its ema_state_dict is a {type(fields['ema_state_dict']).__name__}, not a "
                                 f"state dict")
    configs = read_deferred(path, {k: fields[k] for k in ("model_config", "tasks_config")})
    for key, value in configs.items():
        _plain(value, f"{path}: {key}")
    return dict(configs, ema_state_dict=fields["ema_state_dict"])


def read_weights(path, deferred: dict, blocks=None) -> dict:
    """The tensors of ``deferred`` (``read_checkpoint``'s EMA state dict) read from ``path``: every one, or with
    ``blocks`` (block indices) those of the backbone's blocks not listed left out, unread."""
    def wanted(key: str) -> bool:
        match = BLOCK_KEY.search(key)
        return blocks is None or match is None or int(match.group(1)) in blocks

    return read_deferred(path, {k: v for k, v in deferred.items() if wanted(k)})


BLOCK_KEY = re.compile(r"(?:^|\.)backbone\.blocks\.(\d+)\.")  # a state-dict key of the backbone's block k


def _plain(value, where: str) -> None:
    """FAIRChemModelError unless ``value`` is plain data (dicts, lists, numbers, strings, tensors)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _plain(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for k, v in enumerate(value):
            _plain(v, f"{where}[{k}]")
    elif not (value is None or isinstance(value, (bool, int, float, str, torch.Tensor))):
        raise FAIRChemModelError(f"{where} is a {type(value).__name__}, not plain configuration data")


def _floats(value, where: str) -> np.ndarray:
    """A config's numbers (a float, a list, a tensor, or hydra's {"_target_": "torch.DoubleTensor", "_args_": [list]})."""
    if isinstance(value, dict):
        if value.get("_target_") not in ("torch.DoubleTensor", "torch.FloatTensor", "torch.Tensor", "torch.tensor") \
                or len(value.get("_args_", ())) != 1:
            raise FAIRChemModelError(f"{where}: numbers written as {value.get('_target_')!r}, which this adapter does "
                                     f"not read")
        value = value["_args_"][0]
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().double().numpy()
    return np.asarray(value, dtype=np.float64)


class TaskOutputs:
    """What ``MLIPPredictUnit`` applies to a task's raw energy: energy × ``rmsd`` + ``mean`` + Σ references[Z_i]."""

    def __init__(self, tasks_config: list, task: str | None, where: str):
        energy = {}
        for config in tasks_config:
            if config.get("property") == "energy":
                for dataset in config.get("datasets") or ():
                    energy[dataset] = config
        known = sorted(energy)
        if task is None:
            if len(known) != 1:
                raise FAIRChemModelError(f"{where}: name a task (task: ...); the checkpoint's tasks are {known}")
            task = known[0]
        if task not in energy:
            raise FAIRChemModelError(f"{where}: no task {task!r}; the checkpoint's tasks are {known}")
        self.task = task
        self.properties = ["energy"] + [c["property"] for c in tasks_config if c.get("property") in ("forces", "stress")
                                        and task in (c.get("datasets") or ())]  # what fairchem reports for it
        self.mean, self.rmsd = self._normaliser(energy[task], where)
        refs = (energy[task].get("element_references") or {}).get("element_references")
        self.references = None if refs is None else _floats(refs, f"{where}: {task} element references")
        for config in tasks_config:  # forces and stress are derivatives of the energy: the same scale, no offset
            if config.get("property") in ("forces", "stress") and task in (config.get("datasets") or ()):
                mean, rmsd = self._normaliser(config, where)
                if mean != 0.0 or rmsd != self.rmsd:
                    raise FAIRChemModelError(
                        f"{where}: the {config['name']} task's normaliser (mean {mean}, rmsd {rmsd}) is not the energy's "
                        f"scale (rmsd {self.rmsd}, no offset): its {config['property']} are not derivatives of the energy")

    @staticmethod
    def _normaliser(config: dict, where: str) -> tuple:
        normaliser = config.get("normalizer") or {}
        mean = float(_floats(normaliser.get("mean", 0.0), where))
        rmsd = float(_floats(normaliser.get("rmsd", normaliser.get("std", 1.0)), where))
        return mean, rmsd


def _check_config(config: dict, where: str) -> dict:
    """The model config with the inference settings MLIPPredictUnit applies; FAIRChemModelError for a config naming
    code other than fairchem's backbones and energy heads, or an architecture this adapter does not run."""
    if not isinstance(config, dict) or config.get("_target_") != HYDRA_MODEL:
        raise FAIRChemModelError(f"{where}: the model config builds {config.get('_target_') if isinstance(config, dict) else config!r}, "
                                 f"not fairchem's {HYDRA_MODEL}")
    if config.get("finetune_config") is not None:
        raise FAIRChemModelError(f"{where}: the model config loads another checkpoint (finetune_config); run the "
                                 f"checkpoint fairchem wrote after fine-tuning")
    backbone = dict(config.get("backbone") or {})
    if backbone.get("model") not in BACKBONES:
        raise FAIRChemModelError(f"{where}: backbone {backbone.get('model')!r}: this adapter runs fairchem's UMA and eSEN "
                                 f"backbones ({', '.join(sorted(set(BACKBONES.values())))})")
    if backbone.get("direct_forces", True):
        raise FAIRChemModelError(f"{where}: a direct-force model (forces not the energy's gradient) cannot run "
                                 f"decomposed; this adapter runs conservative models")
    if backbone.get("charge_balanced_channels") or backbone.get("spin_balanced_channels"):
        raise FAIRChemModelError(f"{where}: charge/spin-balanced channels are not supported")
    heads = config.get("heads") or {}
    for name, head in heads.items():
        module = head.get("module")
        if module in HEAD_WRAPPERS:
            if head.get("head_cls") != ENERGY_HEAD or (head.get("head_kwargs") or {}).get("reduce", "sum") != "sum":
                raise FAIRChemModelError(f"{where}: head {name} wraps {head.get('head_cls')!r}; this adapter runs "
                                         f"{ENERGY_HEAD} summing atom energies")
        elif module != ENERGY_HEAD or head.get("reduce", "sum") != "sum":
            raise FAIRChemModelError(f"{where}: head {name} is {module!r}; this adapter runs {ENERGY_HEAD} (summing "
                                     f"atom energies), bare or in {' / '.join(w.rsplit('.', 1)[1] for w in HEAD_WRAPPERS)}")
    if len(heads) != 1:
        raise FAIRChemModelError(f"{where}: {len(heads)} heads; this adapter runs models with one energy head")
    backbone.update(always_use_pbc=False, activation_checkpointing=False, execution_mode="general", otf_graph=True)
    return dict(config, backbone=backbone)


class FAIRChem(PackageModel, BlockPotential):
    """A fairchem UMA or eSEN model (``checkpoint``: the file ``load_predict_unit`` reads) on one ``task`` (as
    FAIRChemCalculator's ``task_name``: omat, omol, oc20, odac, omc; None when the checkpoint has one). ``charge``
    (e) and ``spin`` (multiplicity) of the system for the omol task (defaults 0 and 1, as FAIRChemCalculator's);
    refused for the others. A graph's per-structure ``system`` values (``atoms.info``'s) replace them for the omol
    task, as fairchem reads them for omol data; the other tasks ignore them. ``dtype``: float32 (fairchem's default
    precision) or float64; the weights are the checkpoint's EMA weights. Or ``architecture`` ({"model_config",
    "tasks_config"} in ``plain.encode``'s JSON form) instead of a checkpoint: built by fairchem's constructors with untrained weights, for a state dict to be loaded
    into it. Trainable (``mlip-train``): every HydraModel parameter by fairchem's name, the task's element references,
    written back as fairchem's ``inference_ckpt.pt``; in a graph of several structures (a training batch) each
    structure's experts are routed by its own composition, as fairchem routes a batch's systems.

    As a ``BlockPotential`` (pipeline stages): "embed" is the atom and edge-degree embeddings, "block.k" the
    backbone's block k, "readout" the final norm and the energy head; the node embeddings [rows, (lmax+1)² C] travel
    between stages. The system embeddings (charge, spin, task), the experts' routing and the edges' sender/receiver
    embeddings are read by every part: every stage holds them and computes the coefficients per structure itself
    (their gradients summed over the stages). ``parts``: the parts this model holds (a stage's: the checkpoint is
    read whole, the others then dropped); ``seed`` is unused (the weights are the checkpoint's)."""

    # edges per chunk at least, whatever the budget: at UMA-S's size 1,024-edge chunks ran 5 % faster than 256-edge ones
    # (benchmarks/fairchem_scaling.py), their ~25 MB small beside the per-atom state of a system worth splitting
    MIN_CHUNK_EDGES = 1024

    def __init__(self, checkpoint: str | None = None, task: str | None = None, charge: int | None = None,
                 spin: int | None = None, dtype: torch.dtype | None = None, architecture: dict | None = None,
                 parts=None, seed: int = 0):
        if (checkpoint is None) == (architecture is None):
            raise TypeError("FAIRChem takes a checkpoint or an architecture, one of the two")
        fairchem_version()
        dtype = torch.float32 if dtype is None else dtype
        if architecture is not None:
            where, saved = "the checkpoint's fairchem architecture", dict(decode(architecture), ema_state_dict=None)
        else:
            where, saved = str(checkpoint), read_checkpoint(checkpoint)
            architecture = {key: encode(saved[key], key) for key in ("model_config", "tasks_config")}
        config = _check_config(saved["model_config"], where)
        outputs = TaskOutputs(saved["tasks_config"], task, where)
        if outputs.task not in CHARGED_TASKS and (charge is not None or spin is not None):
            raise FAIRChemModelError(f"charge and spin are read by the {', '.join(CHARGED_TASKS)} task; task "
                                     f"{outputs.task!r} takes none")
        charge = 0 if charge is None else charge
        spin = DEFAULT_SPIN.get(outputs.task, 0) if spin is None else spin
        for name, value in (("charge", charge), ("spin", spin)):
            low, high = SYSTEM_RANGES[name]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
                raise FAIRChemModelError(f"{name} must be an integer in [{low}, {high}] (fairchem's range), got "
                                         f"{value!r}")
        elements = int(config["backbone"].get("max_num_elements", 100))
        super().__init__([chemical_symbols[z] for z in range(1, min(elements, len(chemical_symbols)))])

        blocks = None if parts is None else held_blocks(parts)
        with process_kept(random=True, warning_filters=True):  # what fairchem's import and construction set
            self.hydra = self._build(config, saved["ema_state_dict"], dtype, where, checkpoint, blocks)
        # what fairchem's constructors leave fixed (e.g. a dataset embedding built with enable_grad False) never trains
        self._fixed = frozenset(name for name, p in self.hydra.named_parameters() if not p.requires_grad)
        _mix_experts_once(self.backbone)
        self.register_buffer("numbers", torch.arange(1, len(self.species) + 1), persistent=False)
        self.task = self.dataset = outputs.task
        self.charge, self.spin = int(charge), int(spin)
        self._where = where
        self.cutoff = float(self.backbone.cutoff)
        self.layers = int(self.backbone.num_layers) + 1  # the edge-degree embedding reads one cutoff more
        self.max_neighbors = int(self.backbone.max_neighbors)
        self.experts = int(getattr(self.backbone, "num_experts", 0) or 0)
        self.rmsd, self.mean = outputs.rmsd, outputs.mean
        self.outputs = outputs.properties
        refs = np.zeros(len(self.species) + 1) if outputs.references is None else outputs.references
        refs = np.concatenate([refs, np.zeros(max(0, len(self.species) + 1 - len(refs)))])
        self.element_references = torch.as_tensor(refs, dtype=torch.float64)  # eV, by atomic number (kept float64)
        self.hyperparameters = {"architecture": architecture, "task": self.task,
                                **({"charge": self.charge, "spin": self.spin} if self.task in CHARGED_TASKS else {})}
        self._init_parts(parts, seed)
        self._drop_parts_not_held()
        self.requires_grad_(False)
        self.eval()
        self.to(dtype)

    @property
    def package_module(self):
        """fairchem's HydraModel: its backbone and its energy head."""
        return self.hydra

    @property
    def backbone(self):
        return self.hydra.backbone

    @property
    def head(self):
        return next(iter(self.hydra.output_heads.values()))

    # ------------------------------------------------------------------ memory model
    # per row: node features [(lmax+1)^2, C] kept for the backward, FEATURE_COPIES per block (its input, norms,
    # residual, halo, atom-wise step) and a few more (11.5 copies measured for 3 blocks); per edge in chunks its
    # vector and indices; every edge at once adds its Wigner matrices and both SO(2) convolutions' tensors
    # (``one_pass_costs``)
    FEATURE_COPIES_PER_BLOCK, FEATURE_COPIES = 4, 4
    EVALUATION_BYTES_PER_EDGE = 200

    def evaluation_bytes(self, rows: float, edges: float, chunked: bool = True) -> float:
        features = self.feature_width(0) * self.dtype.itemsize
        per_row = features * (self.FEATURE_COPIES_PER_BLOCK * self.n_blocks + self.FEATURE_COPIES)
        held = per_row * rows + self.EVALUATION_BYTES_PER_EDGE * edges
        return held if chunked else held + self.one_pass_bytes(rows, edges)

    # a training step keeps both backward passes' per-edge tensors of every block: 48 edge feature sets
    # [(lmax+1)^2, C] per block and edge (a 64-channel, 4-block UMA-S shape, float32: 8.8 GB above start-up for 256 Cu
    # atoms, 20k edges at 6 Å; benchmarks/finetune.py fairchem)
    TRAINING_EDGE_FEATURE_COPIES_PER_BLOCK = 48

    def training_bytes(self, rows: float, edges: float) -> float:
        features = self.feature_width(0) * self.dtype.itemsize
        per_edge = self.TRAINING_EDGE_FEATURE_COPIES_PER_BLOCK * self.n_blocks * features
        return 2 * self.evaluation_bytes(rows, edges) + per_edge * edges

    @staticmethod
    def _build(config: dict, ema_state: dict | None, dtype: torch.dtype, where: str, path=None, blocks=None):
        """fairchem's HydraModel from ``config`` with the EMA weights (``read_checkpoint``'s, read from ``path``; None:
        the untrained ones), built in ``dtype`` (as MLIPPredictUnit builds it: constants in the default dtype); its
        compat rules (UMA 1.1's model id) applied first. ``blocks`` (a pipeline stage's block indices): only those of
        the backbone's blocks are built and read, the others Identity. Called within ``process.process_kept``:
        fairchem's import and construction set things for the process."""
        import io
        import logging
        import warnings

        import_fairchem()
        from fairchem.core.models.base import HydraModel
        from fairchem.core.models.uma.compat import apply_uma_compat_fixups
        from fairchem.core.units.mlip_unit.utils import load_state_dict, match_state_dict

        holder = types.SimpleNamespace(model_config=config)
        try:
            apply_uma_compat_fixups(holder, checkpoint_location=where)
        except RuntimeError as exc:
            raise FAIRChemModelError(str(exc)) from None
        kwargs = {k: v for k, v in holder.model_config.items() if k != "_target_"}
        n_blocks = kwargs["backbone"].get("num_layers")
        if blocks is not None and (not isinstance(n_blocks, int) or not set(blocks) < set(range(n_blocks))):
            blocks = None  # every block (a stage's parts are checked against the model's afterwards)
        if blocks is not None:  # a backbone of the held blocks only (fairchem builds num_layers alike blocks)
            backbone = dict(kwargs["backbone"], num_layers=len(blocks))
            if backbone.get("layers_moe") is not None:
                backbone["layers_moe"] = [j for j, k in enumerate(blocks) if k in backbone["layers_moe"]]
            kwargs["backbone"] = backbone
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)  # fairchem's notices (deprecated config spellings) stay out of the user's output
        try:
            # fairchem's construction warnings (deprecated config spellings; torch.load of its own constants under a
            # process-wide TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD, which importing mace sets) are not the user's to read
            with default_dtype(dtype), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = HydraModel(**kwargs)
                if blocks is not None:  # each held block at its index in the whole model, the others Identity
                    built = dict(zip(blocks, model.backbone.blocks))
                    model.backbone.blocks = torch.nn.ModuleList(built.get(k, torch.nn.Identity())
                                                                for k in range(n_blocks))
                    model.backbone.num_layers = n_blocks
                if ema_state is None:  # an architecture alone: the weights fairchem's constructors drew
                    return model
                state = read_weights(path, ema_state, blocks)
                _check_unmerged(model, state, where)
                averaged = torch.optim.swa_utils.AveragedModel(model)
                mine = averaged.state_dict()
                n_averaged = state.pop("n_averaged", mine["n_averaged"])
                del mine["n_averaged"]
                matched = match_state_dict(mine, state)
                matched["n_averaged"] = n_averaged
                load_state_dict(averaged, matched, strict=True)
        except (FAIRChemModelError, PickleFileError):
            raise
        except (RuntimeError, KeyError, TypeError, ValueError, AssertionError) as exc:
            raise FAIRChemModelError(f"{where}: fairchem could not build the model from its config and weights: "
                                     f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        finally:
            logging.disable(level)
        return averaged.module

    # ------------------------------------------------------------------ training contract
    def named_weights(self):
        """Every parameter of fairchem's HydraModel, named as fairchem names them (``backbone.blocks.0...``,
        ``output_heads.energyandforcehead...``), but those fairchem's constructors leave fixed: ``model.freeze`` globs
        match these names. FAIRChemModelError for experts routed with dropout (a random mask at every step: each rank
        and pipeline stage, which route their structures themselves, would draw its own)."""
        bb = self.backbone
        dropout = {"moe_dropout": getattr(getattr(bb, "mole_dropout", None), "p", 0.0),
                   "composition_dropout": getattr(bb, "composition_dropout", 0.0)}
        if self.experts and any(dropout.values()):
            settings = ", ".join(f"{k} {v}" for k, v in dropout.items())
            raise FAIRChemModelError(
                f"{self._where}: its experts are routed with dropout ({settings}), which fine-tuning here does not "
                f"draw (each rank and pipeline stage routes its structures itself and would draw its own mask): set "
                f"both to 0 in the checkpoint's model config")
        return [(name, p) for name, p in self.hydra.named_parameters() if name not in self._fixed]

    def reference_energies(self):
        """The task's element references [len(species)] (eV per atom, by the species' order: atomic numbers 1...)."""
        return self.element_references[1: len(self.species) + 1].numpy().copy()

    def set_reference_energies(self, energies) -> None:
        """Replace the task's element references; the tasks config (the hyperparameters' architecture, written to
        ``inference_ckpt.pt``) holds them too, so that a checkpoint rebuilds them."""
        refs = self.element_references.clone()
        refs[1: len(self.species) + 1] = torch.as_tensor(np.asarray(energies, dtype=np.float64))
        self.element_references = refs
        tasks = decode(self.hyperparameters["architecture"]["tasks_config"])
        for config in tasks:
            if config.get("property") == "energy" and self.task in (config.get("datasets") or ()):
                config["element_references"] = {
                    "_target_": "fairchem.core.modules.normalization.element_references.ElementReferences",
                    "element_references": {"_target_": "torch.DoubleTensor", "_args_": [refs.tolist()]}}
        self.hyperparameters = dict(self.hyperparameters, architecture=dict(
            self.hyperparameters["architecture"], tasks_config=encode(tasks, "tasks_config")))

    def untrained_quantity(self, quantity: str) -> str | None:
        if quantity in self.outputs:
            return None
        return (f"the fairchem checkpoint's task {self.task} has no {quantity} output (its outputs: "
                f"{', '.join(self.outputs)}; fairchem's calculator reports none for it)")

    def save_native(self, path, data=None) -> None:
        """``path``: fairchem's inference checkpoint (``native_object``), as fairchem's training writes
        ``inference_ckpt.pt``: ``load_predict_unit`` and ``FAIRChemCalculator`` load it. The weights keep this model's
        dtype (float64 ones load unrounded where fairchem builds in float64)."""
        if not self.complete:
            raise FAIRChemModelError(f"this FAIRChem holds only the parts {sorted(self.parts)} (a pipeline stage); "
                                     f"its inference_ckpt.pt is written from the whole model")
        # written as they are (no copy: a whole model's weights may be most of a process's memory), but a view into a
        # larger storage, which torch.save would write whole
        state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        state = {k: v if v.untyped_storage().nbytes() == v.nbytes else v.clone() for k, v in state.items()}
        with atomic_write(path) as f:
            torch.save(self.native_object(self.hyperparameters, state), f)

    @classmethod
    def native_object(cls, hyperparameters: dict, state: dict):
        """fairchem's ``MLIPInferenceCheckpoint`` of a FAIRChem's hyperparameters and state dict: the model config, the
        HydraModel's weights as both its model and its EMA state dict, the tasks config with the model's element
        references."""
        from fairchem.core.units.mlip_unit.api.inference import MLIPInferenceCheckpoint

        architecture = decode(hyperparameters["architecture"])
        weights = {k[len("hydra."):]: v for k, v in state.items() if k.startswith("hydra.")}
        ema = {f"module.{k}": v for k, v in weights.items()}
        ema["n_averaged"] = torch.tensor(1, dtype=torch.long)
        return MLIPInferenceCheckpoint(model_config=architecture["model_config"], model_state_dict=weights,
                                       ema_state_dict=ema, tasks_config=architecture["tasks_config"])

    # ------------------------------------------------------------------ parts (forward: BlockPotential's chain)
    @property
    def n_blocks(self) -> int:
        """The backbone's blocks (``layers`` counts one more: the edge-degree embedding reads a cutoff too)."""
        return int(self.backbone.num_layers)

    def part_prefixes(self, part: str) -> list:
        kind, _, k = part.partition(".")
        return {"embed": ["hydra.backbone.sphere_embedding", "hydra.backbone.edge_degree_embedding"],
                "block": [f"hydra.backbone.blocks.{k}"],
                "readout": ["hydra.backbone.norm", "hydra.output_heads"]}[kind]

    def feature_width(self, k: int) -> int:
        """(lmax+1)² C: a row of node embeddings, flat (the same entering every block)."""
        return self.backbone.sph_feature_size * self.backbone.sphere_channels

    def _embeddings(self, h: torch.Tensor) -> torch.Tensor:
        """h [rows, feature_width] as fairchem's node embeddings [rows, (lmax+1)², C]."""
        return h.view(h.shape[0], self.backbone.sph_feature_size, self.backbone.sphere_channels)

    def context(self, graph: AtomGraph) -> dict:
        """What every part reads: the atomic numbers, the graph with fairchem's ``max_neighbors`` cut, each row's
        system embedding (charge, spin, task), the edges' sender/receiver embeddings, the experts' coefficients
        and edge counts per structure (UMA: set on the backbone, kept here for each block to set again: a pipeline
        stage runs several micro-batches' blocks in turn), and the task mean shared out over each structure's
        atoms. A graph of several structures (``graph.structure``) routes each by its own composition, as fairchem
        routes the systems of a batch; one structure's composition is summed over the ranks (``graph.total``,
        collective: every rank alike)."""
        bb, device = self.backbone, graph.species.device
        numbers = self.numbers[graph.species]
        cut = self._neighbours(graph)
        rows = graph.structure if graph.structure is not None else torch.zeros_like(graph.species)
        systems = int(rows.max()) + 1 if graph.structure is not None and graph.n_nodes else 1
        charge, spin = (self._per_system(graph, name, systems) for name in ("charge", "spin"))
        system = bb.csd_embedding(charge=charge, spin=spin, dataset=[self.dataset] * systems)
        ctx = {"numbers": numbers, "graph": cut, "system": system[rows], "sources": bb.source_embedding(numbers),
               "targets": bb.target_embedding(numbers), "mean": None, "experts": None}
        if self.experts or self.mean:
            z = len(self.species) + 1
            owned = slice(0, graph.n_local)
            counts = torch.bincount(rows[owned] * z + numbers[owned], minlength=systems * z).view(systems, z)
            if graph.structure is None:  # (one structure, perhaps split over ranks)
                counts = graph.total(counts.to(torch.float64)).round().to(torch.long)
            if self.experts:
                composition = torch.repeat_interleave(torch.arange(z, device=device).repeat(systems), counts.flatten())
                of_system = torch.repeat_interleave(torch.arange(systems, device=device), counts.sum(1))
                bb.set_MOLE_coefficients(atomic_numbers_full=composition, batch_full=of_system, csd_mixed_emb=system)
                bb.set_MOLE_sizes(nsystems=systems, batch_full=rows, edge_index=cut.edge_index)
                mole = bb.global_mole_tensors
                ctx["experts"] = (mole.expert_mixing_coefficients, mole.mole_sizes)
            if self.mean:
                ctx["mean"] = (self.mean / counts.sum(1).to(torch.float64))[rows[owned]]
        return ctx

    def _per_system(self, graph: AtomGraph, name: str, systems: int) -> torch.Tensor:
        """[systems] long: each structure's charge or spin, as the graph's ``system`` gives it (the omol task: as
        fairchem's training reads them for omol data), else this model's (``charge``/``spin``, the task's default).
        FAIRChemModelError for one outside fairchem's range."""
        default = getattr(self, name)
        given = (graph.system or {}).get(name) if self.task in CHARGED_TASKS else None
        values = [default] * systems if given is None else [default if v is None else int(v) for v in given]
        if len(values) != systems:
            raise ValueError(f"AtomGraph.system[{name!r}] has {len(values)} values for {systems} structures")
        low, high = SYSTEM_RANGES[name]
        bad = [v for v in values if not low <= v <= high]
        if bad:
            raise FAIRChemModelError(f"a structure's {name} is {bad[0]}: fairchem's range is [{low}, {high}]")
        return torch.as_tensor(values, dtype=torch.long, device=graph.species.device)

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:
        """[receivers, (lmax+1)² C]: the atom embedding with the system's in its l = 0 row, plus the edge-degree
        embedding of the edges into each row."""
        bb, g = self.backbone, ctx["graph"]
        x = torch.zeros(g.n_nodes, bb.sph_feature_size, bb.sphere_channels, dtype=self.dtype, device=g.species.device)
        x[:, 0, :] = bb.sphere_embedding(ctx["numbers"]) + ctx["system"]
        # the features depend on the positions on every rank, even one without edges, so that every rank's backward
        # runs the same halo exchanges (lock-step): the weights do not require gradients
        x = x + 0.0 * g.edge_vec.sum().to(self.dtype)
        embedding, zeros = bb.edge_degree_embedding, x.new_zeros(1, *x.shape[1:])

        def degree(vec, source, target):  # per edge: fairchem's edge-degree embedding of one edge
            x_edge, _, wigner_inv = self._edge_features(vec, source, target)
            scatter = torch.arange(vec.shape[0], device=vec.device)
            return embedding.forward_chunk(zeros.expand(vec.shape[0], *zeros.shape[1:]), x_edge, scatter, wigner_inv)

        x = x[: g.receivers] + self._edge_step(g, degree, [ctx["sources"]], [ctx["targets"]], x)
        return x.flatten(1)

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        """fairchem's block k: ``norm_1`` (the system embedding added to its l = 0 row), the halo, the edge step,
        the residual, ``norm_2`` and ``atom_wise``; [receivers, (lmax+1)² C] in and out."""
        bb, g = self.backbone, ctx["graph"]
        if ctx["experts"] is not None:  # this graph's experts (another micro-batch's may have been set since)
            bb.global_mole_tensors.expert_mixing_coefficients, bb.global_mole_tensors.mole_sizes = ctx["experts"]
        block = bb.blocks[int(k)]
        x = self._embeddings(h)
        y = block.norm_1(x)
        y[:, 0, :] = y[:, 0, :] + ctx["system"][: y.shape[0]]
        y = g.halo(y)  # the node embeddings entering the edge step: ghost rows from their owners

        def convolve(vec, source, x_j, target, x_i):  # per edge: fairchem's edge step of one edge
            x_edge, wigner, wigner_inv = self._edge_features(vec, source, target)
            e = vec.shape[0]
            local = torch.arange(2 * e, device=vec.device).view(2, e)
            return block.edge_wise.forward_chunk(torch.cat([x_j, x_i]), e, x_edge, local, wigner, wigner_inv,
                                                 local[0])

        x = x + self._edge_step(g, convolve, [ctx["sources"], y], [ctx["targets"], y], y)
        return (x + block.atom_wise(block.norm_2(x))).flatten(1)

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        """[n_local] float64: the final norm, the head's energy block, × rmsd, + element references, + the task's
        mean shared out over the structure's atoms."""
        x = self.backbone.norm(self._embeddings(h))
        energies = self._energies(x[: graph.n_local, 0, :], ctx["numbers"][: graph.n_local])
        return energies if ctx["mean"] is None else energies + ctx["mean"]

    def _edge_step(self, graph: AtomGraph, message, at_sender, at_receiver, reads: torch.Tensor) -> torch.Tensor:
        """[graph.receivers, (lmax+1)^2, C]: Σ over the edges into each row of ``message``, in chunks within the
        memory budget. A rank without edges still differentiates through ``reads`` (its halo's lock-step)."""
        if graph.edge_index.shape[1] == 0:
            out = reads.new_zeros(graph.receivers, *reads.shape[1:])
            return out + 0.0 * reads.sum()
        return edge_sum(graph, _vectors, message, at_sender, rows=graph.receivers, receiver_nodes=at_receiver,
                        min_edges=self.MIN_CHUNK_EDGES)

    def _edge_features(self, vec: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> tuple:
        """fairchem's per-edge inputs of edges ``vec`` [e, 3] (r_sender - r_receiver): x_edge (distance expansion,
        sender and receiver embeddings), the Wigner rotations and the inverse with the envelope fused in."""
        bb = self.backbone
        vec = vec.to(self.dtype)
        distance = torch.linalg.norm(vec, dim=-1)
        with fixed_roll(vec.device):
            wigner, wigner_inv = bb._get_rotmat_and_wigner(vec)
        index = bb.coefficient_index if bb.mmax != bb.lmax else None
        wigner, wigner_inv = bb.backend.prepare_wigner(wigner, wigner_inv, bb.mappingReduced, index)
        envelope = bb.envelope(distance / bb.cutoff).reshape(-1, 1)
        if wigner_inv.ndim == 3:
            envelope = envelope.unsqueeze(-1)
        x_edge = torch.cat((bb.distance_expansion(distance), source, target), dim=1)
        return x_edge, wigner, wigner_inv * envelope

    def _neighbours(self, graph: AtomGraph) -> AtomGraph:
        """``graph`` with fairchem's ``max_neighbors`` cut: a receiver with more neighbours keeps those whose squared
        distance is at most its (max_neighbors + 1)-th smallest + 0.01 Å² (``get_max_neighbors_mask``, not strict)."""
        sender, receiver = graph.edge_index
        if receiver.numel() == 0 or self.max_neighbors <= 0:
            return graph
        counts = torch.bincount(receiver, minlength=graph.n_nodes)
        if int(counts.max()) <= self.max_neighbors:
            return graph
        d2 = (graph.edge_vec.detach().to(self.dtype) ** 2).sum(dim=1)
        order = torch.argsort(d2, stable=True)
        order = order[torch.argsort(receiver[order], stable=True)]  # by receiver, then by distance
        start = torch.cumsum(counts, 0) - counts
        threshold = torch.full((graph.n_nodes,), float("inf"), dtype=d2.dtype, device=d2.device)
        cut = torch.nonzero(counts > self.max_neighbors).squeeze(1)
        threshold[cut] = d2[order[start[cut] + self.max_neighbors]] + DEGENERACY_TOLERANCE
        keep = d2 <= threshold[receiver]
        return dataclasses.replace(graph, edge_index=graph.edge_index[:, keep], edge_vec=graph.edge_vec[keep],
                                   edge_features_cache={})

    def _energies(self, scalars: torch.Tensor, numbers: torch.Tensor) -> torch.Tensor:
        """Per-atom energies [n_local] float64 (eV) from the final scalar features [n_local, C]: the head's energy
        block (its task's expert, for a dataset-specific mixture-of-experts head), × rmsd, + the atom's element
        reference (the task's mean is added by the caller, shared out over the system's atoms)."""
        head = self.head
        if hasattr(head, "global_mole_tensors"):  # DatasetSpecificMoEWrapper: one expert per dataset
            mix = torch.zeros(1, len(head.dataset_name_to_exp), dtype=scalars.dtype, device=scalars.device)
            mix[0, head.dataset_name_to_exp[self.dataset]] = 1.0
            head.global_mole_tensors.expert_mixing_coefficients = mix
            head.global_mole_tensors.mole_sizes = torch.tensor([scalars.shape[0]], dtype=torch.int)
        if scalars.shape[0] == 0:  # no owned atom: still differentiate through what came before (halo lock-step)
            return scalars.sum().to(torch.float64) * 0.0 + scalars.new_zeros(0, dtype=torch.float64)
        block = (head.head if hasattr(head, "head") else head).energy_block
        raw = block(scalars).view(-1).to(torch.float64)
        return raw * self.rmsd + self.element_references.to(raw.device)[numbers]


ROLL_SEED = 0  # the seed of the edges' roll angles (fixed_roll)


@contextlib.contextmanager
def fixed_roll(device: torch.device):
    """Within: torch's random numbers on ``device`` drawn from ``ROLL_SEED``, and the process's random state put back
    after. fairchem's edge rotations draw a random roll about each edge (``init_edge_rot_euler_angles``): the
    result does not depend on it, but its last bits do, and drawing from the process's generator would change every
    later draw (a thermostat's, a training run's). A fixed roll makes each evaluation a function of its input:
    repeatable runs, bit-exact restarts, a backward's recomputed chunks the same as their forward."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        generator = torch.cuda.default_generators[devices[0]] if devices else torch.random.default_generator
        generator.manual_seed(ROLL_SEED)
        yield


def _check_unmerged(model, state: dict, where: str) -> None:
    """FAIRChemModelError when the weights ``state`` (an EMA state dict, keys "module."-prefixed) hold merged experts
    where ``model`` (built from the config) has a mixture of experts: fairchem's ``merge_mole`` mixes each expert
    layer's ``weights`` [experts, out, in] into one ``weight`` for one composition and drops the routing."""
    experts = [name for name, _ in model.named_parameters() if name.endswith(".weights")]
    merged = [name for name in experts if f"module.{name[:-1]}" in state and f"module.{name}" not in state]
    if merged:
        raise FAIRChemModelError(f"{where}: its experts are merged ({merged[0][:-1]} where the config has the experts' "
                                 f"{merged[0].rsplit('.', 1)[1]}: fairchem's merge_mole mixes them for one composition "
                                 f"and drops the routing); a merged model serves only that composition and cannot be "
                                 f"fine-tuned or run on others: use the checkpoint it was merged from")


def _mix_experts_once(backbone) -> None:
    """Make each mixture-of-experts linear layer of ``backbone`` (fairchem's ``MOLE``) mix its experts' weights once per
    set of coefficients instead of at every call: with one structure its forward is the linear map of the mixed
    weights (the same einsum, then ``linear_with_folded_batch``), and the edge steps call it once per chunk, forward
    and backward (the mixing costs as much as a 256-edge chunk's work at UMA-S's size). The mixed weights are kept
    with what they came from: the coefficients tensor (the backbone sets a new one at every forward) and the versions
    of it and of the experts' weights, so that any change to either, in place too, mixes them again. Weights that
    train (requiring grad, under grad mode) are mixed at every call by fairchem's own forward."""
    from fairchem.core.models.uma.nn.matmul import linear_with_folded_batch
    from fairchem.core.models.uma.nn.mole import MOLE

    def forward(self, x):
        coefficients = self.global_mole_tensors.expert_mixing_coefficients
        if coefficients.shape[0] != 1 or (self.weights.requires_grad and torch.is_grad_enabled()):
            return MOLE.forward(self, x)  # several structures at once, or weights that train: fairchem's own
        key = (coefficients._version, self.weights._version, self.weights.dtype, self.weights.device)
        mixed = self.__dict__.get("_mixed")
        if mixed is None or mixed[0] is not coefficients or mixed[1] != key:
            with torch.autocast(device_type=self.weights.device.type, enabled=False):
                weights = torch.einsum("eoi, be->boi", self.weights, coefficients)
            mixed = self.__dict__["_mixed"] = (coefficients, key, weights)
        return linear_with_folded_batch(x, mixed[2][0], bias=self.bias)

    for module in backbone.modules():
        if type(module) is MOLE:
            module.forward = types.MethodType(forward, module)


def _vectors(vec: torch.Tensor) -> torch.Tensor:
    """The per-edge input of fairchem's edge steps: the edge vectors themselves (features computed per chunk)."""
    return vec
