"""The memory pre-flight: before a rank builds its ghosts and pair lists (or a trainer its model and graphs),
estimate what they will take and stop every rank with one line when the fullest rank would not fit in the
memory it has (``memory_everywhere``: the smallest over the ranks, so that all of them decide alike). (Memory only:
whether a model is exact distributed is ``verify.py``'s, the self-check command ``check.py``.)

The estimate reads only the atom count and the box (no neighbour search, which is what exhausts memory
when the input is wrong: atoms 0.3 Å apart, a 100 Å cutoff in a 16 Å cell). Atoms are taken as spread
evenly over the decomposed region along each dimension; along a periodic dimension a shell wider than the
cell counts every image. A rank's rows are its owned atoms and the ghosts within the ghost reach + skin
of its brick; the pairs searched are every row's neighbours within cutoff + skin (the pair search runs
over all rows); the edges are the receivers' neighbours within the cutoff. Bytes: the model's own
estimate ``Potential.evaluation_bytes(rows, edges)`` (``training_bytes`` for training), the search's
``SEARCH_BYTES_PER_PAIR`` and one chunk of the memory budget. It errs on the safe side, by 1.0-3× of what the
model's memory model gives for the rows, pairs and edges actually built (tests/test_mistakes.py) and of the
measured peak (benchmarks/preflight.py): it stops inputs that need many times the memory and lets the others run.
"""
from __future__ import annotations

import math
import os
import resource
import socket
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from potentials.messages import available_bytes, memory_budget_bytes, one_pass_fits

from .domain import Domain
from .errors import MemoryLimitError
from .grid import Grid

SEARCH_BYTES_PER_PAIR = 128  # a searched pair: the search's and the candidates' indices, its vector while cut
LATTICE_MARGIN = 0.4  # the ghost shell widened by this share of the mean spacing between atoms (``rank_load``)


class RankLoad(NamedTuple):
    """What the fullest rank would hold: ``rows`` owned + ghost atoms, ``pairs`` pairs the neighbour search
    finds among them, ``edges`` the model's edges (into its receivers), ``bytes`` in all."""

    rows: int
    pairs: int
    edges: int
    bytes: int


def covered(domain: Domain, width, reach: float) -> np.ndarray:
    """[3] per dimension: the share of the region's atoms (periodic: of one period, images counted, so
    it may exceed 1) within a slab of ``width`` (fractional, [3]) widened by ``reach`` Å on both sides."""
    span = domain.hi - domain.lo
    share = (np.asarray(width, dtype=np.float64) + 2 * domain.fractional_distance(reach)) / span
    return np.where(domain.pbc, share, np.minimum(share, 1.0))


def neighbours(n_atoms: int, domain: Domain, r: float) -> float:
    """Atoms within ``r`` Å of an atom: those of the cube of side 2r around it, times the sphere's share
    of the cube in the dimensions where the atoms extend beyond it (a layer: a disc's share of a square)."""
    cube = covered(domain, np.zeros(3), r)
    sphere = {0: math.pi / 6, 1: math.pi / 4}.get(int(np.sum(~domain.pbc & (cube >= 1.0))), 1.0)
    return n_atoms * float(np.prod(cube)) * sphere


def rank_load(model, n_atoms: int, domain: Domain, dims, r_ghost: float, skin: float = 0.0,
              layerwise: bool = True, budget_bytes: int | None = None) -> RankLoad:
    """The estimated load of one rank of a ``dims`` brick grid (uniform cut planes) over ``domain``
    holding ``n_atoms``: ghosts within ``r_ghost`` + ``skin`` Å, pairs within ``model.cutoff`` + ``skin``
    searched among all rows, edges within the cutoff into the owned atoms (``layerwise``) or every row."""
    brick = (domain.hi - domain.lo) / np.asarray(dims, dtype=np.float64)
    # atoms sit on lattice planes, not evenly: a plane just inside the ghost shell's face adds up to a plane's
    # spacing to its thickness (fcc Cu, cutoff 5 Å: 0.84 of the rows counted evenly). The shell is widened by 0.4 of
    # the mean spacing between atoms, which keeps the rows' estimate at 1.0-2.4 of the count on the test geometries
    spacing = (abs(np.linalg.det(domain.cell)) * float(np.prod(domain.hi - domain.lo)) / max(n_atoms, 1)) ** (1 / 3)
    rows = n_atoms * float(np.prod(covered(domain, brick, r_ghost + skin + LATTICE_MARGIN * spacing)))
    pairs = rows * neighbours(n_atoms, domain, model.cutoff + skin)
    receivers = n_atoms / float(np.prod(dims)) if layerwise else rows
    edges = receivers * neighbours(n_atoms, domain, model.cutoff)
    total = model.evaluation_bytes(rows, edges, chunked=budget_bytes is not None) + SEARCH_BYTES_PER_PAIR * pairs \
        + (budget_bytes or 0)
    return RankLoad(int(rows), int(pairs), int(edges), int(total))


