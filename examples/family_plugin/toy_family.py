"""An example model family: your own PyTorch model in every tool of mlip-parallel.

``ToyNet`` is the user's model, plain PyTorch: per-atom energies from the atoms' species and the edge vectors,
through ``layers`` rounds of messages. It takes one hook, ``exchange(h)``, called on the node features before
every round after the first: that is where a distributed run refreshes the ghost atoms' rows from their owners
(one cutoff of ghosts serves every layer), and where a one-process run does nothing.

``ToyPotential`` wraps it as a ``potentials.Potential`` (the contract every tool evaluates: ``cutoff``,
``layers``, ``species``, ``hyperparameters``, ``forward(graph) -> per-atom energies``) and passes ``graph.halo``
as the hook. ``FAMILY`` is the record that names it in every tool: ``toy`` as the config key and spec prefix
(``model: {toy: toy.pt}`` in mlip-md, ``--model toy:toy.pt`` in mlip-lammps and mlip-train eval), with one
option, ``scale``. The package declares it in its pyproject.toml::

    [project.entry-points."mlip_parallel.families"]
    toy = "toy_family:FAMILY"

Its model files are ``torch.save({"architecture": {...}, "state_dict": {...}})``, read with
``weights_only=True``; ``python toy_family.py toy.pt`` writes one with random weights.
"""
from __future__ import annotations

import torch

from potentials import Family, Option, Potential


class ToyNet(torch.nn.Module):
    """A user's model: species [n] (indices), edges [2, E] (sender, receiver) and edge vectors [E, 3] (Å) ->
    per-atom energies [n] (eV)."""

    def __init__(self, n_species: int, cutoff: float, features: int = 16, layers: int = 2, basis: int = 8):
        super().__init__()
        self.cutoff = cutoff
        self.register_buffer("centres", torch.linspace(0.0, cutoff, basis))
        self.embedding = torch.nn.Embedding(n_species, features)
        self.filters = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(basis, features), torch.nn.SiLU(),
                                                               torch.nn.Linear(features, features))
                                           for _ in range(layers))
        self.updates = torch.nn.ModuleList(torch.nn.Linear(features, features) for _ in range(layers))
        self.readout = torch.nn.Sequential(torch.nn.Linear(features, features), torch.nn.SiLU(),
                                           torch.nn.Linear(features, 1))

    def forward(self, species, edge_index, edge_vec, exchange=lambda h: h):
        sender, receiver = edge_index
        r = torch.linalg.vector_norm(edge_vec, dim=1, keepdim=True)
        envelope = 0.5 * (torch.cos(torch.pi * r / self.cutoff) + 1.0)  # smooth to zero at the cutoff
        basis = torch.exp(-4.0 * (r - self.centres) ** 2) * envelope
        h = self.embedding(species)
        for k, (filter_net, update) in enumerate(zip(self.filters, self.updates)):
            if k > 0:
                h = exchange(h)  # neighbours' features are read below: ghost rows refreshed first
            messages = torch.zeros_like(h).index_add(0, receiver, filter_net(basis) * h[sender])
            h = h + torch.tanh(update(messages))
        return self.readout(h).squeeze(-1)


class ToyPotential(Potential):
    """``ToyNet`` as a potentials model: from a model file (``path``) or an ``architecture`` (what a potentials
    checkpoint of a fine-tuned one stores: {"species", "cutoff", "features", "layers"}, weights loaded after).
    ``scale`` multiplies the energies (an option, to show how options reach a family's model)."""

    def __init__(self, path: str | None = None, architecture: dict | None = None, scale: float = 1.0):
        if (path is None) == (architecture is None):
            raise TypeError("ToyPotential takes a model file (path) or an architecture, one of the two")
        saved = torch.load(path, map_location="cpu", weights_only=True) if path is not None else None
        architecture = dict(saved["architecture"] if saved is not None else architecture)
        super().__init__(architecture["species"])
        self.cutoff = float(architecture["cutoff"])
        self.layers = int(architecture["layers"])
        self.scale = float(scale)
        self.net = ToyNet(len(self.species), self.cutoff, architecture["features"], self.layers)
        if saved is not None:
            self.net.load_state_dict(saved["state_dict"])
        self.hyperparameters = {"architecture": architecture, "scale": self.scale}
        self.double()

    def forward(self, graph):
        energies = self.net(graph.species, graph.edge_index, graph.edge_vec.to(self.dtype), exchange=graph.halo)
        return self.scale * energies[: graph.n_local]


def load(spec: str, scale: float | None = None):
    """The ``toy`` family's models: ``spec`` is the model file's path."""
    return ToyPotential(spec, scale=1.0 if scale is None else scale)


def recognise(path: str):
    """'a toy model file' for a file this family reads (a torch archive holding an architecture), else None."""
    from potentials.families import archive_pickle

    _, data = archive_pickle(path)
    return "a toy model file" if b"architecture" in data and b"features" in data else None


FAMILY = Family(
    "toy", load, recognise=recognise,
    options={"scale": Option(float, 1.0, "factor on the energies", "> 0")},
    help="a toy model file (torch.save of {architecture, state_dict}; the example family of examples/family_plugin)",
    model_classes={"ToyPotential": "toy_family:ToyPotential"},
)


def write_model(path, species=("Cu",), cutoff: float = 4.0, features: int = 16, layers: int = 2, seed: int = 0):
    """Write a toy model file with random weights (seeded) at ``path``."""
    torch.manual_seed(seed)
    architecture = {"species": list(species), "cutoff": cutoff, "features": features, "layers": layers}
    net = ToyNet(len(species), cutoff, features, layers).double()
    torch.save({"architecture": architecture, "state_dict": net.state_dict()}, path)


if __name__ == "__main__":
    import sys

    write_model(sys.argv[1] if len(sys.argv) > 1 else "toy.pt")
