"""The ghost-exchange object that other packages' LAMMPS ML-IAP code paths call (MACE's ``lammps_class``,
nequip's ``lmp_mliap_data``), over our halo."""
from __future__ import annotations

import torch


class GhostExchange:
    """What LAMMPS ML-IAP hands a model for its ghost atoms, answered by ``graph.halo``.

    Rows: ``pad`` rows of local padding (a dummy atom on a rank that owns none: the packages' blocks
    cannot run on zero rows), the owned rows, then the ghost rows; ``nlocal`` = pad + the rows the
    model updates, ``ntotal`` = all rows. ``forward_exchange(feats, out, vec_len)``: features [ntotal,
    vec_len] → ``out``, the padding and owned rows kept, ghost rows copied from their owners;
    ``reverse_exchange(grad, gout, vec_len)``: the adjoint, ghost rows' gradients added into their
    owners, ghost rows zero. Both differentiable (a backward with create_graph records them)."""

    def __init__(self, halo, pad: int, nlocal: int, ntotal: int):
        self.halo, self.pad, self.nlocal, self.ntotal = halo, pad, nlocal, ntotal

    def forward_exchange(self, feats: torch.Tensor, out: torch.Tensor, vec_len: int) -> None:
        out.copy_(torch.cat([feats[: self.pad], self.halo(feats[self.pad:])]))

    def reverse_exchange(self, grad: torch.Tensor, gout: torch.Tensor, vec_len: int) -> None:
        gout.copy_(torch.cat([grad[: self.pad], self.halo.adjoint(grad[self.pad:])]))
