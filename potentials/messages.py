"""Message sums over edges within a memory budget: the step of every message-passing block whose
tensors are per edge ([E, ...], ~40 edges per atom) rather than per atom.

``edge_sum`` computes out[i] = Σ_{e: receiver(e) = i} message(features(edge_vec[e]), x[sender(e)] for x in
nodes). Under plain autograd every intermediate of ``message`` is kept for the backward on all E edges at once
(SchNet: ~450 float32 values per edge per layer, ~225 KB per atom). With a memory budget the edges are
processed in chunks by a custom autograd function that keeps only its inputs (node tensors, edge vectors,
indices): the forward runs each chunk without a graph, and the backward recomputes one chunk at a time
and back-propagates it into the node rows and edge vectors it read. Peak memory is then the per-atom
tensors plus one chunk's edge temporaries (about the budget).

The chunked function returns gradients for its tensor inputs only (edge vectors → positions and strain,
node features → earlier layers), not for the parameters ``message`` uses, and it cannot be
differentiated twice: it serves evaluation (energy, forces, stress, MD). Training (``create_graph``,
parameter gradients) takes the plain path: ``AtomGraph.memory_budget`` None.

For other packages' blocks: ``chunked_edge_sum`` (the same over any per-edge tensor, MACE's and NequIP's
edge steps), ``chunked_rows`` (a per-atom function in checkpointed row chunks, MACE's products) and
``chunked_local`` (a strictly local model, Allegro, in checkpointed groups of receiver atoms).
"""
from __future__ import annotations

import contextlib
import gc
import math
import weakref
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PROBE_EDGES = 1024     # edges whose saved tensors are counted to size the chunks (≤ MIN_CHUNK_EDGES)
# Chunks hold at least this many edges, whatever the budget: below it the per-chunk cost of launching a
# block's many small operations (e3nn's tensor products: ~100 per chunk) outweighs the memory saved
# (NequIP, 864 atoms, one CPU thread: 700-edge chunks 1.3× slower than one pass, 2,800-edge ones 0.9×).
MIN_CHUNK_EDGES = 2048
# The automatic budget: one pass over every edge (no chunks) where the evaluation's predicted peak that way (the
# model's ``evaluation_bytes(rows, edges, chunked=False)``) is at most ONE_PASS_SHARE of the free memory: chunks
# only bound memory, and where one pass fits it is the fastest (benchmarks/calculator_defaults.py; on a CPU with
# freed memory kept for reuse, ``mlip_parallel.allocator``: SchNet on 4,000 atoms 0.49 s against 0.60 s in 8 MiB
# chunks; with glibc's defaults the one pass's large blocks are mmapped and faulted in at every call, 0.82 s).
# Else chunks of a fraction of the free device memory, capped: on a CPU cache-sized chunks are the fastest of
# the chunked runs (8 MiB 0.60 s, 64 MiB 0.67 s, 512 MiB 0.72 s there); on a GPU large chunks keep the kernels
# busy (not yet measured).
ONE_PASS_SHARE = 0.5
AUTO_FRACTION = 0.05
AUTO_CAP_BYTES = {"cpu": 8 * 2**20, "cuda": 2 * 2**30}