def _cgroup_free() -> float:
    """Bytes this process's cgroup (v2) may still take; inf when unlimited or unknown."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
        base = Path("/sys/fs/cgroup") / path.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return math.inf
        return int(limit) - int((base / "memory.current").read_text())
    except (OSError, StopIteration, ValueError):
        return math.inf


def _address_space_free() -> float:
    """Bytes left under this process's address-space limit (``ulimit -v``); inf when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return math.inf
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        used = 0
    return soft - used


HOST_MEMORY_REFRESH_S = 1.0  # the host's free memory is read again after this long (a read: ~40 µs, 5 files)
_host_memory_read = [-math.inf, 0.0]  # [when (time.monotonic()), bytes]


def host_memory() -> float:
    """The host's available memory and what this process's cgroup still allows, the smaller, in bytes: read at most
    once per HOST_MEMORY_REFRESH_S (an ASE optimizer calls the calculator every few milliseconds on small
    structures, and the pre-flight's decisions are orders of magnitude apart)."""
    now = time.monotonic()
    if now - _host_memory_read[0] > HOST_MEMORY_REFRESH_S:
        _host_memory_read[:] = now, min(float(available_bytes("cpu")), _cgroup_free())
    return _host_memory_read[1]


def rank_memory(device, ranks_here: int) -> float:
    """Bytes this rank may use: a GPU's free memory, or on the host the available memory (and what the
    cgroup still allows, ``host_memory``) shared by the ``ranks_here`` ranks of this node, at most this process's
    address-space headroom."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return float(available_bytes(device))
    return min(host_memory() / max(1, ranks_here), _address_space_free())


def memory_everywhere(backend, device) -> float:
    """The bytes a rank has (``rank_memory``), the smallest over the ranks (collective)."""
    hosts = backend.allgather(socket.gethostname()) if backend.size > 1 else [socket.gethostname()]
    here = rank_memory(device, hosts.count(socket.gethostname()))
    return float(backend.allreduce(np.array([here]), op="min")[0]) if backend.size > 1 else here


def check_rank_memory(backend, model, n_atoms: int, domain: Domain, dims, r_ghost: float, skin: float = 0.0,
                      layerwise: bool = True, memory_budget_gb: float | None = None) -> float:
    """The memory pre-flight of an evaluation, and the chunk budget it runs with (collective; the same on every
    rank). Returns ``memory_budget_gb`` (GB; inf: every edge at once) when given, else inf where the fullest rank's
    estimated load with every edge at once (``rank_load``) fits (``potentials.messages.one_pass_fits``) in the memory
    a rank has (``memory_everywhere``), else the automatic chunk budget. Raises MemoryLimitError on every rank when
    the fullest rank's load at that budget exceeds what a rank has."""
    have = memory_everywhere(backend, model.device)
    if memory_budget_gb is None and one_pass_fits(
            rank_load(model, n_atoms, domain, dims, r_ghost, skin, layerwise, None).bytes, have):
        return math.inf
    budget = memory_budget_bytes(memory_budget_gb, model.device)
    load = rank_load(model, n_atoms, domain, dims, r_ghost, skin, layerwise, budget)
    if load.bytes > have:
        raise MemoryLimitError(
            f"not enough memory: the fullest of the {backend.size} rank(s) would hold about {load.rows:,} atoms with "
            f"ghosts and search {load.pairs:.3g} pairs within the cutoff + skin ({model.cutoff + skin:g} Å), about "
            f"{load.bytes / 1e9:.3g} GB, but a rank has {have / 1e9:.3g} GB; use more ranks, a smaller cutoff or skin, "
            f"a smaller memory_budget_gb, or a machine with more memory{density(n_atoms, domain)}")
    return math.inf if budget is None else budget / 1e9


