"""The PME / P3M mesh split over the ranks holding a structure: each rank keeps a slab of mesh planes, none the whole
mesh (docs/architecture.md §3c; the replicated mesh is ``potentials.coulomb``'s other way).

Layout over P ranks (``graph.rank_alltoall``'s ``rank`` and ``size``): rank r owns the real-space planes
x ∈ [r·nx // P, (r + 1)·nx // P) of the mesh [nx, ny, nz], and the k-space planes ky ∈ [r·ny // P, (r + 1)·ny // P)
of its transform [nx, ny, nz // 2 + 1] (a slab FFT, as LAMMPS's PPPM remaps bricks to FFT layouts). One evaluation:

1. each rank spreads its own atoms' charges (torch-pme's interpolation weights) onto a *brick*: the smallest periodic
   box of mesh points their stencils touch;
2. the brick's planes are summed into the slabs that own them (one all-to-all: the mesh's reverse halo; a brick's
   edge planes are its neighbours' planes);
3. the 3-D FFT: r2c along z and c2c along y in each slab, an all-to-all transpose to ky planes, c2c along x;
4. torch-pme's filter on this rank's k-vectors (PME's kernel; P3M's influence function times it);
5. the inverse the same way back, the potential's planes back to the bricks that read them (one all-to-all: the
   mesh's forward halo), and each rank interpolates its own atoms.

The FFTs' normalisations are torch-pme's (none forward, none inverse, the volume divided outside). Every step is a
torch op or ``rank_alltoall`` (differentiable; its adjoint is the same exchange backwards), so forces, stress (the
k-vectors and weights read the strained cell) and training's second derivatives go through it. The exchanges'
backwards are collective: every rank runs the same chain of them (``_tied``), whatever its share.
"""
from __future__ import annotations

import numpy as np
import torch


def slab(n: int, size: int, rank: int) -> tuple:
    """[first, stop) of the ``n`` planes that ``rank`` of ``size`` owns."""
    return rank * n // size, (rank + 1) * n // size


def mesh_potential(calculator, q: torch.Tensor, positions: torch.Tensor, cell: torch.Tensor, ns: torch.Tensor,
                   alltoall) -> torch.Tensor:
    """[n, 1]: torch-pme's ``mesh_to_points(kspace_filter(points_to_mesh(q)))`` of the whole structure, at this rank's
    atoms (``q`` [n, 1], ``positions`` [n, 3]), with the mesh ``ns`` [3] split over ``alltoall``'s ranks in slabs
    (collective). ``calculator``: a torch-pme PME or P3M calculator (its interpolator and filter)."""
    interpolator = calculator.mesh_interpolator
    interpolator.update(cell, ns)
    interpolator.compute_weights(positions)
    shape = [int(n) for n in ns]
    w = interpolator.interpolation_weights  # [nodes, n, 3]
    stencil = w[interpolator.x_shifts, :, 0] * w[interpolator.y_shifts, :, 1] * w[interpolator.z_shifts, :, 2]
    indices = (interpolator.x_indices, interpolator.y_indices, interpolator.z_indices)  # [nodes³, n] each, mod n
    arcs = [_arc(i, n) for i, n in zip(indices, shape)]
    local = tuple((i - start) % n for i, (start, _), n in zip(indices, arcs, shape))
    brick = q.new_zeros([extent for _, extent in arcs]).index_put(local, stencil * q[:, 0], accumulate=True)
    remap = _BrickRemap(arcs, shape, alltoall)
    potential = _convolve(remap.to_slab(brick), calculator, cell, shape, alltoall)
    values = (remap.to_brick(potential)[local] * stencil).sum(dim=0)
    return values.reshape(-1, 1)


def _tied(tensor: torch.Tensor, received: list) -> torch.Tensor:
    """``tensor`` + 0 × the ``received`` pieces (or a step's data): every exchange takes its pieces from the step before
    and feeds the step after on every rank, whatever its share (no atoms, no planes, empty pieces), so that autograd
    runs the exchanges' backwards (collective) on every rank, in one chain, in the same order."""
    return tensor + 0 * sum((p[:1].real if p.is_complex() else p[:1]).sum() for p in received)


