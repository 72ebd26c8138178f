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
k-vectors and weights read the strained cell) and training's second derivatives go through it.
"""
from __future__ import annotations

import math

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


class _BrickRemap:
    """This rank's brick (``arcs``: (start, extent) along x, y, z of the mesh ``shape``) to and from the ranks' slabs
    of x planes: which brick planes go to which rank, and where the planes each rank sent land in this slab."""

    def __init__(self, arcs, shape, alltoall):
        (sx, ex), (sy, ey), (sz, ez) = arcs
        nx, ny, nz = shape
        self.alltoall, self.size, self.extent = alltoall, alltoall.size, (ex, ey, ez)
        self.first, stop = slab(nx, self.size, alltoall.rank)
        planes = (sx + torch.arange(ex)) % nx  # the brick's planes, as mesh planes
        bounds = torch.tensor([slab(nx, self.size, r)[0] for r in range(self.size)] + [nx])
        owner = torch.searchsorted(bounds, planes, right=True) - 1
        self.sent = [torch.nonzero(owner == r).flatten() for r in range(self.size)]  # brick planes for rank r
        headers = [torch.cat([torch.tensor([ey, ez, sy, sz]), planes[rows] - slab(nx, self.size, r)[0]])
                   for r, rows in enumerate(self.sent)]
        self.landing = []  # per rank: the flat slab indices [k·ey'·ez'] its planes add into
        for header in alltoall(headers):
            ey_s, ez_s, sy_s, sz_s = header[:4].tolist()
            y = (sy_s + torch.arange(ey_s)) % ny
            z = (sz_s + torch.arange(ez_s)) % nz
            self.landing.append(((header[4:, None, None] * ny + y[None, :, None]) * nz + z[None, None, :]).flatten())
        self.slab_shape = (stop - self.first, ny, nz)

    def to_slab(self, brick: torch.Tensor) -> torch.Tensor:
        """The slab [lx, ny, nz]: every rank's brick planes that fall in it, summed."""
        device = brick.device
        received = self.alltoall([brick[rows.to(device)].reshape(-1) for rows in self.sent])
        index = torch.cat(self.landing).to(device)
        flat = brick.new_zeros(math.prod(self.slab_shape)).index_add(0, index, torch.cat(received))
        return flat.reshape(self.slab_shape)

    def to_brick(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's brick of ``values`` [lx, ny, nz] (a slab on every rank): the adjoint of ``to_slab``."""
        device, flat = values.device, values.reshape(-1)
        returned = self.alltoall([flat[index.to(device)] for index in self.landing])
        rows = torch.cat(self.sent).to(device)
        ex, ey, ez = self.extent
        return values.new_zeros(self.extent).index_copy(0, rows, torch.cat(returned).reshape(-1, ey, ez))


def _convolve(mesh: torch.Tensor, calculator, cell: torch.Tensor, shape, alltoall) -> torch.Tensor:
    """The slab [lx, ny, nz] of the filtered mesh (torch-pme's ``KSpaceFilter.forward``) from the slab ``mesh`` of the
    charge density: the slab FFT of the module docstring."""
    nx, ny, nz = shape
    size, rank = alltoall.size, alltoall.rank
    x_slabs = [slab(nx, size, r) for r in range(size)]
    y_slabs = [slab(ny, size, r) for r in range(size)]
    half = nz // 2 + 1
    lx, (y0, y1) = mesh.shape[0], y_slabs[rank]
    transformed = torch.fft.fft(torch.fft.rfft(mesh, dim=2, norm="backward"), dim=1, norm="backward")
    parts = alltoall([transformed[:, a:b].reshape(-1) for a, b in y_slabs])
    columns = torch.cat([p.reshape(b - a, y1 - y0, half) for p, (a, b) in zip(parts, x_slabs)], dim=0)
    filtered = torch.fft.ifft(torch.fft.fft(columns, dim=0, norm="backward") * _filter(calculator, cell, shape, y0, y1),
                              dim=0, norm="forward")
    parts = alltoall([filtered[a:b].reshape(-1) for a, b in x_slabs])
    rows = torch.cat([p.reshape(lx, b - a, half) for p, (a, b) in zip(parts, y_slabs)], dim=1)
    return torch.fft.irfft(torch.fft.ifft(rows, dim=1, norm="forward"), n=nz, dim=2, norm="forward")


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
