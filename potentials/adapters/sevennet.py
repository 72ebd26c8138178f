"""Adapter: a SevenNet checkpoint (``pip install -e .[sevenn]``) as a potentials model.

The sevenn model runs module by module on our AtomGraph; the halo refresh goes on the node features
``x`` right after each ``{t}_self_interaction_1``, t ≥ 1 — exactly where sevenn's own LAMMPS parallel
build cuts its segments (the convolution is the only module that reads neighbours' features). Its
final reduction and autograd force modules are skipped: we sum and differentiate ourselves. Each
convolution's edge step (sevenn's tensor product and radial weight network on the edge embedding) runs
as one ``messages.edge_sum``, so that it takes the memory-bounded path of every other model.

sevenn's one-hot embedding casts to float32; run in float64 (``model.double()``), its output is cast to
the model's dtype, so that every module runs in float64 (for training comparisons to 1e-10).
"""
from __future__ import annotations

import os

import torch
from ase.data import chemical_symbols

from ..base import EMBED, READOUT, BlockPotential, PackageModel, all_parts, block_part
from ..errors import MLIPError
from ..files import atomic_write
from ..graph import AtomGraph
from ..messages import edge_sum
from ..plain import decode, encode

_SKIPPED_MODULES = ("reduce_total_enegy", "force_output")  # sevenn's own spelling
_EDGE_EMBEDDING = "edge_embedding"
_ONE_HOT = "onehot_idx_to_onehot"
# Edges per chunk at least (potentials.messages' default is 2,048): a SevenNet-0 edge keeps ~50 KB of tensor-product
# weights and outputs, so a 2,048-edge chunk alone took ~350 KB per atom at 512 atoms (benchmarks/memory_per_atom.py).
MIN_CHUNK_EDGES = 256


class SevenNetModelError(MLIPError, ValueError):
    """A SevenNet checkpoint that cannot be used (sevenn cannot load it), or an operation its model does not allow."""