def _arc(indices: torch.Tensor, n: int) -> tuple:
    """(start, extent): the shortest periodic run of the mesh indices 0..n−1 that holds every one of ``indices``
    (extent n when no index is left out; 0 when there are none)."""
    occupied = np.flatnonzero(torch.bincount(indices.flatten().cpu(), minlength=n).numpy())
    if len(occupied) == 0:
        return 0, 0
    gaps = np.diff(np.append(occupied, occupied[0] + n)) - 1  # gaps[k]: free indices after occupied[k]
    k = int(np.argmax(gaps))
    if gaps[k] == 0:
        return 0, n
    return int(occupied[(k + 1) % len(occupied)]), n - int(gaps[k])


def _runs(first: int, count: int, n: int) -> list:
    """The periodic run of mesh indices first, first + 1, … (``count`` of them, ≤ ``n``) mod ``n`` as at most two plain
    runs: [(offset in the run, first index, length)]."""
    start = first % n
    head = min(count, n - start)
    return [(0, start, head)] + ([(head, 0, count - head)] if count > head else [])


def _blocks(header: list, ny: int, nz: int) -> tuple:
    """(the piece's shape [k, ey, ez], [(piece slices, slab slices)]) of the planes a brick sent: ``header`` is ey, ez,
    sy, sz, then (first slab plane, count) per run of planes; the slab is [lx, ny, nz]."""
    ey, ez, sy, sz, *x_runs = header
    blocks, row = [], 0
    for first, count in zip(x_runs[::2], x_runs[1::2]):
        for y_off, y, y_len in _runs(sy, ey, ny):
            for z_off, z, z_len in _runs(sz, ez, nz):
                blocks.append(((slice(row, row + count), slice(y_off, y_off + y_len), slice(z_off, z_off + z_len)),
                               (slice(first, first + count), slice(y, y + y_len), slice(z, z + z_len))))
        row += count
    return (row, ey, ez), blocks


