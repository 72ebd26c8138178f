"""Adapter: a MACE model file (``.model``, as ``torch.save(model)`` writes it) as a potentials model.

Loading (``load_mace``): the pickle is read without running its code (``pickled.read_module_tree``:
every class a stand-in, tensors real), the hyper-parameters are read off that tree (as MACE's own
``extract_config_mace_model`` does, per interaction where MACE allows it to vary), the model is built
with mace-torch's own constructors in the file's dtype, and every saved tensor is loaded with a strict
``load_state_dict`` — so constants stored as buffers (the symmetric contractions' U matrices, E0s,
scale and shift) are the file's, whichever e3nn computed them. A file written under e3nn 0.4.4 (every
MACE foundation model) thus loads beside e3nn >= 0.6. A class the rebuild does not know is named.

Running (``MACE.forward``): MACE's own forward with ``lammps_mliap=True``. That path pads each
interaction's node features (after ``linear_up``, interactions after the first) with ghost rows and
calls ``lammps_class.forward_exchange`` / ``reverse_exchange`` around them (MACE's ``LAMMPS_MP``
autograd function); here ``lammps_class`` is ``GhostExchange``, which hands both to our halo
(``graph.halo`` and its adjoint). Edge vectors come from our graph, so forces and stress come from our
own derivative of the per-atom energies (MACE computes no forces here).
"""
from __future__ import annotations

import os
import pickle
import zipfile

import torch
from ase.data import chemical_symbols

from ..base import Potential, RebuiltOnCopy
from ..errors import MLIPError
from ..graph import AtomGraph
from .exchange import GhostExchange, default_dtype
from .pickled import Pickled, PickleFileError, codegen_tensors, read_module_tree, state_dict

MODEL_CLASSES = ("mace.modules.models.ScaleShiftMACE", "mace.modules.models.MACE")
INSTALL = "pip install -e .[mace] && pip install --no-deps mace-torch==0.3.16"


class MACEModelError(MLIPError, ValueError):
    """A MACE model file cannot be rebuilt: unreadable, another kind of model, a block class this
    loader does not know, or weights that do not fit the rebuilt architecture."""


def import_mace():
    """Import mace-torch without letting it change the process: ``import mace`` sets
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (every later ``torch.load`` without an explicit ``weights_only``
    would run pickles); the variable is put back as it was. Its notice that cuEquivariance is not installed
    (printed by every rank of a job; the adapters never use it) is left out of stdout; anything else it
    prints is printed."""
    import contextlib
    import io

    before = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            import mace.modules
    except ImportError as exc:
        raise ImportError(f"potentials.MACE needs mace-torch: {INSTALL} ({exc})") from None
    finally:
        kept = [line for line in printed.getvalue().splitlines() if "cuequivariance" not in line.lower()]
        if kept:
            print("\n".join(kept), flush=True)
        if before is None:
            os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = before
    return mace


def _path(obj) -> str:
    return type(obj).path if isinstance(obj, Pickled) else f"{type(obj).__module__}.{type(obj).__name__}"


def _class_named(obj, table: dict, what: str, where: str):
    """The real mace class a stand-in stands for, looked up by name in one of mace's class tables (a class
    of another package, a fork's say, is not taken for mace's)."""
    module, _, name = _path(obj).rpartition(".")
    if name not in table or not module.startswith("mace.modules"):
        raise MACEModelError(f"{where}: {what} {_path(obj)} is not one this loader can rebuild (known: "
                             f"{', '.join(sorted(table))})")
    return table[name]


def _gate(readout, where: str):
    """The activation of a non-linear readout (None for a linear one): the pickled function's name,
    matched against MACE's own ``gate_dict``."""
    from mace.modules import gate_dict

    acts = getattr(readout.non_linearity, "acts", None) if hasattr(readout, "non_linearity") else None
    if not acts:
        return None
    f = acts[0].f
    if f is None:
        return None
    path = f.path if isinstance(f, type) and issubclass(f, Pickled) else f"{f.__module__}.{f.__name__}"
    known = {f"{g.__module__}.{g.__name__}": g for g in gate_dict.values() if g is not None}
    if path not in known:
        raise MACEModelError(f"{where}: readout activation {path} is not one of MACE's gates {sorted(known)}")
    return known[path]


