"""Adapter: a NequIP or Allegro model of the nequip framework (PyPI ``nequip``, ``nequip-allegro``) as a
potentials model — not ``potentials.NequIP``, this package's own NequIP-style model.

Loading (``load_framework_model``): the framework's own ``load_saved_model`` on a training checkpoint
(``.ckpt``) or a package (``.nequip.zip``), eager. Both are pickles (a package holds code too), so naming
the file (``nequip:`` in the CLIs) is the user's choice to run them. The framework's
``set_global_state`` (which loading needs) sets the default dtype to float64, seeds every generator and
changes e3nn's and torch's compile settings for the process: all of it is put back as it was.

Running (``NequIPFramework.forward``): the model with its force/stress output removed (the framework's
``disable_ForceStressOutput`` modifier: we differentiate ourselves) and, for NequIP, its ghost-exchange
slots filled (the framework's ``enable_LAMMPSMLIAPGhostExchange`` modifier, as its LAMMPS ML-IAP
integration does): each interaction block after the first pads its node features with ghost rows and
calls ``lmp_mliap_data.forward_exchange`` / ``reverse_exchange``, here ``GhostExchange`` over our halo.
Allegro is strictly local (one r_max of receptive field) and has no slots. Edges go in as the
framework's (receiver, sender) pairs with our edge vectors.
"""
from __future__ import annotations

import os
import random
import warnings
from contextlib import contextmanager

import numpy as np
import torch
from ase.data import atomic_numbers

from ..base import Potential
from ..errors import MLIPError
from ..graph import AtomGraph
from .exchange import GhostExchange, default_dtype

INSTALL = "pip install -e .[nequip]"
COMPILED = (".nequip.pth", ".nequip.pt2", ".pth", ".pt2")


class NequIPFrameworkError(MLIPError, ValueError):
    """A nequip-framework model file cannot be used: compiled, missing, unreadable, or with type names
    that are not chemical elements."""


