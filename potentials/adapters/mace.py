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

import contextlib
import functools
import os
import pickle
import warnings
import zipfile

import torch
from ase.data import chemical_symbols

from ..base import EMBED, READOUT, BlockPotential, PackageModel
from ..errors import MLIPError
from ..graph import AtomGraph
from .exchange import GhostExchange, default_dtype
from .pickled import Pickled, PickleFileError, codegen_tensors, read_module_tree, state_dict
from .process import process_kept

MODEL_CLASSES = ("mace.modules.models.ScaleShiftMACE", "mace.modules.models.MACE")
INSTALL = "pip install -e .[mace] && pip install --no-deps mace-torch==0.3.16"


class MACEModelError(MLIPError, ValueError):
    """A MACE model file cannot be rebuilt: unreadable, another kind of model, a block class this
    loader does not know, or weights that do not fit the rebuilt architecture."""


def import_mace():
    """Import mace-torch without letting it change the process: ``import mace`` sets
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (every later ``torch.load`` without an explicit ``weights_only``
    would run pickles); the environment is put back as it was (``process_kept``). Its notice that
    cuEquivariance is not installed (printed by every rank of a job; the adapters never use it) is left out of
    stdout; anything else it prints is printed."""
    import contextlib
    import io

    printed = io.StringIO()
    try:
        with process_kept(), contextlib.redirect_stdout(printed):
            import mace.modules
    except ImportError as exc:
        raise ImportError(f"potentials.MACE needs mace-torch: {INSTALL} ({exc})") from None
    finally:
        kept = [line for line in printed.getvalue().splitlines() if "cuequivariance" not in line.lower()]
        if kept:
            print("\n".join(kept), flush=True)
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