class SavedBytes:
    """``with SavedBytes() as saved:`` gradients enabled, and ``saved.bytes`` the bytes (elements × element size) of
    every tensor autograd saves for the backward inside: the probe by which the chunked paths size their chunks."""

    def __init__(self):
        self.bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self) -> "SavedBytes":
        self._within = contextlib.ExitStack()
        self._within.enter_context(torch.enable_grad())
        self._within.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        return self

    def __exit__(self, *exc) -> None:
        self._within.close()


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as live:`` ``live.trace`` the bytes held by the tensors created inside after each operation,
    ``live.peak`` their most, each storage counted from the operation that makes it until it is freed (the
    backward's gradients and temporaries included): the probe by which ``Potential.one_pass_costs`` measures a
    model's evaluation with every edge at once."""

    def __init__(self):
        super().__init__()
        self.live, self.trace = 0, []
        self._held: set = set()

    def __enter__(self) -> "LiveBytes":
        self._collecting = gc.isenabled()
        gc.disable()  # (tensors freed by their counts alone: the same trace on every rank and every run)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if self._collecting:
            gc.enable()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (nothing here is compiled: torch's default wraps the mode in dynamo's disable, importing it)

    @property
    def peak(self) -> int:
        return max(self.trace, default=0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self._held:  # (a view or an in-place result: its storage counted once)
                    self._held.add(key)
                    self.live += size
                    weakref.finalize(storage, self._freed, key, size)
        self.trace.append(self.live)
        return out

    def _freed(self, key: int, size: int) -> None:
        self._held.discard(key)
        self.live -= size


def available_bytes(device: torch.device) -> int:
    """Free memory of ``device``: CUDA's free bytes, or the host's MemAvailable (Linux; 8 GiB elsewhere)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def memory_budget_bytes(memory_budget_gb: float | None, device) -> int | None:
    """The bytes one chunk of edge temporaries may take: ``memory_budget_gb`` (GB = 1e9 bytes) when
    given (inf: None, every edge at once), else ``AUTO_FRACTION`` of the device's free memory capped at
    ``AUTO_CAP_BYTES``."""
    if memory_budget_gb is not None:
        budget = float(memory_budget_gb)
        if not budget > 0:
            raise ValueError(f"memory_budget_gb must be a positive number of GB, got {memory_budget_gb!r}")
        return None if math.isinf(budget) else max(1, int(budget * 1e9))
    device = torch.device(device)
    cap = AUTO_CAP_BYTES["cuda" if device.type == "cuda" else "cpu"]
    return max(2**20, min(cap, int(AUTO_FRACTION * available_bytes(device))))


def one_pass_fits(one_pass_bytes: float, free_bytes: float) -> bool:
    """Whether the automatic budget runs every edge at once: an evaluation predicted to take ``one_pass_bytes`` that
    way (``evaluation_bytes(rows, edges, chunked=False)``) within ONE_PASS_SHARE of ``free_bytes``."""
    return one_pass_bytes <= ONE_PASS_SHARE * free_bytes


def evaluation_budget(model, memory_budget_gb: float | None, rows: int, edges: int, device,
                      free_bytes: float | None = None) -> int | None:
    """The chunk budget (bytes; None: every edge at once) of one evaluation of ``model`` over ``rows`` atoms and
    ``edges`` edges on ``device``: ``memory_budget_bytes(memory_budget_gb)`` when given, else one pass where it fits
    (``one_pass_fits`` in the device's free memory, ``free_bytes`` where the caller has just read it) and the
    automatic chunks where it does not."""
    free = available_bytes(device) if free_bytes is None and memory_budget_gb is None else free_bytes
    if memory_budget_gb is None and one_pass_fits(model.evaluation_bytes(rows, edges, chunked=False), free):
        return None
    return memory_budget_bytes(memory_budget_gb, device)


def edge_sum(graph, features: Callable, message: Callable, nodes: Sequence[torch.Tensor],
             rows: int | None = None, min_edges: int | None = None,
             receiver_nodes: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """[rows, D] (rows None: graph.receivers): Σ over the edges e into row i of
    ``message(features(vec_e), *(x[sender_e] for x in nodes), *(y[receiver_e] for y in receiver_nodes))``
    (``receiver_nodes``: node tensors a message also reads at its receiver, e.g. fairchem's edge step).

    features(vec [e, 3] float64) -> tuple of per-edge tensors (radial basis, envelope, …), a function of the
    edge vectors alone; message(feats, *gathered [e, ...]) -> [e, D] acts on each edge alone (no
    reduction over edges). With ``graph.memory_budget`` None every edge is evaluated at once under plain
    autograd (differentiable twice, parameter gradients) and ``features`` once per graph, shared by every
    block that passes the same function; otherwise in chunks whose saved tensors take at most
    ``graph.memory_budget`` bytes, but of at least ``min_edges`` (None: ``MIN_CHUNK_EDGES``; a message that
    is costly per edge runs well in smaller chunks) (one pass when all edges fit),
    ``features`` recomputed per chunk. (The backward's transient temporaries come on top of the saved
    tensors: a chunk's peak is about 1.6–1.8× its budget.)
    """
    sender, receiver = graph.edge_index
    rows = graph.receivers if rows is None else rows
    if graph.memory_budget is not None:
        def edge_message(vec, *gathered):
            return message(features(vec), *gathered)

        chunk = chunk_edges(edge_message, graph.edge_vec, sender, nodes, graph.memory_budget, min_edges,
                            receiver, receiver_nodes)
        if chunk is not None:
            return _ChunkedEdgeSum.apply(edge_message, chunk, rows, len(nodes), sender, receiver, graph.edge_vec,
                                         *nodes, *receiver_nodes)
    key = (features, torch.is_grad_enabled())  # features made without a graph never serve one with it
    feats = graph.edge_features_cache.get(key)
    if feats is None:
        feats = graph.edge_features_cache[key] = features(graph.edge_vec)
    return _scatter(message(feats, *(x[sender] for x in nodes), *(y[receiver] for y in receiver_nodes)), receiver,
                    rows)


def chunk_edges(message: Callable, edge_data: torch.Tensor, sender: torch.Tensor, nodes: Sequence[torch.Tensor],
                budget: int, min_edges: int | None = None, receiver: torch.Tensor | None = None,
                receiver_nodes: Sequence[torch.Tensor] = ()) -> int | None:
    """Edges per chunk whose saved tensors take at most ``budget`` bytes, but at least ``min_edges`` (None:
    ``MIN_CHUNK_EDGES``); None when every edge fits in one (then one plain pass)."""
    n_edges, least = int(sender.shape[0]), MIN_CHUNK_EDGES if min_edges is None else min(min_edges, MIN_CHUNK_EDGES)
    if n_edges <= least:
        return None
    gathered = [(x, sender) for x in nodes] + [(y, receiver) for y in receiver_nodes]
    chunk = max(least, int(budget // _bytes_per_edge(message, edge_data, gathered)))
    return chunk if chunk < n_edges else None


def chunked_edge_sum(message: Callable, edge_data: torch.Tensor, edge_index: torch.Tensor,
                     nodes: Sequence[torch.Tensor], rows: int, budget: int, min_edges: int | None = None) -> torch.Tensor:
    """[rows, D]: Σ over the edges e into row i of ``message(edge_data[e], *(x[sender_e] for x in nodes))``,
    ``edge_data`` [E, ...] any per-edge tensor (``edge_sum``'s: the edge vectors), ``edge_index`` [2, E]
    (sender, receiver), in chunks of ``chunk_edges`` edges (at least ``min_edges``: a message that is costly
    per edge, as MACE's, runs well in smaller chunks), each recomputed in the backward: gradients reach
    ``edge_data`` and ``nodes``, not the parameters ``message`` uses (evaluation only)."""
    sender, receiver = edge_index
    chunk = chunk_edges(message, edge_data, sender, nodes, budget, min_edges)
    if chunk is None:
        return _scatter(message(edge_data, *(x[sender] for x in nodes)), receiver, rows)
    return _ChunkedEdgeSum.apply(message, chunk, rows, len(nodes), sender, receiver, edge_data, *nodes)


MIN_CHUNK_ROWS = 128  # rows per chunk of ``chunked_rows``, whatever the budget
PROBE_ROWS = 16  # rows whose saved tensors are counted to size the chunks (< MIN_CHUNK_ROWS)


def chunked_rows(function: Callable, budget: int, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``function(*inputs)`` for a ``function`` that acts on each row alone (``inputs``: [n, ...] tensors, or None
    passed through), in row chunks whose saved tensors take at most ``budget`` bytes (at least
    ``MIN_CHUNK_ROWS`` rows; one call when all fit), each recomputed in the backward (torch.utils.checkpoint):
    per-atom blocks that keep much per row (MACE's symmetric contractions) then hold one chunk's tensors."""
    from torch.utils.checkpoint import checkpoint

    n = next(x for x in inputs if x is not None).shape[0]
    if n <= MIN_CHUNK_ROWS:
        return function(*inputs)
    probe = PROBE_ROWS
    with SavedBytes() as saved:
        function(*(None if x is None else x[:probe].detach().requires_grad_(x.is_floating_point()) for x in inputs))
    chunk = max(MIN_CHUNK_ROWS, int(budget // max(saved.bytes / probe, 1.0)))
    if chunk >= n:
        return function(*inputs)
    return torch.cat([checkpoint(function, *(None if x is None else x[start:start + chunk] for x in inputs),
                                 use_reentrant=False) for start in range(0, n, chunk)])


def chunked_local(function: Callable, edge_index: torch.Tensor, edge_data: torch.Tensor, rows: int, budget: int,
                  min_edges: int | None = None) -> torch.Tensor:
    """[rows, ...]: a strictly local model's per-row output (row i a function of the edges into i alone, as
    Allegro's energies) for rows [0, rows), in groups of consecutive receivers whose edges' saved tensors take
    at most ``budget`` bytes (at least ``min_edges`` edges; None: ``MIN_CHUNK_EDGES``), each group recomputed in the backward
    (torch.utils.checkpoint): no per-edge tensor is kept for all edges at once.

    edge_index [2, E] (sender, receiver), edge_data [E, ...] (gradients reach it). ``function(sub_index [2, e],
    sub_data [e, ...], nodes [m]) -> [m, ...]`` runs one group: its edges relabelled into ``nodes`` (global
    rows; the group's receivers first, in order, then the senders outside it), of which rows
    [0, group size) are kept. Edges into rows ≥ ``rows`` are left out."""
    from torch.utils.checkpoint import checkpoint

    sender, receiver = edge_index
    keep = receiver < rows
    order = torch.nonzero(keep).squeeze(1)[torch.argsort(receiver[keep], stable=True)]
    sorted_receivers = receiver[order]
    n_edges = int(order.shape[0])
    min_edges = MIN_CHUNK_EDGES if min_edges is None else min(min_edges, MIN_CHUNK_EDGES)
    scratch = torch.empty(int(max(rows, int(sender.max()) + 1 if sender.numel() else 0)), dtype=torch.long,
                          device=receiver.device)

    def group(start: int, stop: int, data: torch.Tensor) -> torch.Tensor:
        lo, hi = (int(torch.searchsorted(sorted_receivers, v)) for v in (start, stop))
        picked = order[lo:hi]
        senders = sender[picked]
        outside = torch.unique(senders[(senders < start) | (senders >= stop)])
        nodes = torch.cat([torch.arange(start, stop, device=receiver.device), outside])
        scratch[nodes] = torch.arange(nodes.shape[0], device=receiver.device)
        return function(scratch[edge_index[:, picked]], data[picked], nodes)[: stop - start]

    if n_edges <= min_edges:
        return group(0, rows, edge_data)
    probe_rows = int(sorted_receivers[min(PROBE_EDGES, n_edges) - 1]) + 1  # rows holding about PROBE_EDGES edges
    with SavedBytes() as saved:
        group(0, probe_rows, edge_data.detach().requires_grad_(True))
    probed = int(torch.searchsorted(sorted_receivers, probe_rows))
    chunk = max(min_edges, int(budget // max(2 * saved.bytes / max(probed, 1), 1.0)))  # saved tensors and their gradients
    if chunk >= n_edges:
        return group(0, rows, edge_data)
    bounds = sorted(set(sorted_receivers[::chunk].tolist()[1:]) | {0, rows})
    return torch.cat([checkpoint(group, start, stop, edge_data, use_reentrant=False)
                      for start, stop in zip(bounds[:-1], bounds[1:])])


def _scatter(messages: torch.Tensor, receiver: torch.Tensor, rows: int) -> torch.Tensor:
    out = messages.new_zeros((rows, *messages.shape[1:]))
    return out.index_add(0, receiver, messages)


def _bytes_per_edge(message, edge_vec, gathered) -> float:
    """Bytes autograd keeps per edge for ``message`` (saved tensors, gathered inputs, output, and their
    gradients in the backward), measured on the first ``PROBE_EDGES`` edges. ``gathered``: (node tensor, the
    edges' rows in it) pairs, in the order ``message`` takes them."""
    probe = slice(0, min(PROBE_EDGES, int(edge_vec.shape[0])))
    with SavedBytes() as saved:
        vec = edge_vec[probe].detach().requires_grad_(True)
        gathered = [x[rows[probe]].detach().requires_grad_(x.is_floating_point()) for x, rows in gathered]
        out = message(vec, *gathered)
    inputs = vec.numel() * vec.element_size() + sum(g.numel() * g.element_size() for g in gathered)
    return (saved.bytes + 2 * out.numel() * out.element_size() + 2 * inputs) / max(1, probe.stop)


class _ChunkedEdgeSum(torch.autograd.Function):
    """``edge_sum`` in chunks of ``chunk`` edges, recomputing each chunk in the backward. The first ``n_sender`` node
    tensors are read at each edge's sender, the others at its receiver."""

    @staticmethod
    def forward(ctx, message, chunk, rows, n_sender, sender, receiver, edge_vec, *nodes):
        out = None
        for start in range(0, sender.shape[0], chunk):
            part = slice(start, start + chunk)
            at = (sender[part], receiver[part])
            m = message(edge_vec[part], *(x[at[k >= n_sender]] for k, x in enumerate(nodes)))
            if out is None:
                out = m.new_zeros((rows, *m.shape[1:]))
            out.index_add_(0, receiver[part], m)
        ctx.message, ctx.chunk, ctx.n_sender = message, chunk, n_sender
        ctx.save_for_backward(sender, receiver, edge_vec, *nodes)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        sender, receiver, edge_vec, *nodes = ctx.saved_tensors
        need_vec = ctx.needs_input_grad[6]
        need_nodes = ctx.needs_input_grad[7:]
        grad_vec = torch.zeros_like(edge_vec) if need_vec else None
        grad_nodes = [torch.zeros_like(x) if need else None for x, need in zip(nodes, need_nodes)]
        for start in range(0, sender.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            at = (sender[part], receiver[part])
            with torch.enable_grad():
                vec = edge_vec[part].detach().requires_grad_(need_vec)
                gathered = [x.detach()[at[k >= ctx.n_sender]].requires_grad_(need)
                            for k, (x, need) in enumerate(zip(nodes, need_nodes))]
                m = ctx.message(vec, *gathered)
                wanted = [t for t in (vec, *gathered) if t.requires_grad]
                grads = iter(torch.autograd.grad(m, wanted, grad_out[receiver[part]], allow_unused=True)
                             if wanted else ())
            if need_vec:
                g = next(grads)
                if g is not None:
                    grad_vec[part] = g
            for k, need in enumerate(need_nodes):
                if need:
                    g = next(grads)
                    if g is not None:
                        grad_nodes[k].index_add_(0, at[k >= ctx.n_sender], g)
        return (None, None, None, None, None, None, grad_vec, *grad_nodes)
