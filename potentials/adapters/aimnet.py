"""Adapter: an AIMNet2 model (the ``aimnet`` extra) as a potentials model, run through aimnet's own modules.

AIMNet2 predicts per-atom charges and adds their Coulomb energy. Its network makes three passes over the neighbours
within ``aev.rc_s`` (5 Å): each reads the neighbours' features ``a`` (and from the second on their charges), and the
first two end in its neutral charge equilibration (NSE), which spreads the difference between the structure's total
charge and the predicted charges' sum over the atoms by learned weights: a sum over the whole structure. Here:

* the graph's edges become aimnet's flat neighbour matrix (its mode 1: one padding row, ``nbmat`` and the edge
  vectors as ``shifts`` over a unit cell, so that its own geometry code reads exactly our strained edge vectors);
* before the second and third pass ``graph.halo`` refreshes the ghost rows of ``a`` and of the charges (one cutoff
  of ghosts: the halo is the network's 5 Å);
* the NSE's sums over the structure are sums over the owned rows, then over the ranks (``graph.rank_sum``); it is
  otherwise aimnet's ``ops.nse`` (epsilon 1e-6);
* the outputs run as aimnet's modules up to the per-atom energies (its ``Output`` and ``AtomicShift``; its
  ``AtomicSum`` is skipped: the energies stay per atom); its ``LRCoulomb`` becomes the model's ``long_range`` term
  (``potentials.coulomb``: every pair for a molecule, Ewald / PME / P3M for a periodic cell, exact on any number of
  ranks) minus aimnet's short-range part, which it computes on the network's neighbours with its own envelope (also
  for the ``SRCoulomb`` of a released model whose Coulomb is added outside it).

A model with a dispersion term (``DFTD3``: a 15 Å list) or two charge channels (open shell) is refused by name.
"""
from __future__ import annotations

import copy
import os

import torch
from ase.data import chemical_symbols

from ..base import PackageModel, Potential
from ..coulomb import ChargeModel
from ..errors import MLIPError
from ..graph import AtomGraph

RUN_AS_IS = ("Output", "AtomicShift")  # outputs run as aimnet's modules, per atom
SKIPPED = ("AtomicSum",)  # per-atom energies are summed by the caller
COULOMB = ("LRCoulomb", "SRCoulomb")  # the Coulomb energy: the model's long_range term, less the short-range part
NSE_EPSILON = 1.0e-6  # aimnet's ops.nse epsilon in AIMNet2._update_q


class AIMNetModelError(MLIPError, ValueError):
    """An AIMNet2 model that cannot be used here: a file or config aimnet cannot build, or a part not supported."""


def quiet_warp() -> None:
    """Keep warp (which aimnet's Coulomb and dispersion kernels import) from printing its banner on every rank, and,
    without CUDA, its warning that it finds no CUDA driver."""
    try:
        import warp
    except ImportError:
        return
    quiet = warp.LOG_WARNING if torch.cuda.is_available() else warp.LOG_ERROR
    warp.config.log_level = max(warp.config.log_level, quiet)


def shipped_config(name: str) -> str | None:
    """The path of aimnet's shipped model config ``name`` ("aimnet2" → aimnet/models/aimnet2.yaml), or None."""
    quiet_warp()
    import aimnet

    path = os.path.join(os.path.dirname(aimnet.__file__), "models", f"{name}.yaml")
    return path if os.path.isfile(path) else None


def read_architecture(spec: str) -> tuple:
    """(the model config as a dict, the state dict or None, the species or None) of ``spec``: a shipped config name,
    a YAML config path (random weights) or a released v2 ``.pt`` file (read with ``torch.load(weights_only=True)``)."""
    import yaml

    path = shipped_config(spec) or spec
    if not os.path.isfile(path):
        raise AIMNetModelError(f"{spec}: no such file, nor an AIMNet2 config shipped with aimnet (aimnet2, "
                               "aimnet2_rxn, ...)")
    if path.endswith((".yaml", ".yml")):
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f), None, None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        config = yaml.safe_load(data["model_yaml"]) if isinstance(data.get("model_yaml"), str) else data["model_yaml"]
        species = data.get("implemented_species")
        return config, data["state_dict"], species
    except Exception as exc:  # noqa: BLE001 - torch.load and a missing key raise many kinds
        raise AIMNetModelError(f"{spec}: not an AIMNet2 v2 model file ({type(exc).__name__}: "
                               f"{(str(exc).splitlines() or [''])[0][:200]})") from None