class MACE(PackageModel, BlockPotential):
    """A trained MACE model (mace-torch's ``ScaleShiftMACE`` or ``MACE``) from its ``.model`` file.

    ``path``: the file MACE's training writes (``torch.save(model)``), under any e3nn MACE has used;
    read without running the pickle's code (``load_mace``). Or ``architecture`` (``mace_architecture``'s
    JSON form, as a potentials checkpoint of a fine-tuned MACE stores it) instead of a path: the model is
    built with untrained weights, for a state dict to be loaded into it. ``head``: the head of a
    multi-head model (None: MACE's calculator's choice — the only head, else the one named "default").
    ``dtype``: None keeps the file's. Cutoff = the model's r_max, layers = its interactions. Needs
    mace-torch.

    As a ``BlockPotential`` (pipeline stages): "embed" is the node embedding (with the pair repulsion's
    per-atom energy, where the model has one), "block.k" interaction k, product k and, but for the last, readout
    k; "readout" the last readout and the scale/shift. Between stages travels [n, features + 1]: the node
    features and, last, the per-atom energy summed so far. The E0s, radial and angular bases are shared by
    every part. ``parts``: the parts this model holds (a stage's; the file is read whole, the others then
    dropped); ``seed`` is unused (the weights are the file's) but kept as every block model keeps one.

    Trainable through the ``Potential`` contract: its weights are mace-torch's parameters (named as in the
    MACE module: "interactions.0.linear.weight", ...), its reference energies the head's E0s, and
    ``save_native`` writes a ``.model`` file as MACE's own training does (``torch.save`` of the module),
    for ``MACECalculator``."""

    @property
    def package_module(self):
        return self.mace

    # ------------------------------------------------------------------ memory model
    EVALUATION_BYTES_PER_ROW = 10_000

    def evaluation_bytes(self, rows: float, edges: float, chunked: bool = True) -> float:
        """Per row, each product's contraction of channels × sh × sh values (kept whole when not ``chunked``) and
        the node features; per edge, the radial and angular features, and, for an interaction that runs over
        all edges at once (not ``chunked``, or a class ``CHUNKED`` does not list), its tensor product's weights
        and output about twice over (a MACE-MP-0-medium shape: ~75 KB per edge, ~6 MB per atom)."""
        from e3nn import o3

        itemsize = torch.finfo(self.dtype).bits // 8
        per_row, per_edge = self.EVALUATION_BYTES_PER_ROW, 0
        for block in self.mace.interactions:
            if isinstance(block, torch.nn.Identity):  # a part another pipeline stage holds
                continue
            sh, features = block.edge_attrs_irreps.dim, block.edge_feats_irreps.dim
            channels = o3.Irreps(str(block.hidden_irreps))[0].mul
            per_row += (0.2 if chunked else 1.2) * channels * sh * sh * itemsize
            per_edge += 4 * (sh + features + 1) * itemsize
            if not chunked or type(block).__name__ not in CHUNKED or hasattr(block, "conv_fusion"):
                per_edge += 2 * (block.conv_tp.weight_numel + block.conv_tp.irreps_out.dim) * itemsize
        return per_row * rows + per_edge * edges

    def __init__(self, path=None, head: str | None = None, dtype: torch.dtype | None = None,
                 architecture: dict | None = None, parts=None, seed: int = 0):
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
        # the width of h entering block k (k = layers: the readout), known while every part is here
        self._widths = [model.node_embedding.linear.irreps_out.dim + 1] + \
            [product.linear.irreps_out.dim + 1 for product in model.products]
        self._init_parts(parts, seed)
        self._drop_parts_not_held()

    # ------------------------------------------------------------------ pipeline parts
    def part_prefixes(self, part: str) -> list:
        kind, _, k = part.partition(".")
        last = len(self.mace.readouts) - 1
        if kind == EMBED:
            return ["mace.node_embedding"]
        if kind == READOUT:
            return [f"mace.readouts.{last}"] + (["mace.scale_shift"] if hasattr(self.mace, "scale_shift") else [])
        own_readout = [f"mace.readouts.{k}"] if last == self.layers - 1 and int(k) < last else []
        return [f"mace.interactions.{k}", f"mace.products.{k}", *own_readout]

    def feature_width(self, k: int) -> int:
        return self._widths[k]

    def context(self, graph: AtomGraph) -> dict:
        """What every part reads: the ghost exchange, one-hot species, edge vectors, MACE's spherical harmonics
        and radial features (with its cutoff), each row's head (as ``ScaleShiftMACE.forward`` with
        ``lammps_mliap`` prepares them)."""
        if hasattr(self.mace, "joint_embedding"):
            raise MACEModelError("a MACE model with a joint embedding of extra features does not split into parts")
        exchange, species = GhostExchange.for_graph(graph)
        with default_dtype(self.dtype):
            node_attrs = torch.nn.functional.one_hot(species, len(self.species)).to(self.dtype)
            vectors = graph.edge_vec.to(self.dtype)
            lengths = torch.linalg.vector_norm(vectors, dim=1, keepdim=True)
            edge_index = graph.edge_index + exchange.pad
            edge_feats, cutoff = self.mace.radial_embedding(lengths, node_attrs, edge_index, self.mace.atomic_numbers)
            return {"exchange": exchange, "node_attrs": node_attrs, "lengths": lengths, "edge_index": edge_index,
                    "edge_attrs": self.mace.spherical_harmonics(vectors), "edge_feats": edge_feats, "cutoff": cutoff,
                    "heads": self._head_index.expand(exchange.nlocal), "rows": torch.arange(exchange.nlocal,
                                                                                            device=species.device)}

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:
        """[ntotal, C + 1]: the node embedding of every row, and the pair repulsion's per-atom energy (zero where
        the model has none; on ghost rows)."""
        exchange = ctx["exchange"]
        with default_dtype(self.dtype):
            feats = self.mace.node_embedding(ctx["node_attrs"])
            energy = feats.new_zeros(exchange.ntotal)
            if hasattr(self.mace, "pair_repulsion"):
                pair = self.mace.pair_repulsion_fn(ctx["lengths"], ctx["node_attrs"], ctx["edge_index"],
                                                   self.mace.atomic_numbers)
                energy = torch.cat([pair[: exchange.nlocal], energy[exchange.nlocal:]])
        return torch.cat([feats, energy[:, None]], dim=1)

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        """[nlocal, C_k+1 + 1]: interaction k (its ghost rows refreshed by MACE's own exchange hook), product k and,
        when block k holds one, readout k added to the energy column."""
        exchange, k = ctx["exchange"], int(k)
        nlocal = exchange.nlocal
        feats, energy = h[:, :-1], h[: nlocal, -1]
        attrs = ctx["node_attrs"]
        with default_dtype(self.dtype):
            feats, sc = self.mace.interactions[k](
                node_attrs=attrs if k == 0 else attrs[:nlocal], node_feats=feats, edge_attrs=ctx["edge_attrs"],
                edge_feats=ctx["edge_feats"], edge_index=ctx["edge_index"], cutoff=ctx["cutoff"], first_layer=k == 0,
                lammps_class=exchange, lammps_natoms=(nlocal, exchange.ntotal - nlocal))
            feats = self.mace.products[k](node_feats=feats, sc=sc, node_attrs=attrs[:nlocal])
            if f"mace.readouts.{k}" in self.part_prefixes(f"block.{k}"):
                energy = energy + self.mace.readouts[k](feats, ctx["heads"])[ctx["rows"], ctx["heads"]]
        return torch.cat([feats, energy[:, None]], dim=1)

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        """[n_local] float64: the last readout added, MACE's scale/shift (ScaleShiftMACE), plus the E0s."""
        feats, energy = h[:, :-1], h[:, -1]
        heads, rows = ctx["heads"], ctx["rows"]
        with default_dtype(self.dtype):
            energy = energy + self.mace.readouts[-1](feats, heads)[rows, heads]
            if hasattr(self.mace, "scale_shift"):
                energy = self.mace.scale_shift(energy, heads)
            e0 = self.mace.atomic_energies_fn(ctx["node_attrs"])[rows, heads]
        return ctx["exchange"].owned(e0.double() + energy.double(), graph.n_local)

    def _e0s(self) -> torch.Tensor:
        """This head's E0s [len(species)], a view of MACE's ``atomic_energies`` buffer."""
        return torch.atleast_2d(self.mace.atomic_energies_fn.atomic_energies)[int(self._head_index)]

    def reference_energies(self):
        return self._e0s().detach().cpu().double().numpy().copy()

    def set_reference_energies(self, energies) -> None:
        with torch.no_grad():
            self._e0s().copy_(torch.as_tensor(energies))

    def save_native(self, path, data=None) -> None:
        """``path``: a ``.model`` file, ``torch.save`` of the mace-torch module (every head; on the CPU), as
        MACE's training writes it; ``MACECalculator(model_paths=path)`` loads it where mace-torch runs beside
        the e3nn this process has (e3nn >= 0.5 reads e3nn 0.6's pickled code)."""
        import copy

        from ..files import atomic_write

        if not self.complete:
            raise MACEModelError(f"this MACE holds only the parts {sorted(self.parts)} (a pipeline stage); its .model "
                                 f"file is written from the whole model")
        module = self.mace if self.mace.r_max.device.type == "cpu" else copy.deepcopy(self.mace).cpu()
        with atomic_write(path) as f:
            torch.save(module, f)

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        if not self.complete:
            return super().forward(graph)  # (raises: a stage's parts alone do not evaluate)
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
        # as MACE's calculator runs it (e.g. ZBL's prefactors are built in it); evaluation: edge steps in chunks
        with default_dtype(self.dtype), chunked_interactions(self.mace, graph.memory_budget):
            out = self.mace(data, training=False, compute_force=False, compute_virials=False, compute_stress=False,
                            compute_displacement=False, lammps_mliap=True)
        return exchange.owned(out["node_energy"], graph.n_local)


