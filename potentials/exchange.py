"""The ghost-exchange object that other packages' LAMMPS ML-IAP code paths call (MACE's ``lammps_class``,
nequip's ``lmp_mliap_data``), over our halo."""
from __future__ import annotations

from contextlib import contextmanager

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

    @classmethod
    def for_graph(cls, graph) -> tuple:
        """(exchange, species [ntotal]) for ``graph``: the rows the model updates are the owned atoms
        (layerwise) or every row; a rank that owns none gets one isolated dummy atom of species 0 first
        (its exchanges must still run in lock-step). Edge indices shift by ``exchange.pad``; the owned
        rows' energies are rows [pad, pad + graph.n_local) of the output."""
        pad = 1 if graph.receivers == 0 else 0
        species = torch.cat([graph.species.new_zeros(pad), graph.species])
        return cls(graph.halo, pad, pad + graph.receivers, len(species)), species

    def owned(self, per_atom: torch.Tensor, n_local: int) -> torch.Tensor:
        """The owned atoms' rows of a per-row output (padding dropped)."""
        return per_atom[self.pad: self.pad + n_local]

    def forward_exchange(self, feats: torch.Tensor, out: torch.Tensor, vec_len: int) -> None:
        out.copy_(torch.cat([feats[: self.pad], self.halo(feats[self.pad:])]))

    def reverse_exchange(self, grad: torch.Tensor, gout: torch.Tensor, vec_len: int) -> None:
        gout.copy_(torch.cat([grad[: self.pad], self.halo.adjoint(grad[self.pad:])]))


@contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` inside (as a package's own calculator runs its model: some
    of their modules build constants in it), put back after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