class SevenNet(PackageModel, BlockPotential):
    """A pretrained SevenNet model. ``checkpoint``: a name sevenn knows offline ("7net-0", shipped
    inside the sevenn package) or a path to a sevenn checkpoint; or ``architecture`` (``config`` in potentials
    checkpoints written before the adapters shared that name), a checkpoint's model config in ``plain.encode``'s
    JSON form (as a potentials checkpoint of a fine-tuned SevenNet stores it): the model is built with untrained
    weights, for a state dict to be loaded into it. float32 as sevenn
    runs it, or float64 after ``.double()``; cutoff and layer count come from the checkpoint.

    Trainable through the ``Potential`` contract: its weights are the parameters sevenn itself trains (its
    per-element shift and scale and the convolutions' neighbour denominators only where its config trains
    them), its reference energies the per-element shifts, and ``save_native`` writes a sevenn checkpoint
    (``checkpoint_best.pth``) for ``SevenNetCalculator(model=...)``.

    As a ``BlockPotential`` (pipeline stages): "embed" is sevenn's linear from the one-hot species to the node
    features, "block.t" its modules of layer t ("{t}_..."), "readout" those after the last layer (the
    reductions to the energy and the per-element rescale); the node features travel between stages. The
    one-hot embedding (no weights) and the edge embedding are shared by every part: the edge embedding's
    trained radial coefficients are held by every stage, their gradient summed over the stages.
    ``parts``: the parts this model holds (a stage's; the checkpoint is read whole, the others then
    dropped); ``seed`` is unused (the weights are the checkpoint's)."""

    @property
    def package_module(self):
        return self.sevenn

    # ------------------------------------------------------------------ memory model
    # Its edge embedding is kept for all edges; every edge at once adds its convolutions' tensors (``one_pass_costs``;
    # SevenNet-0: ~110 KB per edge). A training step of SevenNet-0 (energy + force + stress loss, float32) held 280-415
    # KB per edge at its peak above a 4-atom step (108 and 256 rattled Cu atoms), more than twice an evaluation's.
    EVALUATION_BYTES_PER_EDGE = 2_000
    TRAINING_BYTES_PER_EDGE = 420_000

    def training_bytes(self, rows: float, edges: float) -> float:
        return 2 * self.evaluation_bytes(rows, edges) + self.TRAINING_BYTES_PER_EDGE * edges

    def __init__(self, checkpoint: str | None = None, architecture: dict | None = None, parts=None, seed: int = 0,
                 config: dict | None = None):
        try:
            import sevenn.util
            from sevenn.model_build import build_E3_equivariant_model
        except ImportError as exc:
            raise ImportError("SevenNet needs the sevenn package: pip install -e .[sevenn]") from exc

        architecture = config if architecture is None else architecture  # its former name, in older checkpoints
        if checkpoint is None and architecture is None:
            checkpoint = "7net-0"
        if checkpoint is not None and architecture is not None:
            raise TypeError("SevenNet takes a checkpoint or an architecture, one of the two")
        if architecture is not None:
            config = decode(architecture)
            model = build_E3_equivariant_model(dict(config))
        else:
            try:  # (sevenn reads the file lazily: a cut-short one fails in build_model)
                loaded = sevenn.util.load_checkpoint(checkpoint)
                model = loaded.build_model(enable_cueq=False, enable_flash=False, enable_oeq=False)
                config = dict(loaded.config, _flash_lammps=False, use_oeq=False)  # as build_model builds it
            except Exception as exc:  # sevenn raises many types for a missing, foreign or damaged file
                damaged = "; is the file whole?" if os.path.isfile(checkpoint) else ""
                raise SevenNetModelError(f"{checkpoint}: sevenn cannot load it ({type(exc).__name__}: "
                                         f"{(str(exc).splitlines() or [''])[0]}{damaged})") from None
        model.set_is_batch_data(False)
        type_map = config["_type_map"]  # atomic number -> one-hot index
        by_index = sorted(type_map, key=type_map.get)
        super().__init__([chemical_symbols[z] for z in by_index])
        self.trained_by_sevenn = [name for name, p in model.named_parameters() if p.requires_grad]
        self.sevenn = model.eval()
        self.config = config
        self.cutoff = float(config["cutoff"])
        self.layers = int(config["num_convolution_layer"])
        self.hyperparameters = {"architecture": encode(config)}
        self.requires_grad_(False)
        # sevenn's modules by part: embed (before layer 0), block t ("{t}_..."), readout (after the last layer)
        self.part_modules = {part: [] for part in all_parts(self.layers)}
        for name in model._modules:
            if name in (*_SKIPPED_MODULES, _EDGE_EMBEDDING, _ONE_HOT):
                continue
            layer = name.split("_", 1)[0]
            part = block_part(int(layer)) if layer.isdigit() else EMBED if not self.part_modules[block_part(0)] else READOUT
            self.part_modules[part].append(name)
        self._widths = self._feature_widths()
        self._init_parts(parts, seed)
        self._drop_parts_not_held()

    def _feature_widths(self) -> list:
        """The width of the node features entering block k (k = layers: the readout), from one small pass."""
        graph = AtomGraph(species=torch.zeros(2, dtype=torch.long), edge_index=torch.tensor([[0, 1], [1, 0]]),
                          edge_vec=torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64), n_local=2)
        widths = []
        with torch.no_grad():
            ctx = self.context(graph)
            h = self._run(self.part_modules[EMBED], dict(ctx), graph)["x"]
            for k in range(self.layers):
                widths.append(h.shape[1])
                h = self._run(self.part_modules[block_part(k)], dict(ctx, x=h), graph)["x"]
        return widths + [h.shape[1]]

    def part_prefixes(self, part: str) -> list:
        return [f"sevenn.{name}" for name in self.part_modules[part]]

    def feature_width(self, k: int) -> int:
        return self._widths[k]

    def context(self, graph: AtomGraph) -> dict:
        """sevenn's data before its first weights: the one-hot species (as node features and attributes), the
        edges (sevenn's (receiver, sender) order) and their vectors."""
        data = {"x": graph.species, "edge_index": graph.edge_index.flip(0),  # sevenn: (receiver, sender)
                "edge_vec": graph.edge_vec.to(self.dtype)}
        return self._run([_ONE_HOT], data, graph)

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:
        return self._run(self.part_modules[EMBED], dict(ctx), graph)["x"]

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        return self._run(self.part_modules[block_part(k)], dict(ctx, x=h), graph)["x"]

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        return self._run(self.part_modules[READOUT], dict(ctx, x=h), graph)["atomic_energy"].squeeze(-1)[: graph.n_local]

    def _run(self, names, data: dict, graph: AtomGraph) -> dict:
        """sevenn's modules ``names`` in order on ``data``: each convolution as ``_convolve``, the halo on ``x``
        after each ``{t}_self_interaction_1``, t ≥ 1, sevenn's float32 one-hot cast to the model's dtype."""
        for name in names:
            module = self.sevenn._modules[name]
            if name.endswith("_convolution"):
                data[module.key_x] = self._convolve(module, data[module.key_x], graph)
                continue
            data = module(data)
            if name == _ONE_HOT and self.dtype != torch.float32:  # sevenn's one-hot is float32
                data = {k: v.to(self.dtype) if torch.is_tensor(v) and v.dtype == torch.float32 else v
                        for k, v in data.items()}
            if name.endswith("_self_interaction_1") and not name.startswith("0_"):
                data["x"] = graph.halo(data["x"])
        return data

    def edge_features(self, vec: torch.Tensor) -> dict:
        """sevenn's edge embedding (radial basis × cutoff, spherical harmonics) of edge vectors [e, 3]."""
        return self.sevenn._modules[_EDGE_EMBEDDING]({"edge_vec": vec.to(self.dtype)})

    def _convolve(self, conv, x: torch.Tensor, graph: AtomGraph) -> torch.Tensor:
        """sevenn's IrrepsConvolution.forward with its message sum as an ``edge_sum`` (every row out, as
        sevenn's own ``message_gather``): tensor product of x_j with Y(r̂), weights from its radial network."""
        def message(feats, x_j):
            return conv.convolution(x_j, feats[conv.key_filter], conv.weight_nn(feats[conv.key_weight_input]))

        return edge_sum(graph, self.edge_features, message, [x], rows=graph.n_nodes,
                        min_edges=MIN_CHUNK_EDGES).div(conv.denominator)

    # ------------------------------------------------------------------ training contract
    def named_weights(self):
        trained = set(self.trained_by_sevenn)
        return [(name, p) for name, p in self.sevenn.named_parameters() if name in trained]

    def _shift(self) -> torch.Tensor:
        shift = self.sevenn._modules["rescale_atomic_energy"].shift
        if shift.numel() != len(self.species):
            raise SevenNetModelError(f"this SevenNet model shifts every element's energy alike ({shift.numel()} shift); "
                            f"it has no per-element reference energies to refit")
        return shift

    def reference_energies(self):
        """The per-element shifts; None on a pipeline stage without the readout, which holds them."""
        if READOUT not in self.parts:
            return None
        return self._shift().detach().cpu().double().numpy().copy()

    def set_reference_energies(self, energies) -> None:
        if READOUT not in self.parts:  # a pipeline stage without the readout: nothing of them here
            return
        with torch.no_grad():
            self._shift().copy_(torch.as_tensor(energies))

    def save_native(self, path, data=None) -> None:
        """``path``: a sevenn checkpoint as sevenn's trainer writes one ({"config", "model_state_dict",
        "optimizer_state_dict", "scheduler_state_dict", "epoch", "time", "hash"}; the config's shift and
        scale those of the weights, its version this sevenn's), which ``SevenNetCalculator(model=path)`` and ``sevenn.util.
        load_checkpoint`` read."""
        import datetime
        import uuid

        import sevenn

        if not self.complete:
            raise SevenNetModelError(f"this SevenNet holds only the parts {sorted(self.parts)} (a pipeline stage); its "
                            f"checkpoint is written from the whole model")

        state = {k: v.detach().cpu() for k, v in self.sevenn.state_dict().items()}
        rescale = self.sevenn._modules["rescale_atomic_energy"]
        # the weights are in this sevenn's layout: its version keeps sevenn from patching them as an older one's
        config = dict(self.config, version=sevenn.__version__, shift=rescale.shift.detach().cpu().tolist(),
                      scale=rescale.scale.detach().cpu().tolist())
        with atomic_write(path) as f:
            torch.save({"config": config, "model_state_dict": state, "optimizer_state_dict": None,
                        "scheduler_state_dict": None, "epoch": None,
                        "time": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "hash": uuid.uuid4().hex}, f)
