"""What every model in this package is: a torch module mapping an AtomGraph to per-atom energies."""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from ase.data import atomic_numbers, chemical_symbols

from .errors import MLIPError, UnknownSpeciesError
from .families import native_file
from .graph import AtomGraph
from .lora import add_lora
from .messages import LiveBytes
from .weights import weight_groups


class Potential(torch.nn.Module):
    """Base class of the models.

    Contract for subclasses:
      * ``cutoff`` (Å): edges are the pairs closer than this.
      * ``layers``: message-passing steps; the receptive field is ``layers * cutoff`` (wide mode's shell).
      * ``species``: element symbols the model knows, or None for an element-agnostic model.
      * ``hyperparameters``: the constructor's keyword arguments, JSON-able.
      * ``forward(graph) -> [graph.n_local]`` per-atom energies (eV) in the model's dtype, reading
        ghost-row features only after ``graph.halo`` refreshed them.
    """

    cutoff: float
    layers: int
    hyperparameters: dict  # constructor keyword arguments: rebuilds the same architecture (checkpoints)

    def __init__(self, species: Sequence[str] | None):
        super().__init__()
        if species is not None:
            species = [str(s) for s in species]
            unknown = [s for s in species if s not in atomic_numbers]
            if unknown:
                raise UnknownSpeciesError(f"not chemical elements: {unknown}")
            if len(set(species)) != len(species):
                raise ValueError(f"species listed twice: {species}")
        self.species = species
        table = np.full(len(chemical_symbols), -1, dtype=np.int64)
        if species is None:
            table[:] = 0
        else:
            table[[atomic_numbers[s] for s in species]] = np.arange(len(species))
        self._species_table = table
        # Tracks the model's dtype and device through .double() / .to(); holds no state.
        self.register_buffer("_dtype_probe", torch.zeros(()), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype_probe.dtype

    @property
    def device(self) -> torch.device:
        return self._dtype_probe.device

    def species_index(self, numbers) -> np.ndarray:
        """Atomic numbers [N] → int64 [N] indices into ``self.species``; unknown elements raise."""
        numbers = np.asarray(numbers, dtype=np.int64)
        index = self._species_table[numbers]
        if np.any(index < 0):
            unknown = sorted({chemical_symbols[z] for z in numbers[index < 0]})
            raise UnknownSpeciesError(
                f"element(s) {unknown} not known to {type(self).__name__}; it knows {self.species}")
        return index

    def forward(self, graph: AtomGraph) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def held_forward(self, graph: AtomGraph) -> torch.Tensor:
        """What this model computes on ``graph`` with the parts it holds: its forward (a pipeline stage of a
        ``BlockPotential``: its own parts)."""
        return self(graph)

    # ------------------------------------------------------------------ memory estimate
    # What one evaluation (energy, forces, stress) keeps beyond one chunk of the memory budget, per row (an
    # owned or ghost atom) and per edge: the memory pre-flight (mlip_parallel.preflight) stops inputs that
    # need many times what a rank has, so a factor of two either way is fine. This package's models run their
    # edge steps in chunks and keep 14-16 KB per atom in all (benchmarks/memory_per_atom.py).
    EVALUATION_BYTES_PER_ROW = 16_000
    EVALUATION_BYTES_PER_EDGE = 0
    # Every edge at once (no chunks) adds what the model itself holds at its peak, measured on it (one_pass_costs)
    # times this: a process's resident peak was 1.2-1.4 times the tensors LiveBytes counts (allocator, fragmentation;
    # SevenNet-0, MACE, PaiNN), and the estimate 1.2-2.6 times the peak (benchmarks/preflight.py, every family)
    ONE_PASS_MARGIN = 2.0
    # the probe: the centre and its 12 neighbours, at PROBE_SPACING cutoffs (all within the cutoff of the centre, a
    # neighbour of some others), then with PROBE_LONE atoms out of reach of every other
    PROBE_SPACING, PROBE_LONE = 0.45, 8

    def evaluation_bytes(self, rows: float, edges: float, chunked: bool = True) -> float:
        """Estimated bytes of one evaluation over ``rows`` atoms (owned + ghost) and ``edges`` edges, its edge
        steps in chunks (``chunked``) or every edge at once (adding ``one_pass_bytes``)."""
        held = self.EVALUATION_BYTES_PER_ROW * rows + self.EVALUATION_BYTES_PER_EDGE * edges
        return held if chunked else held + self.one_pass_bytes(rows, edges)

    def one_pass_bytes(self, rows: float, edges: float) -> float:
        """What an evaluation with every edge at once adds over ``rows`` atoms and ``edges`` edges: the model's own
        measured costs (``one_pass_costs``) times ONE_PASS_MARGIN."""
        fixed, per_row, per_edge = self.one_pass_costs()
        return self.ONE_PASS_MARGIN * (fixed + per_row * rows + per_edge * edges)

    def one_pass_costs(self) -> tuple:
        """(bytes, bytes per row, bytes per edge): an upper bound of what the model's tensors take at their peak in
        an evaluation with every edge at once (the energies, then their gradient with respect to the positions),
        measured on the model itself (a pipeline stage: on its parts, ``held_forward``) in its dtype and on its
        device (``messages.LiveBytes``), once per dtype and device. Three probes: a 13-atom cluster with only the
        centre's pairs, with all its pairs within the cutoff, and with PROBE_LONE atoms without neighbours added.
        After each operation, the bytes held by the second beyond the first, per added edge, and by the third beyond
        the first, per added row: their largest over the operations are the costs (a stage's edge tensors and
        another's row tensors each counted at their own peak), and the first probe's peak the fixed part (where the
        probes' operations differ: differences of peaks)."""
        key = (self.dtype, self.device)
        costs = self.__dict__.setdefault("_one_pass_costs", {})
        if key not in costs:
            shell = torch.tensor([[a, b, 0.0] for a in (1, -1) for b in (1, -1)], dtype=torch.float64)
            cluster = torch.cat([torch.zeros(1, 3, dtype=torch.float64), shell, shell[:, [2, 0, 1]],
                                 shell[:, [1, 2, 0]]]) * self.PROBE_SPACING * self.cutoff
            lone = torch.zeros(self.PROBE_LONE, 3, dtype=torch.float64)
            lone[:, 0] = 3 * self.cutoff * torch.arange(1, self.PROBE_LONE + 1)
            receiver, sender = torch.nonzero(torch.cdist(cluster, cluster) < self.cutoff).T
            pairs = torch.stack([sender, receiver])[:, receiver != sender]
            centre = pairs[:, (pairs[0] == 0) | (pairs[1] == 0)]

            def trace(points, index) -> list:
                with torch.inference_mode(False), torch.enable_grad(), LiveBytes() as live:
                    positions = points.to(self.device, self.dtype, copy=True).requires_grad_()
                    index = index.to(self.device)
                    graph = AtomGraph(species=torch.zeros(len(points), dtype=torch.long, device=self.device),
                                      edge_index=index, edge_vec=positions[index[0]] - positions[index[1]],
                                      n_local=len(points), positions=positions, pbc=(False, False, False),
                                      cell=torch.eye(3, dtype=self.dtype, device=self.device) * float(points.max() + 1))
                    out = self.held_forward(graph)
                    if out.requires_grad:
                        torch.autograd.grad(out.sum(), positions, allow_unused=True)
                return live.trace

            trace(cluster, centre)  # (first: what a package builds at its first call)
            few, whole, more = trace(cluster, centre), trace(cluster, pairs), trace(torch.cat([cluster, lone]), centre)

            def largest_excess(trace) -> float:
                if len(trace) != len(few):
                    return max(trace) - max(few)
                return max(b - a for a, b in zip(few, trace))

            costs[key] = (max(few), max(largest_excess(more), 0) / self.PROBE_LONE,
                          max(largest_excess(whole), 0) / (pairs.shape[1] - centre.shape[1]))
        return costs[key]

    # Training runs every edge at once and keeps the tensors of both backward passes (SchNet F=64, 3 layers:
    # ~450 float32 values per edge and layer in the forward alone).
    TRAINING_BYTES_PER_EDGE = 4_000

    def training_bytes(self, rows: float, edges: float) -> float:
        """Estimated bytes of one training step's graph (energy + force loss, double backward)."""
        return 2 * self.evaluation_bytes(rows, edges) + self.TRAINING_BYTES_PER_EDGE * edges

    # ------------------------------------------------------------------ training contract (``Trainable``)
    # What a trainer knows of a model, the same for this package's models and other packages' (adapters):
    # its weights by their package's names, its per-element reference energies, and how it writes itself
    # in its package's own file format. The exchange points are ``graph.halo`` (above), which the
    # adapters place where their packages exchange ghost atoms; training differentiates them twice.
    def named_weights(self) -> list:
        """(name, parameter) of every weight training may change, named as the model's own package names
        them (``freeze`` patterns match these names): by default every parameter."""
        return list(self.named_parameters())

    def reference_energies(self) -> np.ndarray | None:
        """The per-element reference energies [len(species)] (eV per atom, added to each atom's energy),
        or None for a model without them (or a pipeline stage that does not hold them)."""
        return None

    def set_reference_energies(self, energies) -> None:
        """Replace the reference energies by ``energies`` [len(species)] (eV per atom); a model without them,
        or a pipeline stage that does not hold them, leaves them."""

    def untrained_quantity(self, quantity: str) -> str | None:
        """Why the model's package would not train ``quantity`` ("energy", "forces", "stress") into this model (a
        fairchem task without that output), or None: every quantity trains (the default)."""
        return None

    def native_file(self, stem: str) -> str | None:
        """The file name under which ``save_native`` writes a model called ``stem`` ("best") in its package's
        own format (its family's ``native_file``, e.g. "best.model" for MACE), or None where this package's
        checkpoint is that format."""
        return native_file(type(self), stem)

    def save_native(self, path, data=None) -> None:
        """Write the model, atomically, in its package's own format, for the package's own tools. ``data``: the
        file of structures it was trained on, for a format that names its training data (nequip's)."""
        raise NotImplementedError(f"{type(self).__name__} has no other file format than potentials checkpoints")


@runtime_checkable
class Trainable(Protocol):
    """What ``mlip-train`` reads of a model (``Potential`` gives every model the defaults)."""

    def named_weights(self) -> list: ...
    def reference_energies(self) -> np.ndarray | None: ...
    def set_reference_energies(self, energies) -> None: ...
    def untrained_quantity(self, quantity: str) -> str | None: ...
    def native_file(self, stem: str) -> str | None: ...
    def save_native(self, path, data=None) -> None: ...


@runtime_checkable
class MemoryModel(Protocol):
    """What the memory pre-flight reads of a model (``Potential`` gives the default, from its class constants):
    the bytes of one evaluation (energy, forces, stress; its edge steps in chunks, or every edge at once) and of
    one training step, over ``rows`` atoms (owned + ghost) and ``edges`` edges."""

    def evaluation_bytes(self, rows: float, edges: float, chunked: bool = True) -> float: ...
    def training_bytes(self, rows: float, edges: float) -> float: ...


@runtime_checkable
class Splittable(Protocol):
    """What a pipeline stage reads of a model written as parts (``BlockPotential``): see its docstring."""

    parts: frozenset
    n_blocks: int
    state_per_edge: bool

    def part_of(self, key: str) -> str | None: ...
    def state_rows(self, nodes: int, edges: int) -> int: ...
    def feature_width(self, k: int) -> int: ...
    def context(self, graph: AtomGraph): ...
    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor: ...
    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor: ...
    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor: ...


class ScaleShiftReferences:
    """Mixin: the reference energies of a model whose readout ends in a ``SpeciesScaleShift`` held as
    ``scale_shift`` (None on a pipeline stage without the readout) are its shifts."""

    scale_shift: "SpeciesScaleShift | None"

    def reference_energies(self):
        if self.scale_shift is None:
            return None
        return self.scale_shift.shift.detach().cpu().double().numpy().copy()

    def set_reference_energies(self, energies) -> None:
        if self.scale_shift is None:
            return
        with torch.no_grad():
            self.scale_shift.shift.copy_(torch.as_tensor(np.asarray(energies, dtype=np.float64)))


class PackageModel:
    """Mixin of the adapters: another package's model run through its own modules. Each has one shape:

    * it is built from the package's own file, or from ``architecture`` (the JSON form a potentials checkpoint
      of a fine-tuned one stores: rebuilt by the package's constructors with untrained weights, for a state
      dict to be loaded into it), and its ``hyperparameters`` are {"architecture": ..., its options};
    * ``package_module``: the package's own module, whose parameter names are the users' (``named_weights``,
      ``model.freeze``);
    * an error class of its own deriving from ``MLIPError`` (``MACEModelError``, ...);
    * its memory model in ``evaluation_bytes`` and ``training_bytes`` (``MemoryModel``); training runs every
      edge at once and keeps the tensors of both backward passes (unless an adapter measured otherwise);
    * ``copy.deepcopy`` (an EMA's copy, say) builds a new model from ``hyperparameters`` and loads the state
      dict, requires_grad flags and mode into it (a deep copy of e3nn's generated code keeps its constants
      under other names, so the copy's state dict would not be the model's)."""

    @property
    def package_module(self) -> torch.nn.Module:  # pragma: no cover - abstract
        raise NotImplementedError

    def named_weights(self) -> list:
        return list(self.package_module.named_parameters())

    def training_bytes(self, rows: float, edges: float) -> float:
        return 2 * self.evaluation_bytes(rows, edges, chunked=False)

    @classmethod
    def native_object(cls, hyperparameters: dict, state: dict):
        """What ``torch.save`` writes as the package's own file (``save_native``) of the model of these
        hyper-parameters and state dict (this class's names), where that file is built from the weights alone:
        ``checkpoint.save_native_from`` then writes it one weight at a time. None (the default): ``save_native``
        needs the model itself (a pickled module)."""
        return None

    @classmethod
    def rebuild(cls, hyperparameters: dict, dtype: torch.dtype, **parts):
        """A model of this class from ``hyperparameters``, in ``dtype``: built in it where the constructor takes one
        (fairchem's computes constants in it), else converted after. ``parts``: a pipeline stage's."""
        import inspect

        takes = "dtype" in inspect.signature(cls.__init__).parameters
        return cls(**hyperparameters, **parts, **({"dtype": dtype} if takes else {})).to(dtype)

    def __deepcopy__(self, memo):
        import copy

        parts = {"parts": self.parts, "seed": self.seed} if isinstance(self, BlockPotential) else {}  # a stage's
        clone = self.rebuild(copy.deepcopy(self.hyperparameters, memo), self.dtype, **parts).to(self.device)
        if getattr(self, "lora_settings", None):  # the same low-rank updates (their values: the state below)
            add_lora(clone, **self.lora_settings)
        state, rebuilt = self.state_dict(), clone.state_dict()
        # a model loaded with its package's own copy of e3nn's generated code (a .nequip.zip) keeps that code's
        # constants as entries; the rebuilt code makes its own
        clone.load_state_dict({k: v for k, v in state.items() if k in rebuilt or "._tensor_constant" not in k})
        for (_, mine), (_, theirs) in zip(self.named_parameters(), clone.named_parameters()):
            theirs.requires_grad_(mine.requires_grad)
        return clone.train(self.training)


class FreezeError(MLIPError, ValueError):
    """A ``freeze`` pattern that matches none of the model's weights."""


def select_weights(model: Potential, freeze=(), require_match: bool = True) -> list:
    """The weights training changes: ``model.named_weights()`` except those matching a glob pattern of
    ``freeze`` (fnmatch over their names, e.g. "interactions.*"). Sets ``requires_grad`` accordingly on
    every weight; returns the trained ones, in ``named_weights`` order. FreezeError for a pattern that
    matches nothing (the message lists the model's parameter groups), unless not ``require_match``."""
    from fnmatch import fnmatchcase

    weights = model.named_weights()
    for pattern in freeze if require_match else ():
        if not any(fnmatchcase(name, pattern) for name, _ in weights):
            raise FreezeError(f"freeze pattern {pattern!r} matches none of the {type(model).__name__}'s weights; "
                              f"its parameter groups are {', '.join(weight_groups(n for n, _ in weights))}")
    trained = []
    for name, weight in weights:
        frozen = any(fnmatchcase(name, pattern) for pattern in freeze)
        weight.requires_grad_(not frozen)
        if not frozen:
            trained.append(weight)
    return trained


EMBED, READOUT = "embed", "readout"


def block_part(k: int) -> str:
    """Name of interaction block k as a part: "block.k"."""
    return f"block.{k}"


def held_blocks(parts) -> list:
    """The block indices among ``parts`` (part names), ascending."""
    return sorted(int(p[len("block."):]) for p in parts if p.startswith("block."))


def all_parts(blocks: int) -> tuple:
    """Every part of a block model with ``blocks`` blocks, in the order data flows through them."""
    return (EMBED, *(block_part(k) for k in range(blocks)), READOUT)


def stage_parts(blocks: int, boundaries, stage: int) -> frozenset:
    """The parts pipeline stage ``stage`` holds: blocks [boundaries[stage], boundaries[stage + 1]), plus
    the embedding on the first stage and the readout on the last (``boundaries``: [S + 1] block indices)."""
    parts = {block_part(k) for k in range(boundaries[stage], boundaries[stage + 1])}
    if stage == 0:
        parts.add(EMBED)
    if stage == len(boundaries) - 2:
        parts.add(READOUT)
    return frozenset(parts)


def part_seed(seed: int, part: str) -> int:
    """The seed of one part's initial weights: a function of (model seed, part name) alone, so a model
    holding some parts has the same weights for them as the model holding all."""
    import zlib

    return int(np.random.SeedSequence([int(seed), zlib.crc32(part.encode())]).generate_state(1, np.uint64)[0] >> 1)


class BlockPotential(Potential):
    """A message-passing model written as parts, so that it can also run as pipeline stages.

    Parts: ``"embed"``, ``"block.k"`` for k < ``n_blocks``, ``"readout"`` (readout and scale/shift). A
    model may hold only some of them (``parts``; a pipeline stage holds its own): the others are never
    built. Each part's initial weights come from its own seed (``part_seed(seed, part)``), so a stage
    and the whole model built with the same ``seed`` agree; ``seed=None`` draws it from torch's global
    generator (``torch.manual_seed`` then building twice gives the same model). Modules that hold no
    parameters (radial bases) belong to no part and are built everywhere.

    ``context(graph)``: edge features every part may read (each stage recomputes them from its own
    geometry); ``embed(graph, ctx)`` → h; ``block(k, h, graph, ctx)`` → h (block k > 0 refreshes ghost
    rows with ``graph.halo`` first); ``readout_energies(h, graph, ctx)`` → per-atom energies [n_local].
    h entering block k (k = ``n_blocks``: the readout) is one tensor [rows, ``feature_width(k)``]: what
    travels between stages. Its rows are the graph's nodes, or its edges (in the graph's order) where
    ``state_per_edge`` (Allegro: the state between its layers is per edge); ``state_rows`` counts them.
    ``n_blocks`` is ``layers`` (the message-passing steps), except for a strictly local model whose layers
    pass nothing between atoms (Allegro: one layer for the halo, each of its own layers a block).
    ``PART_MODULES`` maps "embed" / "block" / "readout" to the attribute paths of each part's modules ("{k}"
    stands for the block index). ``forward`` chains all parts.
    """

    PART_MODULES: dict
    state_per_edge = False

    @property
    def n_blocks(self) -> int:
        """The parts "block.k" number k < n_blocks: the message-passing layers unless a model says otherwise."""
        return self.layers

    def state_rows(self, nodes: int, edges: int) -> int:
        """Rows of h between parts for a graph of ``nodes`` nodes and ``edges`` edges."""
        return edges if self.state_per_edge else nodes

    def _init_parts(self, parts, seed) -> None:
        """Record which parts this model holds (None: all) and the seed they are built from."""
        names = all_parts(self.n_blocks)
        parts = frozenset(names if parts is None else parts)
        unknown = sorted(parts - set(names))
        if unknown:
            raise ValueError(f"unknown parts {unknown} of a {self.n_blocks}-block model; parts are {list(names)}")
        self.parts = parts
        self.seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else int(seed)

    def _build(self, part: str, factory):
        """``factory()`` under the part's own random stream, or None when this model does not hold ``part``."""
        if part not in self.parts:
            return None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(part_seed(self.seed, part))
            return factory()

    def _build_blocks(self, factory) -> torch.nn.ModuleDict:
        """The held blocks {str(k): factory(k)} (state-dict keys as a ModuleList's: "name.k.…")."""
        return torch.nn.ModuleDict({str(k): self._build(block_part(k), lambda k=k: factory(k))
                                    for k in range(self.n_blocks) if block_part(k) in self.parts})

    @property
    def complete(self) -> bool:
        """True when the model holds every part (``forward`` needs them all)."""
        return len(self.parts) == self.n_blocks + 2

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        if not self.complete:
            raise RuntimeError(f"this {type(self).__name__} holds only the parts {sorted(self.parts)} (a pipeline "
                               "stage); evaluating it needs all of them")
        ctx = self.context(graph)
        h = self.embed(graph, ctx)
        for k in range(self.n_blocks):
            h = self.block(k, h, graph, ctx)
        return self.readout_energies(h, graph, ctx)

    def held_forward(self, graph: AtomGraph) -> torch.Tensor:
        """The whole model's forward, or a pipeline stage's parts on ``graph`` (its first block fed zeros): its
        features after its last block, or the energies where it holds the readout."""
        if self.complete:
            return self(graph)
        ctx = self.context(graph)
        blocks = held_blocks(self.parts)
        rows = self.state_rows(graph.n_nodes, graph.edge_index.shape[1])
        h = self.embed(graph, ctx) if EMBED in self.parts else \
            torch.zeros(rows, self.feature_width(blocks[0]), dtype=self.dtype, device=self.device)
        for k in blocks:
            h = self.block(k, h, graph, ctx)
        return self.readout_energies(h, graph, ctx) if READOUT in self.parts else h

    def part_prefixes(self, part: str) -> list:
        """Attribute paths of ``part``'s modules, e.g. ["interactions.3"] for "block.3"."""
        kind, _, k = part.partition(".")
        return [path.format(k=k) for path in self.PART_MODULES[kind]]

    def _drop_parts_not_held(self) -> None:
        """Replace the modules of the parts this model does not hold by empty ones, their state with them (a model
        read whole from another package's file, then cut to a pipeline stage's parts)."""
        for part in set(all_parts(self.n_blocks)) - set(self.parts):
            for prefix in self.part_prefixes(part):
                owner, _, name = prefix.rpartition(".")
                setattr(self.get_submodule(owner) if owner else self, name, torch.nn.Identity())

    def part_of(self, key: str) -> str | None:
        """The part a state-dict or parameter name belongs to (None: a module shared by every part)."""
        for part in all_parts(self.n_blocks):
            if any(key.startswith(prefix + ".") for prefix in self.part_prefixes(part)):
                return part
        return None

    def feature_width(self, k: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def context(self, graph: AtomGraph):  # pragma: no cover - abstract
        raise NotImplementedError

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class SpeciesScaleShift(torch.nn.Module):
    """e_i = scale[z_i] * out_i + shift[z_i]: per-species energy scale and reference energy (eV).

    Buffers (fitted from data, e.g. least-squares reference energies, not trained by gradient).
    """

    def __init__(self, num_species: int):
        super().__init__()
        self.register_buffer("scale", torch.ones(num_species))
        self.register_buffer("shift", torch.zeros(num_species))

    def forward(self, out: torch.Tensor, species: torch.Tensor) -> torch.Tensor:
        return out * self.scale[species] + self.shift[species]