# ------------------------------------------------------------------------------ memory-bounded interactions
# The interaction classes whose edge step runs in chunks (``chunked_interaction``); others run MACE's own forward.
CHUNKED = ("RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock", "RealAgnosticDensityInteractionBlock",
           "RealAgnosticDensityResidualInteractionBlock", "RealAgnosticResidualNonLinearInteractionBlock",
           "RealAgnosticAttResidualInteractionBlock")
_NOTED = set()
# Edges per chunk at least (potentials.messages' default is 2,048): a MACE edge carries ~10-30 KB of tensor-product
# weights and outputs, so a budget-sized chunk of a few hundred edges keeps its kernels busy (set by
# benchmarks/memory_per_atom.py: MP-0-small, 500 atoms).
MIN_CHUNK_EDGES = 256


# The mace-torch versions whose interaction blocks' forward ``chunked_interaction`` was written from (line by line); under
# another, every block keeps MACE's own forward (a one-time note says so).
COPIED_FROM = ("0.3.16",)


@functools.lru_cache(maxsize=None)
def mace_version() -> str:
    """The installed mace-torch's version ("unknown" where its metadata is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mace-torch")
    except PackageNotFoundError:
        return "unknown"


@contextlib.contextmanager
def chunked_interactions(mace, budget: int | None):
    """Within it, the interaction blocks of ``mace`` whose class ``CHUNKED`` lists run ``chunked_interaction``
    with ``budget`` bytes per chunk and its product blocks ``chunked_product`` (None: nothing changes:
    training's plain path). A block of another class, one running cuEquivariance's fused convolution, or any
    block under a mace-torch other than ``COPIED_FROM``, keeps MACE's own forward (a one-time warning names it).
    Every block patched is restored on leaving, also when a warning raised as an error stops the patching."""
    patched, shared = [], {}  # the blocks of one forward read the same edge features: packed once (``_edge_step``)
    try:
        if budget is not None:
            for product in mace.products:  # per atom: the symmetric contraction's tensors, in row chunks
                product.forward = functools.partial(chunked_product, product, budget)
                patched.append(product)
            copied = mace_version() in COPIED_FROM
            for block in mace.interactions:
                name = type(block).__name__
                if copied and name in CHUNKED and not hasattr(block, "conv_fusion"):
                    block.forward = functools.partial(chunked_interaction, block, budget, shared)
                    patched.append(block)
                elif name not in _NOTED:
                    _NOTED.add(name)
                    why = "" if copied else f" under mace-torch {mace_version()} (written from {', '.join(COPIED_FROM)})"
                    warnings.warn(f"MACE interaction {name} runs its own forward over all edges at once (its edge step "
                                  f"is not memory-bounded{why})", stacklevel=4)
        yield
    finally:
        for block in patched:
            del block.forward


def chunked_product(product, budget: int, node_feats, sc, node_attrs):
    """MACE's product block (``EquivariantProductBasisBlock.forward``: symmetric contraction, linear, + sc), each
    atom alone, in row chunks of at most ``budget`` bytes recomputed in the backward (``messages.chunked_rows``)."""
    from ..messages import chunked_rows

    forward = type(product).forward

    def rows(feats, skip, attrs):
        return forward(product, node_feats=feats, sc=skip, node_attrs=attrs)

    return chunked_rows(rows, budget, node_feats, sc, node_attrs)


def _edge_step(block, budget: int, shared: dict, edge_index, rows: int, conv_feats, edge_attrs, edge_feats, cutoff,
               sender_extra=None, receiver_extra=None):
    """[rows, irreps_mid]: Σ over the edges e = (s → r) into each row of ``block.conv_tp(conv_feats[s], edge_attrs_e,
    block.conv_tp_weights(w_e) * cutoff_e)``, w_e = edge_feats_e, or [edge_feats_e, sender_extra[s],
    receiver_extra[r]] (the blocks whose radial weights read the two atoms too), in chunks of at most ``budget``
    bytes recomputed in the backward (``messages.chunked_edge_sum``)."""
    from ..messages import chunked_edge_sum

    pieces = [edge_feats] + ([receiver_extra[edge_index[1]]] if receiver_extra is not None else []) + [edge_attrs] \
        + ([cutoff] if cutoff is not None else [])
    if receiver_extra is not None:
        edge_data = torch.cat(pieces, dim=1)
    else:  # the same tensors for every block of this forward: one copy
        if shared.get("pieces") is None or any(a is not b for a, b in zip(shared["pieces"], pieces)):
            shared.update(pieces=pieces, edge_data=torch.cat(pieces, dim=1))
        edge_data = shared["edge_data"]
    fe, fr, fa = edge_feats.shape[1], 0 if receiver_extra is None else receiver_extra.shape[1], edge_attrs.shape[1]
    feats, received, attrs = slice(0, fe), slice(fe, fe + fr), slice(fe + fr, fe + fr + fa)  # (cutoff: the last)

    def message(edge, gathered, *sent):  # [e, ...], [e, irreps] (, [e, extra]) -> [e, irreps_mid]
        weight_input = edge[:, feats] if sender_extra is None else torch.cat([edge[:, feats], sent[0], edge[:, received]],
                                                                               dim=1)
        weights = block.conv_tp_weights(weight_input)
        if cutoff is not None:
            weights = weights * edge[:, -1:]
        return block.conv_tp(gathered, edge[:, attrs], weights)

    nodes = [conv_feats] + ([sender_extra] if sender_extra is not None else [])
    return chunked_edge_sum(message, edge_data, edge_index, nodes, rows, budget, MIN_CHUNK_EDGES)


def chunked_interaction(block, budget: int, shared: dict, node_attrs, node_feats, edge_attrs, edge_feats, edge_index,
                        cutoff=None, lammps_class=None, lammps_natoms=(0, 0), first_layer=False):
    """MACE's ``forward`` of a ``CHUNKED`` interaction block (mace-torch ``COPIED_FROM``), with its own submodules and in
    its order, but its edge step — ``conv_tp(node_feats[sender], edge_attrs, conv_tp_weights(edge_feats) *
    cutoff)`` summed into the receivers — in chunks of at most ``budget`` bytes (``_edge_step``): no per-edge
    weight or message tensor is kept for all edges at once. Returns (message, skip) as MACE's."""
    from mace.tools.scatter import scatter_sum

    name = type(block).__name__
    n_real = lammps_natoms[0] if lammps_class is not None else None
    num_nodes = node_feats.shape[0]
    exchange = dict(lammps_class=lammps_class, lammps_natoms=lammps_natoms, first_layer=first_layer)

    def density(weight_input):  # [rows, 1]: Σ over the edges into each row of tanh(density_fn(w)²) · cutoff
        edge_density = torch.tanh(block.density_fn(weight_input) ** 2)
        if cutoff is not None:
            edge_density = edge_density * cutoff
        return block.truncate_ghosts(scatter_sum(src=edge_density, index=edge_index[1], dim=0, dim_size=num_nodes),
                                     n_real)

    if name == "RealAgnosticResidualNonLinearInteractionBlock":
        sc = block.skip_tp(node_feats)
        node_feats = block.linear_up(node_feats)
        node_feats_res = block.linear_res(node_feats)
        width = node_feats.shape[-1]
        both = block.handle_lammps(torch.cat([node_feats, node_attrs], dim=-1), **exchange)
        node_feats, node_attrs = both[:, :width], both[:, width:]
        source, target = block.source_embedding(node_attrs), block.target_embedding(node_attrs)
        message = _edge_step(block, budget, shared, edge_index, num_nodes, node_feats, edge_attrs, edge_feats, cutoff,
                             source, target)
        norm = density(torch.cat([edge_feats, source[edge_index[0]], target[edge_index[1]]], dim=-1))
        message = block.truncate_ghosts(message, n_real)
        sc, node_feats_res = block.truncate_ghosts(sc, n_real), block.truncate_ghosts(node_feats_res, n_real)
        message = block.linear_1(message) / (norm * block.beta + block.alpha) + node_feats_res
        return block.reshape(block.linear_2(block.equivariant_nonlin(message))), sc
    if name == "RealAgnosticAttResidualInteractionBlock":
        sc = block.skip_linear(node_feats)
        up, down = block.linear_up(node_feats), block.linear_down(node_feats)
        width = up.shape[-1]
        both = block.handle_lammps(torch.cat((up, down), dim=-1), **exchange)
        up, down = both[:, :width], both[:, width:]
        message = _edge_step(block, budget, shared, edge_index, up.shape[0], up, edge_attrs, edge_feats, cutoff, down,
                             down)
        message = block.linear(block.truncate_ghosts(message, n_real)) / block.avg_num_neighbors
        return block.reshape(message), block.truncate_ghosts(sc, n_real)
    residual = "Residual" in name
    sc = block.skip_tp(node_feats, node_attrs) if residual else None
    node_feats = block.handle_lammps(block.linear_up(node_feats), **exchange)
    message = _edge_step(block, budget, shared, edge_index, node_feats.shape[0], node_feats, edge_attrs, edge_feats,
                         cutoff)
    message = block.truncate_ghosts(message, n_real)
    node_attrs = block.truncate_ghosts(node_attrs, n_real)
    norm = density(edge_feats) + 1 if "Density" in name else block.avg_num_neighbors
    message = block.linear(message) / norm
    if residual:
        return block.reshape(message), block.truncate_ghosts(sc, n_real)
    return block.reshape(block.skip_tp(message, node_attrs)), None
