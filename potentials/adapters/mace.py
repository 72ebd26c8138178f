"""Adapter: a MACE model file (``.model``, as ``torch.save(model)`` writes it) as a potentials model.

Loading (``mace_loading.load_mace``): the pickle is read without running its code, the model rebuilt with
mace-torch's own constructors and every saved tensor loaded strictly; a file written under e3nn 0.4.4 (every
MACE foundation model) loads beside e3nn >= 0.6.

Running (``MACE.forward``): MACE's own forward with ``lammps_mliap=True``. That path pads each
interaction's node features (after ``linear_up``, interactions after the first) with ghost rows and
calls ``lammps_class.forward_exchange`` / ``reverse_exchange`` around them (MACE's ``LAMMPS_MP``
autograd function); here ``lammps_class`` is ``GhostExchange``, which hands both to our halo
(``graph.halo`` and its adjoint). Edge vectors come from our graph, so forces and stress come from our
own derivative of the per-atom energies (MACE computes no forces here).
"""
from __future__ import annotations

import os

import torch
from ase.data import chemical_symbols

from ..base import EMBED, READOUT, BlockPotential, PackageModel
from ..exchange import GhostExchange, default_dtype
from ..files import atomic_write
from ..graph import AtomGraph
from .mace_chunked import chunked_interactions, runs_chunked
from .mace_loading import MACEModelError, build_mace, import_mace, load_mace  # noqa: F401  (the adapter's names)


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
        """In chunks: per row, each product's contraction's share (0.5 of channels × sh × sh values) and the node
        features; per edge, the radial and angular features, and, for an interaction that does not run chunked, its
        tensor product's weights and output about twice over. The share 0.5 keeps the estimate above the measured
        peak (benchmarks/preflight.py: MP-0-small-sized, 500 and 1,372 atoms, 1 and 2 ranks; 0.2 gave 0.90 and 0.75
        of it on 1 rank). Every edge at once adds the model's measured costs (``one_pass_bytes``)."""
        from e3nn import o3

        itemsize = torch.finfo(self.dtype).bits // 8
        per_row, per_edge = self.EVALUATION_BYTES_PER_ROW, 0
        for block in self.mace.interactions:
            if isinstance(block, torch.nn.Identity):  # a part another pipeline stage holds
                continue
            sh, features = block.edge_attrs_irreps.dim, block.edge_feats_irreps.dim
            channels = o3.Irreps(str(block.hidden_irreps))[0].mul
            per_row += 0.5 * channels * sh * sh * itemsize
            per_edge += 4 * (sh + features + 1) * itemsize
            if not runs_chunked(block):
                per_edge += 2 * (block.conv_tp.weight_numel + block.conv_tp.irreps_out.dim) * itemsize
        held = per_row * rows + per_edge * edges
        return held if chunked else held + self.one_pass_bytes(rows, edges)

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
