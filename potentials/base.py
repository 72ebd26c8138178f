"""What every model in this package is: a torch module mapping an AtomGraph to per-atom energies."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from ase.data import atomic_numbers, chemical_symbols

from .errors import UnknownSpeciesError
from .graph import AtomGraph


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


class BlockPotential(Potential):
    """A message-passing model written as parts, so that it can also run as pipeline stages:

    ``context(graph)`` edge features every part may read (recomputed by each stage from its own
    geometry); ``embed(graph, ctx)`` → h; ``block(k, h, graph, ctx)`` → h for k < ``layers`` (block
    k > 0 refreshes ghost rows with ``graph.halo`` first); ``readout(h, graph, ctx)`` → per-atom
    energies [n_local]. h is one tensor [n, ``pipeline_width``] (what travels between stages).
    ``parts_of(k)`` names the parameters of each part; ``forward`` chains them.
    """

    pipeline_width: int

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        ctx = self.context(graph)
        h = self.embed(graph, ctx)
        for k in range(self.layers):
            h = self.block(k, h, graph, ctx)
        return self.readout_energies(h, graph, ctx)

    def context(self, graph: AtomGraph):  # pragma: no cover - abstract
        raise NotImplementedError

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def part_modules(self) -> dict:
        """{"embed": [modules], "block": [module of block k], "readout": [modules]}: who owns which
        parameters (a pipeline stage optimises only its parts')."""
        raise NotImplementedError  # pragma: no cover


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