def check_training_memory(backend, model, structures, per_step: int, graph_parallel: bool,
                          state_bytes: float = 0.0) -> None:
    """Raise MemoryLimitError on every rank (collective) when ``per_step`` copies of the largest training
    structure's graph (``structures``: ``training.Structure``; split over the ranks when ``graph_parallel``),
    plus ``state_bytes`` (what training adds to the loaded weights: their gradients, the optimizer's state, the
    average; this rank's), would take more than a rank has: training keeps every edge's tensors for the force
    loss's double backward (``Potential.training_bytes``)."""
    worst, name = 0.0, None
    for s in structures:
        domain = Domain.from_positions(s.positions, s.cell, s.pbc)
        dims = Grid.for_ranks(backend.size, domain).dims if graph_parallel else (1, 1, 1)
        load = rank_load(model, len(s.positions), domain, dims, model.cutoff)
        need = model.training_bytes(load.rows, load.edges) + SEARCH_BYTES_PER_PAIR * load.pairs
        if need > worst:
            worst, name = need, s.source
    have = memory_everywhere(backend, model.device)
    state = float(backend.allreduce(np.array([state_bytes]), op="max")[0]) if backend.size > 1 else state_bytes
    if worst * per_step + state > have:
        weights = (f" and the weights' training state (gradients, optimizer moments, average) {state / 1e9:.3g} GB"
                   if state > 0.01 * have else "")
        raise MemoryLimitError(
            f"not enough memory: {name} ({model.cutoff:g} Å cutoff) needs about {worst / 1e9:.3g} GB to train on, "
            f"{per_step} at a time per rank: {worst * per_step / 1e9:.3g} GB{weights}, but a rank has "
            f"{have / 1e9:.3g} GB; use a smaller batch_size or cutoff, more ranks (parallel: graph splits each "
            f"structure; parallel: pipeline splits the weights over stages), model.freeze or model.lora, or check "
            f"the structure")


TRAINING_COPIES = 5  # a trained weight's bytes: the weight, its gradient, AdamW's two moments, the EMA's copy
SMALL_MODEL = {"features": 256, "layers": 32}  # at most these: no check (at most ~10^8 weights)


def extrapolated_weights(construct, features: int, layers: int) -> int | None:
    """The weights of the model ``construct(features=F, layers=L)`` would build at F = ``features`` and
    L = ``layers``, counted on small builds (F = 4, 8, 16; L = 1, 2) without building it: a layer's weights
    are a quadratic in F (linear maps F → F; tensor products with one multiplicity from the edges) and
    layers add alike. None when a fourth build (F = 32) does not follow the fit."""
    count = {}
    for f in (4, 8, 16, 32):
        for depth in (1, 2):
            if f == 32 and depth == 2:
                continue
            count[f, depth] = sum(p.numel() for p in construct(features=f, layers=depth).parameters())

    def fit(values):  # the quadratic through (4, v0), (8, v1), (16, v2), evaluated at x
        return lambda x: float(np.polyval(np.polyfit([4.0, 8.0, 16.0], values, 2), x))

    per_layer = fit([count[f, 2] - count[f, 1] for f in (4, 8, 16)])
    base = fit([2 * count[f, 1] - count[f, 2] for f in (4, 8, 16)])
    if abs(base(32) + per_layer(32) - count[32, 1]) > 0.5 + 1e-9 * count[32, 1]:
        return None
    return int(round(base(features) + layers * per_layer(features)))


def check_parameter_memory(backend, name: str, construct, hyperparameters: dict, defaults: dict, device,
                           itemsize: int, stages: int = 1) -> None:
    """Raise MemoryLimitError on every rank (collective) when a new ``name`` model of ``hyperparameters``
    (``defaults``: its constructor's) wider or deeper than ``SMALL_MODEL`` would not fit a rank for training:
    ``TRAINING_COPIES`` × its weights (``extrapolated_weights``) × ``itemsize``, split over ``stages``."""
    size = {key: hyperparameters.get(key, defaults.get(key)) for key in SMALL_MODEL}
    if any(not isinstance(v, int) for v in size.values()) or all(size[k] <= SMALL_MODEL[k] for k in SMALL_MODEL):
        return
    count = extrapolated_weights(construct, size["features"], size["layers"])
    if count is None:
        return
    need = TRAINING_COPIES * count * itemsize / stages
    have = memory_everywhere(backend, device)
    if need > have:
        raise MemoryLimitError(
            f"not enough memory: a {name} of features {size['features']} and layers {size['layers']} has about "
            f"{count:.3g} weights, {need / 1e9:.3g} GB per rank to train (weights, gradients, optimizer state, "
            f"average), but a rank has {have / 1e9:.3g} GB; choose smaller model.hyperparameters, or parallel: "
            f"pipeline over more stages")


def density(n_atoms: int, domain: Domain) -> str:
    """", or check the structure: ... atoms/Å³" for a periodic box (a solid or liquid has 0.01-0.2)."""
    if not domain.pbc.all():
        return ""
    return f"; or check the structure: {n_atoms / abs(float(np.linalg.det(domain.cell))):.3g} atoms/Å³"
