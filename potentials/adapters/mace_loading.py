"""Loading a MACE model file (``.model``, as ``torch.save(model)`` writes it) without running its pickle's code.

``load_mace``: the pickle is read by a restricted unpickler (``pickled.read_module_tree``: every class a stand-in,
tensors real), the hyper-parameters are read off that tree (as MACE's own ``extract_config_mace_model`` does, per
interaction where MACE allows it to vary), the model is built with mace-torch's own constructors in the file's
dtype, and every saved tensor is loaded with a strict ``load_state_dict`` — so constants stored as buffers (the
symmetric contractions' U matrices, E0s, scale and shift) are the file's, whichever e3nn computed them. A file
written under e3nn 0.4.4 (every MACE foundation model) thus loads beside e3nn >= 0.6. A class the rebuild does
not know is named. ``mace_architecture`` is the JSON form of what rebuilds it (a potentials checkpoint of a
fine-tuned MACE stores it), ``build_mace`` its rebuild."""
from __future__ import annotations

import os
import pickle
import zipfile

import torch

from ..errors import MLIPError
from ..exchange import default_dtype
from ..pickled import (GRAPH_MODULE, Pickled, PickleFileError, codegen_tensors, read_module_tree, state_dict,
                      traced_prefixes)
from ..process import process_kept

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
    matched against MACE's own ``gate_dict`` (in an activation that torch.fx traced, the gate its code calls)."""
    from mace.modules import gate_dict

    known = {f"{g.__module__}.{g.__name__}": g for g in gate_dict.values() if g is not None}
    activation = readout.non_linearity if hasattr(readout, "non_linearity") else None
    if isinstance(activation, Pickled) and type(activation).path == GRAPH_MODULE:  # traced for torch.compile
        code = str(activation._fields().get("_code", ""))
        called = [g for name, g in known.items() if f"{name}(" in code]
        if len(called) != 1:
            raise MACEModelError(f"{where}: the readout's traced activation calls {len(called)} of MACE's gates "
                                 f"{sorted(known)}, not one")
        return called[0]
    acts = getattr(activation, "acts", None) if activation is not None else None
    if not acts:
        return None
    f = acts[0].f
    if f is None:
        return None
    path = f.path if isinstance(f, type) and issubclass(f, Pickled) else f"{f.__module__}.{f.__name__}"
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

    if _path(tree).startswith("__torch__.") and _path(tree)[len("__torch__."):] in MODEL_CLASSES:  # torch.jit.save's
        raise MACEModelError(f"{where}: a TorchScript archive of a {_path(tree).removeprefix('__torch__.')} (MACE's "
                             f"*_compiled.model, for LAMMPS and TorchScript tools); give the .model file MACE's "
                             f"training writes beside it (the same name without _compiled)")
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


def without_folded_constants(model, weights: dict, generated: dict, path) -> dict:
    """``weights`` less the e3nn code-generated constants the rebuilt ``model`` does not hold: a traced tensor
    product whose Wigner-3j buffer and path normalisation were folded into one tensor (``_tensor_constant0``, as a
    model that MACE's training compiled holds them). Each must equal a multiple of a Wigner-3j buffer of the same
    shape in the rebuilt module it belongs to (the same computation, its factor applied in the rebuilt code);
    MACEModelError names one that does not."""
    expected = model.state_dict()
    folded = [k for k in generated if k not in expected]
    modules = dict(model.named_modules())
    for key in folded:
        owner = key.rpartition(".")[0]
        constant = generated[key].to(torch.float64)
        candidates = [b.to(torch.float64) for n, b in (modules[owner].named_buffers(recurse=False)
                                                        if owner in modules else ())
                      if n.startswith("_w3j") and b.shape == constant.shape]
        scale = lambda b: float((constant * b).sum() / (b * b).sum())  # noqa: E731  (least squares)
        if not any(torch.allclose(constant, scale(b) * b, rtol=1e-5, atol=1e-6 * float(constant.abs().max()))
                   for b in candidates):
            raise MACEModelError(f"{path}: the saved constant {key} {tuple(constant.shape)} is no multiple of a "
                                 f"Wigner-3j tensor of the rebuilt {type(model).__name__}: this e3nn generates "
                                 f"another computation than the one that wrote the file")
    return {k: v for k, v in weights.items() if k not in folded}


def untraced_buffers(model, weights: dict, traced: list) -> dict:
    """The rebuilt ``model``'s buffers that ``weights`` lacks because torch.fx traced their module (as
    ``mace.tools.compile.prepare`` traces the symmetric contractions before ``torch.compile``) and the traced
    forward never reads them: flags the constructors derive from the architecture (``weights_0_zeroed``). Taken
    from the rebuilt model; a missing parameter, or a buffer outside a traced module, stays missing."""
    parameters = dict(model.named_parameters())
    return {k: v for k, v in model.state_dict().items() if k not in weights and k not in parameters
            and any(k.startswith(prefix) for prefix in traced)}


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
        generated = codegen_tensors(tree)
        weights = {**generated, **state_dict(tree)}
        traced = traced_prefixes(tree)
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
    weights = without_folded_constants(model, weights, generated, path)
    weights.update(untraced_buffers(model, weights, traced))
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise MACEModelError(f"{path}: the saved weights do not fit the rebuilt {type(model).__name__}: "
                             f"{' '.join(str(exc).split())[:400]}") from None
    return model.to(dtype).eval(), architecture