def _correlation(product) -> int:
    contraction = product.symmetric_contractions.contractions[0]
    try:
        return len(contraction.weights) + 1
    except AttributeError:
        return int(product.symmetric_contractions.contraction_degree)


def _radial_mlp(interaction) -> list:
    net = interaction.conv_tp_weights
    try:
        return list(net.hs[1:-1])
    except AttributeError:
        return [int(net.net[k].normalized_shape[0]) for k in range(1, len(net.net), 3)]


def _field(tree, name, default):
    return getattr(tree, name) if hasattr(tree, name) else default


def mace_config(tree, where: str) -> tuple:
    """(model class, constructor keyword arguments) of a pickled MACE module tree."""
    import numpy as np
    from mace import modules
    from e3nn import o3

    if _path(tree) not in MODEL_CLASSES:
        raise MACEModelError(f"{where}: a {_path(tree)}, not a MACE energy model ({', '.join(MODEL_CLASSES)})")
    if hasattr(tree, "joint_embedding") or hasattr(tree, "embedding_specs"):
        raise MACEModelError(f"{where}: models with a joint embedding of extra inputs (charges, spin, ...) are not "
                             f"supported")
    radial = tree.radial_embedding
    basis = radial.bessel_fn
    basis_kinds = {"BesselBasis": ("bessel", "bessel_weights"), "GaussianBasis": ("gaussian", "gaussian_weights"),
                   "ChebychevBasis": ("chebyshev", None)}
    basis_name = _path(basis).rsplit(".", 1)[-1]
    if basis_name not in basis_kinds:
        raise MACEModelError(f"{where}: radial basis {_path(basis)} is not one this loader can rebuild")
    radial_type, weights = basis_kinds[basis_name]
    num_bessel = len(getattr(basis, weights)) if weights else int(basis.num_basis)
    transform = None
    if hasattr(radial, "distance_transform"):
        transform = {"AgnesiTransform": "Agnesi", "SoftTransform": "Soft"}.get(
            _path(radial.distance_transform).rsplit(".", 1)[-1])
        if transform is None:
            raise MACEModelError(f"{where}: distance transform {_path(radial.distance_transform)} is not one this "
                                 f"loader can rebuild")
    interactions, products, readouts = list(tree.interactions), list(tree.products), list(tree.readouts)
    heads = list(_field(tree, "heads", ["Default"]))
    hidden = o3.Irreps(str(products[0].linear.irreps_out))
    mlp = o3.Irreps(str(readouts[-1].hidden_irreps)) if hasattr(readouts[-1], "hidden_irreps") else o3.Irreps("1x0e")
    n = int(tree.num_interactions)
    last_out = o3.Irreps(str(products[-1].linear.irreps_out))
    cutoff_p = radial.cutoff_fn.p
    config = dict(
        r_max=float(tree.r_max), num_bessel=num_bessel,
        num_polynomial_cutoff=int(cutoff_p.item() if isinstance(cutoff_p, torch.Tensor) else cutoff_p),
        max_ell=int(tree.spherical_harmonics._lmax),
        interaction_cls=_class_named(interactions[-1], modules.interaction_classes, "interaction block", where),
        interaction_cls_first=_class_named(interactions[0], modules.interaction_classes, "interaction block", where),
        num_interactions=n, num_elements=len(tree.atomic_numbers), hidden_irreps=hidden,
        edge_irreps=_field(tree, "edge_irreps", None),
        MLP_irreps=o3.Irreps(f"{max(1, mlp.count((0, 1)) // len(heads))}x0e"),
        gate=_gate(readouts[-1], where),
        atomic_energies=tree.atomic_energies_fn.atomic_energies.cpu().numpy(),
        avg_num_neighbors=float(interactions[0].avg_num_neighbors),
        atomic_numbers=[int(z) for z in tree.atomic_numbers],
        correlation=[_correlation(p) for p in products],
        pair_repulsion=hasattr(tree, "pair_repulsion_fn"),
        distance_transform=transform or "None", radial_type=radial_type, radial_MLP=_radial_mlp(interactions[0]),
        heads=heads, apply_cutoff=bool(_field(tree, "apply_cutoff", True)),
        use_reduced_cg=bool(_field(tree, "use_reduced_cg", False)), use_so3=bool(_field(tree, "use_so3", False)),
        use_agnostic_product=bool(_field(tree, "use_agnostic_product", False)),
        use_last_readout_only=bool(_field(tree, "use_last_readout_only", False)),
        use_edge_irreps_first=bool(_field(tree, "use_edge_irreps_first", False)),
        readout_cls=_class_named(readouts[-1], modules.readout_classes, "readout block", where),
        keep_last_layer_irreps=n > 1 and last_out != o3.Irreps(str(hidden[0])),
    )
    for k, block in enumerate(interactions[1:-1], start=1):
        if _path(block) != _path(interactions[-1]):
            raise MACEModelError(f"{where}: interaction {k} is a {_path(block)} but the last is a "
                                 f"{_path(interactions[-1])}: MACE builds every interaction after the first alike")
    if _path(tree).endswith("ScaleShiftMACE"):
        scale, shift = tree.scale_shift.scale, tree.scale_shift.shift
        config.update(atomic_inter_scale=np.atleast_1d(scale.cpu().numpy()).tolist() if scale.ndim else float(scale),
                      atomic_inter_shift=np.atleast_1d(shift.cpu().numpy()).tolist() if shift.ndim else float(shift))
        return modules.ScaleShiftMACE, config
    return modules.MACE, config