class _BrickRemap:
    """This rank's brick (``arcs``: (start, extent) along x, y, z of the mesh ``shape``) to and from the ranks' slabs
    of x planes: which runs of brick planes go to which rank, and where the planes each rank sent lie in this slab
    (slices, no index arrays)."""

    def __init__(self, arcs, shape, alltoall):
        (sx, ex), (sy, ey), (sz, ez) = arcs
        nx, ny, nz = shape
        self.alltoall, self.extent = alltoall, (ex, ey, ez)
        first, stop = slab(nx, alltoall.size, alltoall.rank)
        self.slab_shape = (stop - first, ny, nz)
        self.sent, headers = [], []  # per rank: the runs of brick planes it gets [(row, count)], and their header
        for r in range(alltoall.size):
            x0, x1 = slab(nx, alltoall.size, r)
            rows, header = [], [ey, ez, sy, sz]
            for offset, plane, count in _runs(sx, ex, nx) if ex else ():
                lo, hi = max(plane, x0), min(plane + count, x1)
                if lo < hi:
                    rows.append((offset + lo - plane, hi - lo))
                    header += [lo - x0, hi - lo]
            self.sent.append(rows)
            headers.append(torch.tensor(header))
        self.received = [_blocks(h.tolist(), ny, nz) for h in alltoall(headers)]

    def to_slab(self, brick: torch.Tensor) -> torch.Tensor:
        """The slab [lx, ny, nz]: every rank's brick planes that fall in it, summed."""
        pieces = [torch.cat([brick[row:row + count] for row, count in rows]).reshape(-1) if rows
                  else brick.reshape(-1)[:0] for rows in self.sent]
        received = self.alltoall(pieces)
        out = _tied(brick.new_zeros(self.slab_shape), received)
        for (shape, blocks), piece in zip(self.received, received):
            piece = piece.reshape(shape)
            for inside, there in blocks:
                out[there] += piece[inside]
        return out

    def to_brick(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's brick of ``values`` [lx, ny, nz] (a slab on every rank): the adjoint of ``to_slab``."""
        pieces = []
        for shape, blocks in self.received:
            piece = _tied(values.new_zeros(shape), [values.reshape(-1)])
            for inside, there in blocks:
                piece[inside] = values[there]
            pieces.append(piece.reshape(-1))
        returned = self.alltoall(pieces)
        brick, ey, ez = _tied(values.new_zeros(self.extent), returned), self.extent[1], self.extent[2]
        for rows, piece in zip(self.sent, returned):
            piece, start = piece.reshape(sum(count for _, count in rows), ey, ez), 0
            for row, count in rows:
                brick[row:row + count] = piece[start:start + count]
                start += count
        return brick


def _convolve(mesh: torch.Tensor, calculator, cell: torch.Tensor, shape, alltoall) -> torch.Tensor:
    """The slab [lx, ny, nz] of the filtered mesh (torch-pme's ``KSpaceFilter.forward``) from the slab ``mesh`` of the
    charge density: the slab FFT of the module docstring."""
    nx, ny, nz = shape
    size, rank = alltoall.size, alltoall.rank
    x_slabs = [slab(nx, size, r) for r in range(size)]
    y_slabs = [slab(ny, size, r) for r in range(size)]
    half = nz // 2 + 1
    lx, (y0, y1) = mesh.shape[0], y_slabs[rank]
    # (an FFT library may refuse an empty transform: a rank that owns no planes has none to do)
    transformed = torch.fft.rfft2(mesh, dim=(1, 2), norm="backward") if mesh.numel() else _tied(
        mesh.new_zeros((lx, ny, half), dtype=torch.complex128 if mesh.dtype == torch.float64 else torch.complex64),
        [mesh.reshape(-1)])
    parts = alltoall([transformed[:, a:b].reshape(-1) for a, b in y_slabs])
    columns = torch.cat([p.reshape(b - a, y1 - y0, half) for p, (a, b) in zip(parts, x_slabs)], dim=0)
    filtered = torch.fft.ifft(torch.fft.fft(columns, dim=0, norm="backward") * _filter(calculator, cell, shape, y0, y1),
                              dim=0, norm="forward") if columns.numel() else columns
    parts = alltoall([filtered[a:b].reshape(-1) for a, b in x_slabs])
    rows = torch.cat([p.reshape(lx, b - a, half) for p, (a, b) in zip(parts, y_slabs)], dim=1)
    return torch.fft.irfft2(rows, s=(ny, nz), dim=(1, 2), norm="forward") if rows.numel() else \
        _tied(mesh.new_zeros((lx, ny, nz)), [rows.reshape(-1)])


def _filter(calculator, cell: torch.Tensor, shape, y0: int, y1: int) -> torch.Tensor:
    """[nx, y1 − y0, nz // 2 + 1]: torch-pme's k-space filter of the mesh ``shape`` at the planes ky ∈ [y0, y1)
    (its ``generate_kvectors_for_mesh`` restricted to them; differentiable in the cell)."""
    from torchpme.lib.kspace_filter import P3MKSpaceFilter

    nx, ny, nz = shape
    kwargs = {"dtype": cell.dtype, "device": cell.device}
    reciprocal = 2 * torch.pi * torch.linalg.inv(cell).T
    kx = (reciprocal[0] * nx) * torch.fft.fftfreq(nx, **kwargs).unsqueeze(-1)
    ky = (reciprocal[1] * ny) * torch.fft.fftfreq(ny, **kwargs)[y0:y1].unsqueeze(-1)
    kz = (reciprocal[2] * nz) * torch.fft.rfftfreq(nz, **kwargs).unsqueeze(-1)
    kvectors = kx[:, None, None] + ky[None, :, None] + kz[None, None, :]
    kspace = calculator.kspace_filter
    kernel = kspace.kernel.kernel_from_k_sq(torch.linalg.norm(kvectors, dim=3) ** 2)
    if isinstance(kspace, P3MKSpaceFilter):  # P3M's optimal influence function (mode 0), as its update computes it
        kspace.cell, kspace.ns_mesh = cell, torch.tensor(shape, device=cell.device)
        kernel = kspace._compute_influence(kvectors) * kernel
    return kernel