def build(architecture: dict, seed: int):
    """aimnet's model of ``architecture`` (its config), its untrained weights drawn from ``seed``."""
    from aimnet.config import build_module

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return build_module(copy.deepcopy(architecture))


class AIMNet(ChargeModel, PackageModel, Potential):
    """An AIMNet2 model (module docstring). ``model``: a config shipped with aimnet ("aimnet2"), a YAML config (both
    with untrained weights drawn from ``seed``) or a released v2 ``.pt`` file; or ``architecture``, a config as a
    dict (a potentials checkpoint's), for a state dict to be loaded into. ``long_range``: the Coulomb term's settings
    (``potentials.coulomb.Coulomb``; a model with an ``LRCoulomb`` or ``SRCoulomb`` output needs one). The species are
    the released model's, else every element aimnet's embedding holds (H–Eu); ``dtype`` float32 (aimnet's) or
    float64. Each structure's total charge is its ``charge`` (``AtomGraph.system``; 0 where not given)."""

    EVALUATION_BYTES_PER_ROW = 20_000
    EVALUATION_BYTES_PER_EDGE = 6_000  # per neighbour: its geometry basis, the neighbours' features and their grads

    def __init__(self, model: str | None = "aimnet2", seed: int = 0, architecture: dict | None = None,
                 long_range=None, dtype=None):
        state, species = None, None
        if architecture is None:
            architecture, state, species = read_architecture(str(model))
        try:
            net = build(architecture, seed)
        except Exception as exc:  # noqa: BLE001 - aimnet's builder raises many kinds
            raise AIMNetModelError(f"aimnet cannot build this config ({type(exc).__name__}: {exc})") from None
        if state is not None:
            missing, unexpected = net.load_state_dict(state, strict=False)
            if missing:
                raise AIMNetModelError(f"{model}: the state dict lacks {len(missing)} weight(s), e.g. {missing[0]}")
        if getattr(net, "num_charge_channels", 1) != 1:
            raise AIMNetModelError("an open-shell AIMNet2 (two charge channels: NSE with spin) is not supported yet")
        kinds = {name: type(m).__name__ for name, m in net.outputs.named_children()}
        unsupported = {n: k for n, k in kinds.items() if k not in RUN_AS_IS + SKIPPED + COULOMB}
        if unsupported:
            raise AIMNetModelError(f"the output(s) {unsupported} are not supported yet (a DFTD3 dispersion term needs "
                                   "its 15 Å neighbours: a halo of that width)")
        super().__init__(species=species and [chemical_symbols[z] for z in species] or
                         list(chemical_symbols[1:net.afv.num_embeddings]))
        self.aimnet = net
        # what aimnet itself trains: not the geometry basis's constants, which it keeps fixed (requires_grad False)
        self.fixed_weights = frozenset(n for n, p in net.named_parameters() if not p.requires_grad)
        self.cutoff, self.layers = float(net.aev.rc_s), len(net.mlps)
        self.coulomb_outputs = [n for n, k in kinds.items() if k in COULOMB]
        self.needs_long_range = bool(self.coulomb_outputs)
        self.register_buffer("numbers", torch.tensor([chemical_symbols.index(s) for s in self.species]),
                             persistent=False)
        self.hyperparameters = {"architecture": architecture, "seed": int(seed)}
        self.to(dtype or torch.float32)
        self.set_long_range(long_range)

    def set_long_range(self, settings) -> None:
        """``ChargeModel.set_long_range``, the Coulomb constant aimnet's own (its Hartree × Bohr: CODATA 2014's)."""
        super().set_long_range(settings)
        if self.long_range is not None and self.coulomb_outputs:
            self.long_range.prefactor = 2 * getattr(self.aimnet.outputs, self.coulomb_outputs[0])._factor

    @property
    def package_module(self) -> torch.nn.Module:
        return self.aimnet

    # ------------------------------------------------------------------ training contract
    def named_weights(self) -> list:
        return [(n, p) for n, p in self.aimnet.named_parameters() if n not in self.fixed_weights]

    def _shifts(self) -> torch.Tensor:
        """aimnet's per-element energy shifts of this model's species [len(species), 1] (a copy)."""
        return self.aimnet.outputs.atomic_shift.shifts.weight[self.numbers]

    def reference_energies(self):
        return self._shifts().detach().cpu().double().numpy().reshape(-1).copy()

    def set_reference_energies(self, energies) -> None:
        weight = self.aimnet.outputs.atomic_shift.shifts.weight
        with torch.no_grad():
            weight[self.numbers] = torch.as_tensor(energies, dtype=weight.dtype, device=weight.device).reshape(-1, 1)

    def save_native(self, path, data=None) -> None:
        """``path``: aimnet's own v2 model file, written by aimnet's exporter (``aimnet export``: the long-range
        modules taken out of the config and the short-range Coulomb kept, the energy shifts in float64, the metadata
        its calculator reads): ``aimnet.models.base.load_model`` and ``AIMNet2Calculator`` load it, and so does
        ``aimnet:PATH`` here (with ``long_range`` beside it)."""
        import contextlib
        import io
        import tempfile

        import yaml
        from aimnet.train.export_model import export_model

        from ..files import atomic_write

        with tempfile.TemporaryDirectory() as tmp:
            files = {name: os.path.join(tmp, name) for name in ("weights.pt", "model.yaml", "model.sae", "out.pt")}
            torch.save({k: v.detach().cpu() for k, v in self.aimnet.state_dict().items()}, files["weights.pt"])
            with open(files["model.yaml"], "w", encoding="utf-8") as f:
                yaml.safe_dump(self.hyperparameters["architecture"], f, sort_keys=False)  # (outputs run in order)
            with open(files["model.sae"], "w", encoding="utf-8") as f:  # the shifts are in the weights already
                yaml.safe_dump({int(z): 0.0 for z in self.numbers.tolist()}, f)
            export = getattr(export_model, "callback", export_model)  # (a click command: its function)
            with contextlib.redirect_stdout(io.StringIO()):
                export(files["weights.pt"], files["out.pt"], files["model.yaml"], files["model.sae"], None, None)
            with open(files["out.pt"], "rb") as source, atomic_write(path) as f:
                f.write(source.read())

    # ------------------------------------------------------------------ the input aimnet reads
    def _inputs(self, graph: AtomGraph) -> dict:
        """aimnet's mode-1 input of ``graph``: its rows then one padding row, ``nbmat`` [rows + 1, M] (padding: rows),
        the edge vectors as ``shifts`` over a unit cell with every coordinate 0."""
        from aimnet import nbops

        rows, device, dtype = graph.n_nodes, self.device, self.dtype
        receivers, senders = graph.edge_index[1], graph.edge_index[0]
        counts = torch.bincount(receivers, minlength=rows)
        width = max(int(counts.max()) if len(receivers) else 0, 1)
        order = torch.argsort(receivers, stable=True)
        receiver = receivers[order]
        slot = torch.arange(len(order), device=device) - (torch.cumsum(counts, 0) - counts)[receiver]
        nbmat = torch.full((rows + 1, width), rows, dtype=torch.int32, device=device)
        nbmat[receiver, slot] = senders[order].to(torch.int32)
        shifts = torch.zeros((rows + 1, width, 3), dtype=dtype, device=device).index_put(
            (receiver, slot), graph.edge_vec[order].to(dtype))
        structures = 1 if graph.structure is None else len(graph.system["charge"])
        molecule = torch.zeros(rows, dtype=torch.long, device=device) if graph.structure is None else graph.structure
        charge = [c or 0 for c in (graph.system or {}).get("charge") or [0] * structures]
        data = {"coord": torch.zeros((rows + 1, 3), dtype=dtype, device=device),
                "numbers": torch.cat([self.numbers[graph.species], self.numbers.new_zeros(1)]),
                "charge": torch.tensor(charge, dtype=dtype, device=device),
                "mol_idx": torch.cat([molecule, molecule.new_full((1,), structures - 1)]),
                "nbmat": nbmat, "shifts": shifts, "cell": torch.eye(3, dtype=dtype, device=device)}
        return nbops.calc_masks(nbops.set_nb_mode(data))

    def _with_halo(self, x: torch.Tensor, graph: AtomGraph) -> torch.Tensor:
        """``x`` [rows + 1, ...] with its ghost rows refreshed (the padding row kept)."""
        return torch.cat([graph.halo(x[: graph.n_nodes]), x[graph.n_nodes:]])

    def _update_charges(self, data: dict, out: torch.Tensor, graph: AtomGraph, delta_q: bool) -> None:
        """aimnet's ``AIMNet2._update_q`` with its NSE's sums over the structure taken over the owned rows and the
        ranks (``AtomGraph.structure_sums``): q ← q_u + f_u / (Σ f_u + ε) (Q − Σ q_u), f_u the squared weights."""
        q_u, weight, delta_a = out.split([1, 1, out.shape[-1] - 2], dim=-1)
        q_u = data["charges"] + q_u if delta_q else q_u
        f = weight.pow(2)
        molecule = data["mol_idx"].to(torch.long)
        sums = graph.structure_sums(torch.cat([f, q_u], dim=1))
        total_f, total_q = sums[:, :1] + NSE_EPSILON, sums[:, 1:]
        data["charges"] = q_u + f / total_f[molecule] * (data["charge"] - total_q)[molecule]
        data["a"] = data["a"] + delta_a.view_as(data["a"])

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        from aimnet import nbops, ops

        if graph.n_receivers is None and graph.n_nodes > graph.n_local:
            raise AIMNetModelError("AIMNet2 runs in layerwise mode only: its charges are summed over the structure, "
                                   "which wide mode's redundant ghost rows would count twice")
        net, data = self.aimnet, self._inputs(graph)
        a = net.afv(data["numbers"])
        data["a"] = a.unflatten(-1, (net.nfeature, net.nshifts_s)) if net.d2features else a
        data["charge"] = data["charge"].unsqueeze(-1)
        data = net.aev(data)
        for k, mlp in enumerate(net.mlps):
            if k == 0:
                inputs = net._prepare_in_a(data)
            else:
                data["a"], data["charges"] = self._with_halo(data["a"], graph), self._with_halo(data["charges"], graph)
                inputs = torch.cat([net._prepare_in_a(data), net._prepare_in_q(data)], dim=-1)
            out = nbops.mask_i_(mlp(inputs), data, mask_value=0.0)
            if k < len(net.mlps) - 1:
                self._update_charges(data, out, graph, delta_q=k > 0)
            else:
                data["aim"] = out
        charges = self._with_halo(data["charges"], graph).squeeze(-1)
        data["charges"], data["charge"] = charges, data["charge"].squeeze(-1)
        for name, module in net.outputs.named_children():
            if type(module).__name__ in RUN_AS_IS:
                data = module(data)
        energies = data["energy"][: graph.n_local].to(torch.float64)
        if not self.coulomb_outputs:
            return energies
        return energies + self.long_range(charges[: graph.n_nodes], graph, self.cutoff) \
            - self._short_range_coulomb(data, ops)[: graph.n_local]

    def _short_range_coulomb(self, data: dict, ops) -> torch.Tensor:
        """Per row: aimnet's short-range Coulomb energy (½ k Σ_j fc(r_ij) q_i q_j / r_ij over the network's neighbours,
        fc its envelope within ``rc``), which its Coulomb output takes off the full Coulomb energy (float64)."""
        from aimnet import nbops

        module = getattr(self.aimnet.outputs, self.coulomb_outputs[0])
        if type(module).__name__ == "LRCoulomb" and not module.subtract_sr:
            return torch.zeros(len(data["charges"]), dtype=torch.float64, device=self.device)
        d = data["d_ij"].to(torch.float64)
        fc = ops.exp_cutoff(d, module.rc.to(d)) if module.envelope == "exp" else ops.cosine_cutoff(d, module.rc.item())
        q = data["charges"].to(torch.float64)
        q_i, q_j = nbops.get_ij(q, data)
        pair = nbops.mask_ij_(fc * q_i * q_j / d, data, 0.0)
        return module._factor * pair.sum(-1)