IRREPS_KEYS = ("hidden_irreps", "MLP_irreps", "edge_irreps")


def mace_architecture(cls, config) -> dict:
    """The JSON form of (model class, constructor keyword arguments) ``mace_config`` returns: classes and
    gates by their names in MACE's own tables, irreps as strings, arrays as lists."""
    import numpy as np
    from mace import modules
    from mace.modules import gate_dict

    def name_in(table, value, what):
        names = [k for k, v in table.items() if v is value]
        if not names:
            raise MACEModelError(f"{what} {value!r} is not in MACE's table of {what}s")
        return names[0]

    out = {"class": cls.__name__}
    for key, value in config.items():
        if key in ("interaction_cls", "interaction_cls_first"):
            value = name_in(modules.interaction_classes, value, "interaction block")
        elif key == "readout_cls":
            value = name_in(modules.readout_classes, value, "readout block")
        elif key == "gate":
            value = name_in(gate_dict, value, "gate")
        elif key in IRREPS_KEYS:
            value = None if value is None else str(value)
        elif isinstance(value, np.ndarray):
            value = value.tolist()
        out[key] = value
    return out


def build_mace(architecture: dict, where: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A MACE module of ``architecture`` (``mace_architecture``'s form) built by mace-torch's constructors in
    ``dtype``, its weights those the constructors drew (load a state dict into it). The process's default
    dtype and random state are left as they were."""
    import numpy as np
    from e3nn import o3
    from mace import modules
    from mace.modules import gate_dict

    config = dict(architecture)
    cls = {"ScaleShiftMACE": modules.ScaleShiftMACE, "MACE": modules.MACE}.get(config.pop("class", None))
    try:
        for key in ("interaction_cls", "interaction_cls_first"):
            config[key] = modules.interaction_classes[config[key]]
        config["readout_cls"] = modules.readout_classes[config["readout_cls"]]
        config["gate"] = gate_dict[config["gate"]]
        for key in IRREPS_KEYS:
            config[key] = None if config.get(key) is None else o3.Irreps(config[key])
        config["atomic_energies"] = np.asarray(config["atomic_energies"], dtype=np.float64)
        if cls is None:
            raise KeyError("class")
    except (KeyError, TypeError, ValueError) as exc:
        raise MACEModelError(f"{where}: not a MACE architecture this mace-torch builds ({type(exc).__name__}: "
                             f"{exc})") from None
    try:
        with torch.random.fork_rng(devices=[]), default_dtype(dtype):
            return cls(**config)
    except Exception as exc:  # mace's constructors raise many types for hyper-parameters they reject
        raise MACEModelError(f"{where}: mace-torch cannot build this {cls.__name__} ({type(exc).__name__}: "
                             f"{exc})") from None


def load_mace(path) -> tuple:
    """(module, architecture): a MACE model from its ``.model`` file, rebuilt with mace-torch's constructors
    and the file's tensors (strict), in the file's dtype, in eval mode on the CPU, and its architecture
    (``mace_architecture``). The pickle's code is never run. The process's default dtype and global
    random state are left as they were."""
    path = os.fspath(path)
    if path.endswith((".pt2", ".pth")) or path.endswith("-lammps.pt"):
        raise MACEModelError(f"{path}: a compiled (TorchScript / exported) MACE model; pass the .model file it was "
                             f"made from")
    import_mace()
    try:
        tree = read_module_tree(path)
        architecture = mace_architecture(*mace_config(tree, path))
        weights = {**codegen_tensors(tree), **state_dict(tree)}
        dtype = tree.r_max.dtype
    except PickleFileError as exc:
        raise MACEModelError(str(exc)) from None
    except (AttributeError, TypeError, ValueError, KeyError, IndexError, ZeroDivisionError, RecursionError,
            pickle.UnpicklingError, zipfile.BadZipFile) as exc:  # a tree that lacks or garbles a MACE model's parts
        if isinstance(exc, MACEModelError):
            raise
        raise MACEModelError(f"{path}: not a complete MACE model ({type(exc).__name__}: "
                             f"{(str(exc).splitlines() or [''])[0]})") from None
    model = build_mace(architecture, path, dtype)  # in the file's dtype, as MACE built it
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise MACEModelError(f"{path}: the saved weights do not fit the rebuilt {type(model).__name__}: "
                             f"{' '.join(str(exc).split())[:400]}") from None
    return model.to(dtype).eval(), architecture


class MACE(RebuiltOnCopy, Potential):
    """A trained MACE model (mace-torch's ``ScaleShiftMACE`` or ``MACE``) from its ``.model`` file.

    ``path``: the file MACE's training writes (``torch.save(model)``), under any e3nn MACE has used;
    read without running the pickle's code (``load_mace``). Or ``architecture`` (``mace_architecture``'s
    JSON form, as a potentials checkpoint of a fine-tuned MACE stores it) instead of a path: the model is
    built with untrained weights, for a state dict to be loaded into it. ``head``: the head of a
    multi-head model (None: MACE's calculator's choice — the only head, else the one named "default").
    ``dtype``: None keeps the file's. Cutoff = the model's r_max, layers = its interactions. Needs
    mace-torch.

    Trainable through the ``Potential`` contract: its weights are mace-torch's parameters (named as in the
    MACE module: "interactions.0.linear.weight", ...), its reference energies the head's E0s, and
    ``save_native`` writes a ``.model`` file as MACE's own training does (``torch.save`` of the module),
    for ``MACECalculator``."""

    PACKAGE_MODULE = "mace"
    EVALUATION_BYTES_PER_ROW = 50_000

    def evaluation_bytes(self, rows: float, edges: float) -> float:
        """MACE runs each interaction's edge step over all edges at once: per edge its tensor product's
        weights and output (``conv_tp``), about twice over under autograd (a MACE-MP-0-medium shape: ~75 KB
        per edge, ~6 MB per atom)."""
        itemsize = torch.finfo(self.dtype).bits // 8
        per_edge = sum(2 * (block.conv_tp.weight_numel + block.conv_tp.irreps_out.dim) * itemsize
                       for block in self.mace.interactions)
        return self.EVALUATION_BYTES_PER_ROW * rows + per_edge * edges

    def __init__(self, path=None, head: str | None = None, dtype: torch.dtype | None = None,
                 architecture: dict | None = None):
        if (path is None) == (architecture is None):
            raise TypeError("MACE takes a model file (path) or an architecture, one of the two")
        if architecture is not None:
            import_mace()
            where = "the checkpoint's MACE architecture"
            model = build_mace(architecture, where).eval()
        else:
            where = os.fspath(path)
            model, architecture = load_mace(path)
        numbers = [int(z) for z in model.atomic_numbers]
        super().__init__([chemical_symbols[z] for z in numbers])
        heads = list(model.heads)
        if head is None:
            named = [h for h in heads if h.lower() == "default"]
            if len(heads) > 1 and not named:
                raise MACEModelError(f"{where}: a multi-head model with no head named 'default': choose one of "
                                     f"{heads}")
            head = heads[0] if len(heads) == 1 else named[0]
        if head not in heads:
            raise MACEModelError(f"{where}: no head {head!r}; the model's heads are {heads}")
        self.mace = model.to(dtype or model.r_max.dtype)
        self.to(self.mace.r_max.dtype)
        self.mace.requires_grad_(False)
        self.head = head
        self.register_buffer("_head_index", torch.tensor([heads.index(head)]), persistent=False)
        self.cutoff = float(model.r_max)
        self.layers = int(model.num_interactions)
        self.hyperparameters = {"architecture": architecture, "head": head}

    def _e0s(self) -> torch.Tensor:
        """This head's E0s [len(species)], a view of MACE's ``atomic_energies`` buffer."""
        return torch.atleast_2d(self.mace.atomic_energies_fn.atomic_energies)[int(self._head_index)]

    def reference_energies(self):
        return self._e0s().detach().cpu().double().numpy().copy()

    def set_reference_energies(self, energies) -> None:
        with torch.no_grad():
            self._e0s().copy_(torch.as_tensor(energies))

    def native_file(self, stem: str) -> str:
        return f"{stem}.model"

    def save_native(self, path, data=None) -> None:
        """``path``: a ``.model`` file, ``torch.save`` of the mace-torch module (every head; on the CPU), as
        MACE's training writes it; ``MACECalculator(model_paths=path)`` loads it where mace-torch runs beside
        the e3nn this process has (e3nn >= 0.5 reads e3nn 0.6's pickled code)."""
        import copy

        from ..files import atomic_write

        module = self.mace if self.mace.r_max.device.type == "cpu" else copy.deepcopy(self.mace).cpu()
        with atomic_write(path) as f:
            torch.save(module, f)

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        exchange, species = GhostExchange.for_graph(graph)
        data = {
            "vectors": graph.edge_vec.to(self.dtype, copy=True),  # MACE calls requires_grad_ on it
            "node_attrs": torch.nn.functional.one_hot(species, len(self.species)).to(self.dtype),
            "edge_index": graph.edge_index + exchange.pad,  # (sender, receiver), as MACE's
            "batch": torch.zeros(exchange.nlocal, dtype=torch.int64, device=species.device),
            "head": self._head_index,
            "lammps_class": exchange,
            "natoms": (exchange.nlocal, exchange.ntotal - exchange.nlocal),
        }
        with default_dtype(self.dtype):  # as MACE's calculator runs it: e.g. ZBL's prefactors are built in it
            out = self.mace(data, training=False, compute_force=False, compute_virials=False, compute_stress=False,
                            compute_displacement=False, lammps_mliap=True)
        return exchange.owned(out["node_energy"], graph.n_local)
