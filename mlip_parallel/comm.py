"""Spatial-decomposition communication (LAMMPS comm_brick, kept small): four verbs over a cached plan.

* ``exchange(arrays)`` moves owned atoms that left the subdomain to their new owner.
* ``borders(positions, ids, r_ghost)`` builds the swap plan and the ghost atoms.
* ``forward_comm(x)`` replays the plan: owner rows → ghost rows.
* ``reverse_comm(g)`` replays it backwards, adding ghost rows into their owners.

``forward_comm`` and ``reverse_comm`` are autograd Functions, each the other's adjoint and each
differentiable again, so ``create_graph=True`` works through the halo. Every rank runs every swap
(zero-length messages where it has nothing), in the same order, forward and backward.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import numpy as np
import torch

from .domain import Domain
from .grid import Grid

_ID, _IMAGE = 6, slice(3, 6)  # packed atom record: fractional coords (3), image (3), global id (1)


def _row_bytes(array: np.ndarray) -> int:
    return array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))


def _pack(arrays: dict, keys, mask) -> np.ndarray:
    """The ``mask``ed rows of every per-atom array in ``keys`` as one uint8 [m, Σ row bytes] buffer."""
    m = int(np.count_nonzero(mask))
    return np.concatenate([np.ascontiguousarray(arrays[k][mask]).view(np.uint8).reshape(m, _row_bytes(arrays[k]))
                           for k in keys], axis=1)


def _unpack(buffer: np.ndarray, like: dict, keys) -> dict:
    """Inverse of ``_pack``: per-array rows of the dtypes and row shapes of ``like``."""
    out, offset = {}, 0
    for k in keys:
        width = _row_bytes(like[k])
        raw = np.ascontiguousarray(buffer[:, offset:offset + width])
        out[k] = raw.view(like[k].dtype).reshape((len(buffer),) + like[k].shape[1:])
        offset += width
    return out


@dataclass
class Swap:
    """One step of the plan. ``send_idx`` rows (owned or ghost) go to ``dest`` with the periodic
    ``image`` shift added; ``recv_count`` rows arrive from ``source`` into ghost slots starting at
    local row ``recv_start``. ``direction`` +1 sends to the upper neighbour along ``dim``."""

    dim: int
    direction: int
    dest: int | None
    source: int | None
    send_idx: np.ndarray
    image: np.ndarray
    recv_start: int
    recv_count: int


class Comm:
    """Halo exchange for one rank of ``grid`` over ``domain``, talking through ``backend``.

    After ``borders``: n_local owned rows, then n_ghost ghost rows; ``ghost_ids`` [n_ghost] global ids
    of the ghosts' owners and ``ghost_image`` [n_ghost, 3] integer cell shifts, so that a ghost's
    position is its owner's position + ghost_image @ cell.
    """

    def __init__(self, backend, grid: Grid, domain: Domain):
        self.backend, self.grid, self.domain = backend, grid, domain
        self.rank = backend.rank
        self.lo, self.hi = grid.bounds(self.rank)
        self.plan: list[Swap] = []
        self.n_local = self.n_ghost = 0
        self.ghost_ids = np.zeros(0, dtype=np.int64)
        self.ghost_image = np.zeros((0, 3), dtype=np.int64)
        self._index_cache: dict = {}

    # ---------------------------------------------------------------- exchange
    def exchange(self, arrays: dict) -> dict:
        """Migrate owned atoms to the ranks whose subdomains hold them (collective).

        ``arrays``: per-atom numpy arrays with equal first dimension, including "positions" [N, 3] Å;
        an optional "image" [N, 3] int array is updated by the wrapping. Returns the new dict: kept
        atoms first, then arrivals. Atoms may cross several subdomains.
        """
        arrays = dict(arrays)
        positions, image = self.domain.wrap(arrays["positions"])
        arrays["positions"] = positions
        if "image" in arrays:
            arrays["image"] = arrays["image"] + image
        keys = sorted(arrays)
        for d in range(3):
            for _ in range(self.grid.dims[d]):
                s = self.domain.wrapped_fractional(arrays["positions"])[:, d]
                up = s >= self.hi[d]
                down = s < self.lo[d]
                if self.grid.periodic[d]:
                    go_down = (self.lo[d] - s) % 1.0 < (s - self.hi[d]) % 1.0
                    up, down = (up | down) & ~go_down, (up | down) & go_down
                for step, mask in ((1, up), (-1, down)):
                    if self.grid.neighbour(self.rank, d, step) is None:
                        mask[:] = False
                if self.backend.allreduce(int(up.sum() + down.sum()), op="max") == 0:
                    break
                stay = ~(up | down)
                moved = {k: [arrays[k][stay]] for k in keys}
                for step, mask in ((1, up), (-1, down)):  # one message per direction: rows of raw bytes
                    dest = self.grid.neighbour(self.rank, d, step)
                    source = self.grid.neighbour(self.rank, d, -step)
                    arrived = _unpack(self.backend.sendrecv(_pack(arrays, keys, mask), dest, source), arrays, keys)
                    for k in keys:
                        moved[k].append(arrived[k])
                arrays = {k: np.concatenate(v) for k, v in moved.items()}
        return arrays

    # ----------------------------------------------------------------- borders
    def borders(self, positions: np.ndarray, ids: np.ndarray, r_ghost: float) -> None:
        """Build the swap plan and the ghosts (collective).

        positions: [n_local, 3] owned atoms, wrapped into the cell (Å); ids: [n_local] global ids;
        r_ghost: ghost shell thickness (Å). Every atom image within r_ghost of this subdomain (in each
        fractional direction) becomes a ghost: corners come from forwarding earlier dimensions'
        ghosts, wide shells from several hops, small periodic cells from sending to oneself.
        """
        n_local = len(positions)
        frac = self.domain.fractional(np.asarray(positions, dtype=np.float64))
        held = np.column_stack([frac, np.zeros((n_local, 3)), np.asarray(ids, dtype=np.float64)])
        cut = self.domain.fractional_distance(r_ghost) * (1 + 1e-9) + 1e-12
        coords = self.grid.coords(self.rank)
        plan = []
        for d in range(3):
            hops = self.grid.hops(d, cut[d])
            base = np.arange(len(held))
            sources = {1: base, -1: base}
            for _ in range(hops):
                for direction in (1, -1):
                    dest = self.grid.neighbour(self.rank, d, direction)
                    source = self.grid.neighbour(self.rank, d, -direction)
                    src = sources[direction]
                    if dest is None:
                        sel = src[:0]
                    elif direction == 1:
                        sel = src[held[src, d] >= self.hi[d] - cut[d]]
                    else:
                        sel = src[held[src, d] < self.lo[d] + cut[d]]
                    image = np.zeros(3, dtype=np.int64)
                    if not 0 <= coords[d] + direction < self.grid.dims[d]:
                        image[d] = -direction  # crossing the periodic boundary
                    out = held[sel].copy()
                    out[:, d] += image[d]
                    out[:, 3 + d] += image[d]
                    received = self.backend.sendrecv(out, dest, source)
                    plan.append(Swap(d, direction, dest, source, sel, image, len(held), len(received)))
                    sources[direction] = np.arange(len(held), len(held) + len(received))
                    held = np.concatenate([held, received])
        self.plan = plan
        self.n_local, self.n_ghost = n_local, len(held) - n_local
        self.ghost_image = held[n_local:, _IMAGE].round().astype(np.int64)
        self.ghost_ids = held[n_local:, _ID].round().astype(np.int64)
        self._index_cache = {}

    # ------------------------------------------------------------ replay verbs
    def forward_comm(self, x: torch.Tensor) -> torch.Tensor:
        """Owned rows [n_local, ...] → ghost rows [n_ghost, ...] (differentiable, collective)."""
        return _ForwardComm.apply(x, self)

    def reverse_comm(self, g: torch.Tensor) -> torch.Tensor:
        """Ghost rows [n_ghost, ...] → [n_local, ...]: each ghost row added into its owner's row
        (differentiable, collective). The adjoint of ``forward_comm``."""
        return _ReverseComm.apply(g, self)

    def ghost_positions(self, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        """Ghost positions [n_ghost, 3] from owned ``positions`` [n_local, 3] and ``cell`` [3, 3]."""
        key = ("image", positions.dtype, str(positions.device))
        if key not in self._index_cache:  # kept with the plan: no per-call host → device copy
            self._index_cache[key] = torch.as_tensor(self.ghost_image, dtype=positions.dtype, device=positions.device)
        return self.forward_comm(positions) + self._index_cache[key] @ cell

    def describe(self) -> str:
        """The plan as text, one line per swap (for debugging: print it on every rank)."""
        lines = [f"rank {self.rank}: grid {self.grid.dims} coords {self.grid.coords(self.rank)} "
                 f"owned {self.n_local} ghosts {self.n_ghost}"]
        for k, sw in enumerate(self.plan):
            lines.append(f"  swap {k}: dim {'xyz'[sw.dim]} {'up' if sw.direction > 0 else 'down'} "
                         f"send {len(sw.send_idx)} -> {sw.dest} image {sw.image.tolist()} | recv "
                         f"{sw.recv_count} <- {sw.source} into [{sw.recv_start}, {sw.recv_start + sw.recv_count})")
        return "\n".join(lines)

    # --------------------------------------------------------------- internals
    def _send_index(self, k: int, device) -> torch.Tensor:
        key = (k, str(device))
        if key not in self._index_cache:
            self._index_cache[key] = torch.as_tensor(self.plan[k].send_idx, device=device)
        return self._index_cache[key]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.n_local:
            raise ValueError(f"forward_comm expects {self.n_local} owned rows, got {x.shape[0]}")
        buf = x.new_empty((self.n_local + self.n_ghost,) + tuple(x.shape[1:]))
        buf[: self.n_local] = x
        for k, sw in enumerate(self.plan):
            sent = buf[self._send_index(k, x.device)]
            buf[sw.recv_start: sw.recv_start + sw.recv_count] = self.backend.sendrecv(
                sent, sw.dest, sw.source, recv_rows=sw.recv_count)
        return buf[self.n_local:]

    def _reverse(self, g: torch.Tensor) -> torch.Tensor:
        if g.shape[0] != self.n_ghost:
            raise ValueError(f"reverse_comm expects {self.n_ghost} ghost rows, got {g.shape[0]}")
        buf = g.new_zeros((self.n_local + self.n_ghost,) + tuple(g.shape[1:]))
        buf[self.n_local:] = g
        for k in reversed(range(len(self.plan))):
            sw = self.plan[k]
            back = self.backend.sendrecv(buf[sw.recv_start: sw.recv_start + sw.recv_count], sw.source,
                                         sw.dest, recv_rows=len(sw.send_idx))
            buf.index_add_(0, self._send_index(k, g.device), back)
        return buf[: self.n_local]


class _ForwardComm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm._forward(x)

    @staticmethod
    def backward(ctx, grad):
        return _ReverseComm.apply(grad.contiguous(), ctx.comm), None


class _ReverseComm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, comm):
        ctx.comm = comm
        return comm._reverse(g)

    @staticmethod
    def backward(ctx, grad):
        return _ForwardComm.apply(grad.contiguous(), ctx.comm), None


def eager_under_compile(method):
    """``method`` run eagerly where torch.compile traces a model (a graph break there: MPI inside), as
    ``torch.compiler.disable`` does. That decorator imports torch._dynamo (0.8 s in every process), so it is applied
    at the first call made while torch._dynamo is loaded: no compiled code can run before it is."""
    disabled = None

    @functools.wraps(method)
    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return method(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(method)
        return disabled(*args, **kwargs)

    return call


class FeatureHalo:
    """The halo hook of a decomposed graph: ``h`` [m ≥ n_local, ...] → [n_local + n_ghost, ...], the
    owned rows followed by the ghost rows copied from their owners' current values (one exchange);
    ``adjoint(g)`` [n_local + n_ghost, ...] → the same shape, each ghost row added into its owner's row
    and the ghost rows zero (one reverse exchange). Both differentiable."""

    def __init__(self, comm: Comm):
        self.comm = comm

    @eager_under_compile  # MPI inside: a torch.compile'd model breaks its graph here and runs it eagerly
    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        owned = h[: self.comm.n_local]
        return torch.cat([owned, self.comm.forward_comm(owned)])

    @eager_under_compile
    def adjoint(self, g: torch.Tensor) -> torch.Tensor:
        n = self.comm.n_local
        return torch.cat([g[:n] + self.comm.reverse_comm(g[n:]), torch.zeros_like(g[n:])])


class _SumOverRanks(torch.autograd.Function):
    """x summed over the ranks of ``backend``; its gradient is the incoming gradients summed the same way (the sum
    is its own adjoint), itself differentiable again."""

    @staticmethod
    def forward(ctx, x, backend):
        ctx.backend = backend
        return backend.allreduce_(x.detach().clone())

    @staticmethod
    def backward(ctx, grad):
        return _SumOverRanks.apply(grad.contiguous(), ctx.backend), None


class RankSum:
    """``AtomGraph.rank_sum`` over a decomposition: ``x`` (a tensor, the same shape on every rank) summed over the
    ranks, differentiable (one all-reduce forward, one backward; collective: every rank calls it alike)."""

    def __init__(self, backend):
        self.backend = backend

    @eager_under_compile
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _SumOverRanks.apply(x, self.backend)


class _GatherOverRanks(torch.autograd.Function):
    """Every rank's ``x`` [n_r, ...] concatenated in rank order; the gradient of this rank's rows is the sum over the
    ranks of the gradients of those rows (a sum over ranks, then this rank's slice: differentiable again)."""

    @staticmethod
    def forward(ctx, x, backend, where: dict):
        parts = backend.allgather(x.detach().cpu().numpy())
        sizes = [len(p) for p in parts]
        ctx.backend, ctx.start, ctx.stop = backend, sum(sizes[:backend.rank]), sum(sizes[:backend.rank + 1])
        where["first"] = ctx.start
        return torch.as_tensor(np.concatenate(parts), device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return _SumOverRanks.apply(grad.contiguous(), ctx.backend)[ctx.start:ctx.stop], None, None


class RankGather:
    """``AtomGraph.rank_gather`` over a decomposition: (every rank's ``x`` [n_r, ...] in rank order, the first row of
    this rank's), differentiable (collective: every rank calls it alike)."""

    def __init__(self, backend):
        self.backend = backend

    @eager_under_compile
    def __call__(self, x: torch.Tensor) -> tuple:
        where: dict = {}
        gathered = _GatherOverRanks.apply(x, self.backend, where)
        return gathered, where["first"]


class _AlltoallOverRanks(torch.autograd.Function):
    """``pieces[r]`` (1-D) sent to rank r, for every r; returns the P pieces received, in rank order. Its adjoint is
    the same exchange backwards (each received piece's gradient returned to its sender), differentiable again."""

    @staticmethod
    def forward(ctx, backend, *pieces):
        ctx.backend = backend
        return tuple(_alltoall(backend, [p.detach().contiguous() for p in pieces]))

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + tuple(_AlltoallOverRanks.apply(ctx.backend, *[g.contiguous() for g in grads]))


def _alltoall(backend, pieces: list) -> list:
    """One message to each rank, P pairwise swaps (step s: to rank + s, from rank − s); received pieces in rank
    order. Complex tensors travel as their real pairs."""
    rank, size = backend.rank, backend.size
    received = [None] * size
    for step in range(size):
        dest, source = (rank + step) % size, (rank - step) % size
        piece = pieces[dest]
        out = backend.sendrecv(torch.view_as_real(piece) if piece.is_complex() else piece, dest, source)
        if piece.is_complex():  # (an empty piece has no stride-1 pair to view)
            out = torch.view_as_complex(out.contiguous()) if len(out) else out.new_zeros(0, dtype=piece.dtype)
        received[source] = out
    return received


class RankAlltoall:
    """``AtomGraph.rank_alltoall`` over a decomposition: ``pieces`` (one 1-D tensor per rank, of one dtype) sent to
    their ranks, the pieces every rank sent here returned in rank order, differentiable (collective). ``rank`` and
    ``size`` say which of how many ranks this is (a mesh split over the ranks reads them). Its backward is
    collective too, and autograd runs it only where the pieces lie on a path from the inputs differentiated to the
    result: a caller derives every piece from its data (an empty one as a slice of it) and uses every returned
    piece in the next step (an empty one times 0), on every rank alike, whatever a rank's share."""

    def __init__(self, backend):
        self.backend, self.rank, self.size = backend, backend.rank, backend.size

    @eager_under_compile
    def __call__(self, pieces: list) -> list:
        if len(pieces) != self.size:
            raise ValueError(f"rank_alltoall: {len(pieces)} pieces for {self.size} ranks")
        return list(_AlltoallOverRanks.apply(self.backend, *pieces))
