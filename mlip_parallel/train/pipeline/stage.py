"""One pipeline stage's execution: ``PipelineStage`` runs the sweeps (F, B1, A, B and the split WA/WB)
of the actions a schedule gives it, on its own parts of the model, and exchanges node features and their
gradients with its neighbours (messages tagged by micro-batch, sweep and part; every receive of a step
posted ahead, sends never waited for). It never decides the order of actions (``schedule``)."""
from __future__ import annotations

import time

import numpy as np
import torch

from potentials.base import stage_parts

from ...errors import MLIPError
from ..training import Counts, batch_geometry, loss_terms, prediction_errors, structure_energies, symmetric_stress
from .schedule import DEFERRED, Action, Sweep, deferred_parts, is_split
from .split_backward import _Seeds, _startable, backward_split


class PipelineError(MLIPError, ValueError):
    """A pipeline layout that cannot work: stages vs ranks or blocks, micro-batches, boundaries, schedule."""


def _wait_for_device(device) -> None:
    """On a CUDA device, wait for its queued work (so that a timing is device time, not the time to queue
    kernels or, with NCCL, messages); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)



def _tag(m: int, sweep: str, part: int) -> int:
    return (m * len(Sweep) + list(Sweep).index(Sweep(sweep))) * 4 + part



class PipelineStage:
    """Stage ``stage`` of ``stages``: runs blocks [boundaries[stage], boundaries[stage + 1]) of
    ``model``, which holds exactly this stage's parts (plus the embedding on stage 0, the readout on
    the last). ``peers``: global ranks of the previous and next stage (None at the ends), ``comm`` the backend they
    talk through.
    ``batches[m]``: micro-batch m (a ``Batch``) — the same on every stage; ``counts``: sizes of the whole
    global batch (the loss normalisation). ``recompute``: keep only each micro-batch's stage input
    between its forward and its first backward sweep, and recompute the stage's forward then
    (activation recomputation).

    ``run(actions, batches, counts, rule)`` executes this stage's schedule actions, accumulating the
    parameters' gradients; ``evaluate(actions, batches, model)`` runs F and B1 without a double-backward
    graph and returns this stage's error sums. Where ``actions`` hold WA(m) / WB(m), A / B of micro-batch m
    compute only what the neighbours wait for and WA / WB the deferred parameter gradients (``backward_split``).
    ``merge_a_into_b`` (default True): without WA, A computes only what the next stage waits for and B
    the rest of A with its own (``merge`` during a run; see the module docstring).
    Every receive of a run is posted (``irecv``) before its first action; sends are ``isend``s, waited
    for at its end. ``timings``: (action, seconds of compute, seconds from its start to its last send or
    None; waits excluded) of the last run. With ``measuring`` set (the trainer's timed warm-up steps): on a
    CUDA device the stream is synchronised before and after each action, after each receive and before
    the clock reads a send, so that timings are device time, not the time to queue kernels; and
    ``memory[m]``: the bytes micro-batch m held (``schedule.Costs.memory``'s "F", "B1", "A", "WA", "WB":
    the storages autograd saved in F and in B1, each once, the gradients A left to B under ``merge``,
    and those A and B captured for WA and WB; "merged": 1 where B1's graph is held until B).
    """

    def __init__(self, model, stage: int, stages: int, boundaries, peers, comm, recompute: bool = False):
        expected = stage_parts(model.n_blocks, boundaries, stage)
        if model.parts != expected:
            raise PipelineError(f"stage {stage} must hold exactly the parts {sorted(expected)}, "
                                f"the model holds {sorted(model.parts)}")
        self.model, self.stage, self.stages, self.recompute = model, stage, stages, recompute
        self.first, self.last = stage == 0, stage == stages - 1
        self.blocks = range(boundaries[stage], boundaries[stage + 1])
        self.prev, self.next = peers
        self.comm = comm  # the backend its messages go through (isend, irecv): its trainer's
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        # trained weights of no part (SevenNet's radial coefficients, read by every block): every stage holds a copy,
        # whose gradient the trainer sums over all stages, so that the copies stay equal
        self.shared = [p for name, p in model.named_parameters() if p.requires_grad and model.part_of(name) is None]
        self.net = model  # the module the sweeps run: the trained model, or e.g. its EMA in ``evaluate``
        self.evaluating = False
        self.state: dict = {}
        self.pending: list = []
        self.inbox: dict = {}
        self.timings: list = []
        self.measuring, self.memory, self.sent = False, {}, None
        self.in_flight_peak, self.wait_seconds, self.run_seconds = 0, 0.0, 0.0
        self.merge_a_into_b, self.merge = True, False

    # ---------------------------------------------------------------- messages
    # Each message is tagged with (micro-batch, sweep, part): a schedule may interleave sweeps of
    # different micro-batches differently on the two ends of a link.
    def _incoming(self, action) -> list:
        """The messages ``action`` receives: (part, shape, dtype, source) each."""
        m, sweep = action.microbatch, action.sweep
        batch, dtype = self.batches[m], self.net.dtype
        n, structures = len(batch.species), batch.size
        rows = self.net.state_rows(n, len(batch.i))
        forces = [(1, (n, 3), torch.float64), (2, (structures, 3, 3), torch.float64)]
        if sweep == Sweep.F and not self.first:
            return [(0, (rows, self.net.feature_width(self.blocks.start)), dtype, self.prev)]
        if sweep == Sweep.A and not self.first:
            return [(0, (rows, self.net.feature_width(self.blocks.start)), dtype, self.prev)] + \
                [(part, shape, dt, self.prev) for part, shape, dt in forces]
        if sweep in (Sweep.B1, Sweep.B) and not self.last:
            h_out = (0, (rows, self.net.feature_width(self.blocks.stop)), dtype, self.next)
            return [h_out] + ([(part, shape, dt, self.next) for part, shape, dt in forces] if sweep == Sweep.B1 else [])
        return []

    def message_device(self):
        """Where messages live: the stage's device, or the host where the backend cannot move CUDA tensors (gloo:
        ranks sharing a GPU; an MPI that is not CUDA-aware)."""
        return self.net.device if self.net.device.type != "cuda" or self.comm.cuda_aware else torch.device("cpu")

    def _post_receives(self, actions) -> None:
        where = self.message_device()
        for action in actions:
            for part, shape, dtype, source in self._incoming(action):
                out = torch.empty(shape, dtype=dtype, device=where)
                key = action.microbatch, action.sweep, part
                self.inbox[key] = self.comm.irecv(out, source, tag=_tag(*key)), out

    def _send(self, tensor, to, m, sweep, part=0):
        message = tensor.detach().to(self.message_device()).contiguous()
        self.pending.append(self.comm.isend(message, to, tag=_tag(m, sweep, part)))
        self._synchronize()
        self.sent = time.perf_counter(), self.wait_seconds  # when, and the waits until then (``timings``)

    def _recv(self, m, sweep, part=0):
        """The posted receive of (micro-batch, sweep, part), once it has arrived."""
        request, out = self.inbox.pop((m, str(sweep), part))
        start = time.perf_counter()
        request.wait()
        self._synchronize()
        self.wait_seconds += time.perf_counter() - start
        return out.to(self.net.device)

    def _synchronize(self) -> None:
        """While ``measuring``: wait for the device's queued work (timings are device time)."""
        if self.measuring:
            _wait_for_device(self.net.device)

    def _saved_bytes(self, m, phase):
        """While ``measuring``: a context adding the bytes of the storages autograd saves (each once,
        the parameters' not) to ``memory[m][phase]``; else none."""
        import contextlib
        if not self.measuring:
            return contextlib.nullcontext()
        counted = self._counted(m)

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in counted["seen"]:
                counted["seen"].add(storage.data_ptr())
                counted[phase] += storage.nbytes()
            return t.detach()  # not t: a saved output would hold its own grad_fn, a cycle gc cannot free
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def _counted(self, m) -> dict:
        """Micro-batch m's memory record (``measuring``); "merged" marks B1's graph held until B (the
        last stage's A runs entirely in B under ``merge``)."""
        return self.memory.setdefault(m, {"F": 0, "B1": 0, "A": 0, "WA": 0, "WB": 0,
                                          "merged": int(self.merge and self.last),
                                          "seen": {p.untyped_storage().data_ptr() for p in self.parameters}})

    # ------------------------------------------------------------------ sweeps
    def forward(self, m: int) -> None:
        batch = self.batches[m]
        keep = not self.recompute or self.evaluating  # else keep only the input; rebuild before the first backward
        with self._saved_bytes(m, "F") if keep else torch.no_grad():
            built = self._geometry(batch)  # before the receive: it needs the positions only (shortens a wait)
            h_in = None if self.first else self._recv(m, "F")
            geometry, h_in, out = self._stage_forward(batch, h_in, built)
        self.state[m] = {"geometry": geometry, "h_in": h_in, "out": out} if keep else {"h_in_value": h_in}
        if not self.last:
            self._send(out, self.next, m, "F")
        self.in_flight_peak = max(self.in_flight_peak, len(self.state))

    def _geometry(self, batch) -> tuple:
        """(geometry, model context) of ``batch``: fresh position and strain leaves, edges, radial basis."""
        geometry = batch_geometry(batch)
        return geometry, self.net.context(geometry.graph)

    def _stage_forward(self, batch, h_in, built):
        """(geometry, h_in leaf, output) of this stage's blocks on ``built`` (``_geometry(batch)``): h [N, width],
        or E [B] on the last."""
        geometry, ctx = built
        if self.first:
            h = self.net.embed(geometry.graph, ctx)
        else:
            h_in = h_in.detach().requires_grad_(True)
            h = h_in
        for k in self.blocks:
            h = self.net.block(k, h, geometry.graph, ctx)
        if not self.last:
            return geometry, h_in, h
        return geometry, h_in, structure_energies(batch, self.net.readout_energies(h, geometry.graph, ctx))

    def _graph(self, m: int) -> dict:
        """Micro-batch m's state with its forward graph (recomputed here under ``recompute``)."""
        s = self.state[m]
        if "h_in_value" in s:
            batch = self.batches[m]
            geometry, h_in, out = self._stage_forward(batch, s.pop("h_in_value"), self._geometry(batch))
            s.update(geometry=geometry, h_in=h_in, out=out)
        return s

    def _backward(self, m, sweep, tensors, seeds, inputs) -> None:
        """Seeds from tensors into the ``inputs``' ``.grad`` and the parameters' (keeping the graph); the
        parameters' part deferred to the action of ``DEFERRED[sweep]`` when the schedule holds one."""
        tensors, seeds = _startable(tensors, seeds)
        if is_split(Action(self.stage, sweep, m), self.deferred):
            deferred = self.state[m][DEFERRED[sweep]] = backward_split(tensors, seeds, inputs, self.parameters)
            if self.measuring:
                self.memory.setdefault(m, {})[str(DEFERRED[sweep])] = deferred.nbytes
        elif tensors:  # B frees the graph as it goes (the micro-batch's last use of it)
            torch.autograd.backward(tensors, seeds, retain_graph=sweep != Sweep.B, inputs=self.parameters + inputs)

    def force_backward(self, m: int) -> None:
        s, batch = self._graph(m), self.batches[m]
        geometry, out = s["geometry"], s["out"]
        if self.last:
            g_out = torch.ones_like(out)  # dE/dE
            if self.evaluating:
                self.errors[m] = self.errors.get(m, 0) + prediction_errors(batch, energy=out.detach())
        else:
            g_out = self._recv(m, "B1").requires_grad_(not self.evaluating)
        inputs = [geometry.pos, geometry.strain] + ([] if self.first else [s["h_in"]])
        with self._saved_bytes(m, "B1"):
            grads = torch.autograd.grad(out, inputs, g_out, create_graph=not self.evaluating, allow_unused=True)
        f_pos, f_strain = (g if g is not None else torch.zeros_like(x) for g, x in zip(grads[:2], inputs[:2]))
        carry_pos, carry_strain = f_pos.detach(), f_strain.detach()
        if not self.last:
            carry_pos = carry_pos + self._recv(m, "B1", 1)
            carry_strain = carry_strain + self._recv(m, "B1", 2)
        if not self.evaluating:
            s.update(g_out=g_out, f_pos=f_pos, f_strain=f_strain, g_in=None if self.first else grads[2])
        if not self.first:
            self._send(grads[2], self.prev, m, "B1")
            self._send(carry_pos, self.prev, m, "B1", 1)
            self._send(carry_strain, self.prev, m, "B1", 2)
            return
        # stage 0: forces and stress of the whole model → their errors, or their loss and its cotangents
        # w.r.t. the carried Σ f_s (F = −Σ f_s: the same for every stage's f_s). The energy term is the last stage's.
        if self.evaluating:
            errors = prediction_errors(batch, forces=-carry_pos, stress=symmetric_stress(carry_strain, batch.volumes))
            self.errors[m] = self.errors.get(m, 0) + errors
            return
        carry_pos.requires_grad_(True), carry_strain.requires_grad_(True)
        terms = loss_terms(batch.energy, -carry_pos, symmetric_stress(carry_strain, batch.volumes), batch, self.counts,
                           self.rule)
        part = self.rule["forces"] * terms["forces"] + self.rule["stress"] * terms["stress"]
        self.losses[m] = float(part.detach())
        s["cot_f"] = torch.autograd.grad(part, [carry_pos, carry_strain])

    def double_backward_up(self, m: int) -> None:
        s = self.state[m]
        if self.first:
            cot_pos, cot_strain = s.pop("cot_f")
        else:
            cot_g_in = self._recv(m, "A")
            cot_pos, cot_strain = self._recv(m, "A", 1), self._recv(m, "A", 2)
        tensors, seeds = [s["f_pos"], s["f_strain"]], [cot_pos, cot_strain]
        if not self.first:
            tensors.append(s["g_in"]), seeds.append(cot_g_in)
        inputs = ([] if self.last else [s["g_out"]]) + ([] if self.first else [s["h_in"]])
        rest = None
        if self.merge:  # only the cotangent of g_out now (none on the last stage); the rest in one pass with B's
            tensors, seeds = _startable(tensors, seeds)
            if self.last:  # nothing to send: all of A runs in B (B1's graph is held until then)
                s["A.rest"] = _Seeds(tensors, seeds)
            else:
                rest = backward_split(tensors, seeds, [s["g_out"]],
                                      self.parameters + ([] if self.first else [s["h_in"]]))
        else:
            self._backward(m, Sweep.A, tensors, seeds, inputs)
        if not self.last:
            g = s["g_out"].grad
            self._send(g if g is not None else torch.zeros_like(s["g_out"]), self.next, m, "A")
            self._send(cot_pos, self.next, m, "A", 1)
            self._send(cot_strain, self.next, m, "A", 2)
        if rest is not None:  # once sent: where the rest enters the graph, and the gradients it starts with;
            s["A.rest"] = _Seeds(*rest.edges())  # the part of B1's graph only the input pass needed is freed
            if self.measuring:
                self._counted(m)["A"] = s["A.rest"].nbytes
        for key in ("f_pos", "f_strain", "g_in", "g_out"):
            s.pop(key, None)

    def backward(self, m: int) -> None:
        s, batch = self._graph(m), self.batches[m]
        out = s.pop("out")
        if self.last:  # the energy term of the loss, and its cotangent w.r.t. E
            energy = out.detach().requires_grad_(True)
            part = self.rule["energy"] * loss_terms(energy, batch.forces, batch.stress, batch, self.counts,
                                                       self.rule)["energy"]
            self.losses[m] = self.losses.get(m, 0.0) + float(part.detach())
            seed = torch.autograd.grad(part, energy)[0]
        else:
            seed = self._recv(m, "B")
        tensors, seeds = [out], [seed]
        if "A.rest" in s:  # A's part that B's graph carries on (``merge``): one pass for both
            edges, grads = s.pop("A.rest").edges()
            tensors, seeds = tensors + edges, seeds + grads
        self._backward(m, Sweep.B, tensors, seeds, [] if self.first else [s["h_in"]])
        if not self.first:
            g = s["h_in"].grad
            self._send(g if g is not None else torch.zeros_like(s["h_in"]), self.prev, m, "B")
        for key in ("geometry", "h_in"):
            s.pop(key, None)

    def deferred_double_backward(self, m: int) -> None:
        """WA: the parameter gradients that A of micro-batch m left for later."""
        self.state[m].pop(Sweep.WA).run()

    def deferred_backward(self, m: int) -> None:
        """WB: the parameter gradients that B of micro-batch m left for later."""
        self.state[m].pop(Sweep.WB).run()

    SWEEPS = {Sweep.F: forward, Sweep.B1: force_backward, Sweep.A: double_backward_up, Sweep.B: backward,
              Sweep.WA: deferred_double_backward, Sweep.WB: deferred_backward}

    def _execute(self, actions, batches) -> None:
        self.batches, self.wait_seconds, self.timings, self.memory = batches, 0.0, [], {}
        self.deferred = deferred_parts(actions)  # the W actions: their A / B defer the parameter part
        # A computes only what the next stage waits for, B the rest with its own (not with A split: WA)
        self.merge = self.merge_a_into_b and not self.evaluating and all(w.sweep != Sweep.WA for w in self.deferred) \
            and any(a.sweep == Sweep.A for a in actions)
        left = {}  # actions left per micro-batch: its state goes with the last
        for action in actions:
            left[action.microbatch] = left.get(action.microbatch, 0) + 1
        start = time.perf_counter()
        try:
            self._post_receives(actions)
            for action in actions:
                self._synchronize()
                waited, began, self.sent = self.wait_seconds, time.perf_counter(), None
                self.SWEEPS[action.sweep](self, action.microbatch)
                self._synchronize()
                left[action.microbatch] -= 1
                if not left[action.microbatch]:
                    self.state.pop(action.microbatch, None)
                sent = None if self.sent is None else self.sent[0] - began - (self.sent[1] - waited)
                self.timings.append((action, time.perf_counter() - began - (self.wait_seconds - waited), sent))
            for request in self.pending:
                request.wait()
        finally:
            self.pending, self.batches, self.inbox, self.state = [], None, {}, {}
        self.run_seconds = time.perf_counter() - start  # of which wait_seconds blocked in receives

    def run(self, actions, batches, counts: Counts, rule) -> float:
        """Execute this stage's ``actions`` (schedule order) over ``batches``; gradients accumulate
        into the parameters' ``.grad``. Returns this stage's part of the loss (the force and stress
        terms on stage 0, the energy term on the last; sum over stages for the total), summed in
        micro-batch order whatever the schedule."""
        self.counts, self.rule, self.losses = counts, rule, {}
        self._execute(actions, batches)
        return float(sum(self.losses[m] for m in sorted(self.losses)))

    def evaluate(self, actions, batches, model=None) -> np.ndarray:
        """Run ``actions`` (sweeps F and B1 only) with ``model`` (default: the trained one; e.g. its EMA:
        the same parts); return this stage's error sums [9] (``training.prediction_errors``: the energy's
        on the last stage, forces' and stress's on the first; sum over stages for the whole model's),
        summed in micro-batch order whatever the schedule."""
        self.net, self.evaluating, self.errors = model if model is not None else self.model, True, {}
        try:
            self._execute(actions, batches)
        finally:
            self.net, self.evaluating = self.model, False
        return sum((self.errors[m] for m in sorted(self.errors)), np.zeros(9))