@contextmanager
def process_state_kept():
    """Run the framework's loading, then put back what its ``set_global_state`` changes: torch's default
    dtype, the torch / numpy / Python random states, the environment variables it sets, torch's JIT
    fusion strategy, e3nn's optimization defaults, the dynamo flags and the multiprocessing sharing
    strategy."""
    import e3nn

    dtype, rng, np_rng, py_rng = torch.get_default_dtype(), torch.get_rng_state(), np.random.get_state(), \
        random.getstate()
    environ = dict(os.environ)
    with warnings.catch_warnings():  # torch.jit's fusion settings are deprecated; the framework still sets them
        warnings.simplefilter("ignore", DeprecationWarning)
        fusion = torch.jit.set_fusion_strategy([("STATIC", 2), ("DYNAMIC", 10)])
        torch.jit.set_fusion_strategy(fusion)
    e3nn_defaults = dict(e3nn.get_optimization_defaults())
    dynamo = {k: getattr(torch._dynamo.config, k) for k in ("capture_dynamic_output_shape_ops",
                                                            "capture_scalar_outputs")}
    sharing = torch.multiprocessing.get_sharing_strategy()
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng)
        np.random.set_state(np_rng)
        random.setstate(py_rng)
        os.environ.clear()
        os.environ.update(environ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.set_fusion_strategy(fusion)
        e3nn.set_optimization_defaults(**e3nn_defaults)
        for key, value in dynamo.items():
            setattr(torch._dynamo.config, key, value)
        torch.multiprocessing.set_sharing_strategy(sharing)


def load_framework_model(path, model_key: str = "sole_model"):
    """The eager GraphModel saved at ``path`` (.ckpt or .nequip.zip), in eval mode, on the CPU; the
    process's global state as it was before."""
    path = os.fspath(path)
    if path.endswith(COMPILED):
        raise NequIPFrameworkError(f"{path}: a compiled nequip model (nequip-compile output) is opaque here; pass "
                                   f"the .nequip.zip package or the .ckpt checkpoint it was compiled from")
    if not os.path.isfile(path):
        raise NequIPFrameworkError(f"{path}: no such file")
    if not path.endswith((".ckpt", ".nequip.zip")):
        raise NequIPFrameworkError(f"{path}: not a nequip-framework model file (a .ckpt checkpoint or a .nequip.zip "
                                   f"package)")
    try:
        from nequip.model.saved_models.load_utils import load_saved_model
        from nequip.utils.global_state import set_global_state
    except ImportError as exc:
        raise ImportError(f"potentials.NequIPFramework needs the nequip framework: {INSTALL} ({exc})") from None
    with process_state_kept():
        set_global_state()
        try:
            model = load_saved_model(path, compile_mode="eager", model_key=model_key)
        except Exception as exc:  # the framework raises many types for a damaged or foreign file
            raise NequIPFrameworkError(f"{path}: the nequip framework cannot load it ({type(exc).__name__}: "
                                       f"{(str(exc).splitlines() or [''])[0]})") from None
    return model.eval()


class NequIPFramework(Potential):
    """A trained NequIP or Allegro model of the nequip framework, from its ``.ckpt`` checkpoint or its
    ``.nequip.zip`` package (eager; compiled ``.nequip.pth`` / ``.pt2`` files are refused). dtype from
    the model's metadata; cutoff = its r_max; layers = its message-passing steps (interaction blocks for
    NequIP, 1 for Allegro, which is strictly local). Type names must be chemical symbols. Needs the
    ``nequip`` extra. (``potentials.NequIP`` is this package's own NequIP-style model.)"""

    def __init__(self, path, model_key: str = "sole_model"):
        from nequip.model.modify_utils import get_all_modifiers, modify

        model = load_framework_model(path, model_key)
        metadata = model.metadata
        names = metadata["type_names"].split(" ")
        unknown = [n for n in names if n not in atomic_numbers or n == "X"]
        if unknown:
            raise NequIPFrameworkError(f"{path}: type names {unknown} are not chemical symbols; this adapter maps "
                                       f"elements to the model's types by name")
        super().__init__(names)
        modifiers = get_all_modifiers(model)
        with process_state_kept():  # modifiers rebuild modules under the framework's defaults
            torch.set_default_dtype(torch.float64)
            if "disable_ForceStressOutput" in modifiers:
                model = modify(model, [{"modifier": "disable_ForceStressOutput"}])
            else:  # older models: the energy model inside the force output
                model.model = model.model.func
            self.exchanges = sum(type(m).__name__ == "NoOpGhostExchangeModule" for m in model.modules())
            # a framework without the modifier leaves the slots empty: then only wide mode is exact
            self.exchange_filled = "enable_LAMMPSMLIAPGhostExchange" in modifiers
            if self.exchanges and self.exchange_filled:
                model = modify(model, [{"modifier": "enable_LAMMPSMLIAPGhostExchange"}])
        self.framework = model.eval()
        self.framework.requires_grad_(False)
        dtype = {"float32": torch.float32, "float64": torch.float64}[metadata["model_dtype"]]
        self.to(dtype)
        self.cutoff = float(metadata["r_max"])
        # every interaction block holds one slot (the first block's is never called); Allegro holds none
        self.layers = max(1, self.exchanges)
        self.is_allegro = self.exchanges == 0
        self.hyperparameters = {"path": os.fspath(path), "model_key": model_key}
        self.pruner = None
        if metadata.get("per_edge_type_cutoff") is not None:
            from nequip.data.transforms.neighborlist import NeighborListPruneTransform

            self.pruner = NeighborListPruneTransform(r_max=self.cutoff, per_edge_type_cutoff=metadata[
                "per_edge_type_cutoff"], type_names=names)

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        from nequip.data import AtomicDataDict

        if self.exchanges and not self.exchange_filled and graph.receivers < graph.n_nodes:
            raise NequIPFrameworkError("this model's framework version cannot fill its ghost-exchange slots "
                                       "(no enable_LAMMPSMLIAPGhostExchange modifier): evaluate it in wide mode")
        exchange, types = GhostExchange.for_graph(graph)
        data = {
            AtomicDataDict.EDGE_VECTORS_KEY: graph.edge_vec.to(torch.float64, copy=True),
            # the framework's edges are (receiver, sender)
            AtomicDataDict.EDGE_INDEX_KEY: graph.edge_index.flip(0) + exchange.pad,
            AtomicDataDict.ATOM_TYPE_KEY: types,
            AtomicDataDict.LMP_MLIAP_DATA_KEY: exchange,
            AtomicDataDict.NUM_LOCAL_GHOST_NODES_KEY: torch.tensor([exchange.nlocal, exchange.ntotal - exchange.nlocal],
                                                                   device=types.device),
        }
        if self.pruner is not None:
            data = self.pruner(data)
        with default_dtype(torch.float64):  # the framework's global dtype, as its calculator runs
            out = self.framework(data)
        return exchange.owned(out[AtomicDataDict.PER_ATOM_ENERGY_KEY].reshape(-1), graph.n_local)
