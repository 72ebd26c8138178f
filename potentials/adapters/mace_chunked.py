"""MACE's interaction and product blocks within a memory budget (evaluation: forces and stress, no second
derivative): each interaction block's edge step — ``conv_tp(node_feats[sender], edge_attrs,
conv_tp_weights(edge_feats) · cutoff)`` summed into the receivers — in chunks of edges recomputed in the backward
(``messages.chunked_edge_sum``), with the block's own submodules in MACE's order, and each product block in row
chunks under checkpointing (``messages.chunked_rows``). The interaction blocks' forward is copied from mace-torch
``COPIED_FROM`` and runs only under it; any other version keeps MACE's own forward, with a note."""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from ..messages import chunked_edge_sum, chunked_rows

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


def runs_chunked(block) -> bool:
    """Whether the interaction ``block`` runs ``chunked_interaction`` within a memory budget: a class ``CHUNKED``
    lists, without cuEquivariance's fused convolution, under a mace-torch ``COPIED_FROM``."""
    return type(block).__name__ in CHUNKED and not hasattr(block, "conv_fusion") and mace_version() in COPIED_FROM


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
            for block in mace.interactions:
                name = type(block).__name__
                if runs_chunked(block):
                    block.forward = functools.partial(chunked_interaction, block, budget, shared)
                    patched.append(block)
                elif name not in _NOTED:
                    _NOTED.add(name)
                    copied = mace_version() in COPIED_FROM
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
