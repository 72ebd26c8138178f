"""Pipeline-parallel training with conservative forces (docs/architecture.md §5).

A ``BlockPotential``'s interaction blocks are split over S stages, one rank each (stage 0 also holds
the embedding, the last stage the readout). **A stage builds only its own parts**: no rank holds
another stage's parameters, gradients, optimizer or EMA state (``potentials.stage_parts``; each part
is initialised from its own seed, so the stages together equal the one-process model built with the
same seed). Every stage reads the same micro-batch (positions and edges are cheap to rebuild); only
node features and their gradients travel between stages, through torch.distributed point-to-point
messages. Per micro-batch the force loss takes four sweeps:

    F  (0 → S−1)  h_s = blocks_s(h_{s−1}; x)                          last stage: E = readout(h)
    B1 (S−1 → 0)  g_{s−1}, f_s = ∂h_s/∂(h_{s−1}, x) · g_s  (create_graph)   carry Σ f_s down;
                  stage 0: F = −Σ f, σ = sym(Σ f_ε)/V → force/stress loss, dL/df_s = −dL/dF (all s)
    A  (0 → S−1)  backward through stage s's B1 graph, seeds dL/df_s and the cotangent of g_{s−1}
                  (from stage s−1): parameter gradients, the cotangent of g_s (sent up) and of h_{s−1}
                  (held for B)
    B  (S−1 → 0)  backward through stage s's forward graph, seed = cotangent of h_s (from stage s+1:
                  its A and B parts), on the last stage dL/dE: parameter gradients, cotangent of h_{s−1}

Energy-only training runs F and B; evaluation (validation and test errors) runs F and B1 without
``create_graph``. The order of sweeps over micro-batches is a schedule (``mlip_parallel.train.schedule``),
which never touches tensors; ``PipelineStage`` executes actions and never decides order. Parameter
gradients equal single-process double-backward gradients (the test). A global batch with fewer
structures than micro-batches runs with fewer micro-batches (a replica with none sits the step out).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from potentials.base import block_part, stage_parts
from potentials.checkpoint import save_parts

from ..errors import MLIPError
from .schedule import Sweep
from .training import Batch, Counts, TrainingError, batch_geometry, loss_terms, prediction_errors, \
    structure_energies, sum_gradients, symmetric_stress


class PipelineError(MLIPError, ValueError):
    """A pipeline layout that cannot work: stages vs ranks or blocks, micro-batches, boundaries, schedule."""


def block_costs(build, structures) -> list:
    """Measured seconds of each interaction block's forward + force backward on ``structures``
    (for cost-balanced boundaries). ``build(parts)`` returns a model holding ``parts``: the blocks are
    built and timed one at a time, on random input features of the right width."""
    skeleton = build(frozenset())
    geometry = batch_geometry(Batch(structures, skeleton, skeleton.device))
    ctx = skeleton.context(geometry.graph)
    generator = torch.Generator().manual_seed(0)
    costs = []
    for k in range(skeleton.layers):
        model = build(frozenset({block_part(k)}))
        h_in = torch.randn(len(geometry.pos), model.feature_width(k), generator=generator, dtype=model.dtype)
        h_in = h_in.to(model.device).requires_grad_(True)
        seconds = []
        for _ in range(3):  # the first call warms up; keep the fastest
            start = time.perf_counter()
            out = model.block(k, h_in, geometry.graph, ctx)
            torch.autograd.grad(out, [h_in, geometry.pos], torch.ones_like(out), retain_graph=True, allow_unused=True)
            seconds.append(time.perf_counter() - start)
        costs.append(min(seconds))
        del model, out
    return costs


def split_blocks(costs, stages: int) -> list:
    """Boundaries [S + 1] (block indices) of contiguous groups with the most even summed ``costs``
    (each stage at least one block): b_s ≤ blocks of stage s < b_{s+1}."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise PipelineError(f"cannot split {n} interaction blocks over {stages} stages (need 1 <= stages <= blocks)")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    best = {}

    def solve(start, parts):  # minimal largest stage cost of blocks[start:] in `parts` stages
        if (start, parts) in best:
            return best[start, parts]
        if parts == 1:
            result = (prefix[n] - prefix[start], [n])
        else:
            result = (np.inf, None)
            for end in range(start + 1, n - parts + 2):
                rest, cuts = solve(end, parts - 1)
                worst = max(prefix[end] - prefix[start], rest)
                if worst < result[0]:
                    result = (worst, [end] + cuts)
        best[start, parts] = result
        return result

    return [0] + solve(0, stages)[1]


def check_boundaries(boundaries, stages: int, blocks: int) -> list:
    """``boundaries`` as a list, or PipelineError unless they rise from 0 to ``blocks`` in ``stages`` steps."""
    boundaries = [int(b) for b in boundaries]
    if len(boundaries) != stages + 1 or boundaries[0] != 0 or boundaries[-1] != blocks \
            or any(b >= c for b, c in zip(boundaries, boundaries[1:])):
        raise PipelineError(f"boundaries must rise from 0 to {blocks} (the model's blocks) in {stages} steps, "
                            f"got {boundaries}")
    return boundaries


def _tag(m: int, sweep: str, part: int) -> int:
    return (m * 4 + list(Sweep).index(Sweep(sweep))) * 4 + part


class PipelineStage:
    """Stage ``stage`` of ``stages``: runs blocks [boundaries[stage], boundaries[stage + 1]) of
    ``model``, which holds exactly this stage's parts (plus the embedding on stage 0, the readout on
    the last). ``peers``: global ranks of the previous and next stage (None at the ends).
    ``batches[m]``: micro-batch m (a ``Batch``) — the same on every stage; ``counts``: sizes of the whole
    global batch (the loss normalisation). ``recompute``: keep only each micro-batch's stage input
    between its forward and its first backward sweep, and recompute the stage's forward then
    (activation recomputation).

    ``run(actions, batches, counts, weights)`` executes this stage's schedule actions, accumulating the
    parameters' gradients; ``evaluate(actions, batches, model)`` runs F and B1 without a double-backward
    graph and returns this stage's error sums.
    """

    def __init__(self, model, stage: int, stages: int, boundaries, peers, recompute: bool = False):
        expected = stage_parts(model.layers, boundaries, stage)
        if model.parts != expected:
            raise PipelineError(f"stage {stage} must hold exactly the parts {sorted(expected)}, "
                                f"the model holds {sorted(model.parts)}")
        self.model, self.stage, self.stages, self.recompute = model, stage, stages, recompute
        self.first, self.last = stage == 0, stage == stages - 1
        self.blocks = range(boundaries[stage], boundaries[stage + 1])
        self.prev, self.next = peers
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.net = model  # the module the sweeps run: the trained model, or e.g. its EMA in ``evaluate``
        self.evaluating = False
        self.state: dict = {}
        self.pending: list = []
        self.in_flight_peak, self.wait_seconds, self.run_seconds = 0, 0.0, 0.0

    # ---------------------------------------------------------------- messages
    # Each message is tagged with (micro-batch, sweep, part): a schedule may interleave sweeps of
    # different micro-batches differently on the two ends of a link.
    def _send(self, tensor, to, m, sweep, part=0):
        import torch.distributed as dist
        self.pending.append(dist.isend(tensor.detach().contiguous(), to, tag=_tag(m, sweep, part)))

    def _recv(self, shape, dtype, source, m, sweep, part=0):
        import torch.distributed as dist
        out = torch.empty(shape, dtype=dtype, device=self.net.device)
        start = time.perf_counter()
        dist.recv(out, source, tag=_tag(m, sweep, part))
        self.wait_seconds += time.perf_counter() - start
        return out

    # ------------------------------------------------------------------ sweeps
    def forward(self, m: int) -> None:
        batch = self.batches[m]
        n, width = len(batch.species), self.net.feature_width(self.blocks.start)
        h_in = None if self.first else self._recv((n, width), self.net.dtype, self.prev, m, "F")
        if self.recompute and not self.evaluating:  # keep only the input; rebuild before the first backward
            with torch.no_grad():
                out = self._stage_forward(batch, h_in)[2]
            self.state[m] = {"h_in_value": h_in}
        else:
            geometry, h_in, out = self._stage_forward(batch, h_in)
            self.state[m] = {"geometry": geometry, "h_in": h_in, "out": out}
        if not self.last:
            self._send(out, self.next, m, "F")
        self.in_flight_peak = max(self.in_flight_peak, len(self.state))

    def _stage_forward(self, batch, h_in):
        """(geometry, h_in leaf, output) of this stage's blocks: h [N, width], or E [B] on the last."""
        geometry = batch_geometry(batch)
        ctx = self.net.context(geometry.graph)
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
            geometry, h_in, out = self._stage_forward(self.batches[m], s.pop("h_in_value"))
            s.update(geometry=geometry, h_in=h_in, out=out)
        return s

    def force_backward(self, m: int) -> None:
        s, batch = self._graph(m), self.batches[m]
        geometry, out = s["geometry"], s["out"]
        if self.last:
            g_out = torch.ones_like(out)  # dE/dE
            if self.evaluating:
                self.errors += prediction_errors(batch, energy=out.detach())
        else:
            g_out = self._recv(out.shape, out.dtype, self.next, m, "B1").requires_grad_(not self.evaluating)
        inputs = [geometry.pos, geometry.strain] + ([] if self.first else [s["h_in"]])
        grads = torch.autograd.grad(out, inputs, g_out, create_graph=not self.evaluating, allow_unused=True)
        f_pos, f_strain = (g if g is not None else torch.zeros_like(x) for g, x in zip(grads[:2], inputs[:2]))
        carry_pos, carry_strain = f_pos.detach(), f_strain.detach()
        if not self.last:
            carry_pos = carry_pos + self._recv(f_pos.shape, torch.float64, self.next, m, "B1", 1)
            carry_strain = carry_strain + self._recv(f_strain.shape, torch.float64, self.next, m, "B1", 2)
        if self.evaluating:
            del self.state[m]
        else:
            s.update(g_out=g_out, f_pos=f_pos, f_strain=f_strain, g_in=None if self.first else grads[2])
        if not self.first:
            self._send(grads[2], self.prev, m, "B1")
            self._send(carry_pos, self.prev, m, "B1", 1)
            self._send(carry_strain, self.prev, m, "B1", 2)
            return
        # stage 0: forces and stress of the whole model → their errors, or their loss and its cotangents
        # w.r.t. the carried Σ f_s (F = −Σ f_s: the same for every stage's f_s). The energy term is the last stage's.
        if self.evaluating:
            self.errors += prediction_errors(batch, forces=-carry_pos, stress=symmetric_stress(carry_strain, batch))
            return
        carry_pos.requires_grad_(True), carry_strain.requires_grad_(True)
        terms = loss_terms(batch.energy, -carry_pos, symmetric_stress(carry_strain, batch), batch, self.counts)
        part = self.weights["forces"] * terms["forces"] + self.weights["stress"] * terms["stress"]
        self.loss_value += float(part.detach())
        s["cot_f"] = torch.autograd.grad(part, [carry_pos, carry_strain])

    def double_backward_up(self, m: int) -> None:
        s = self.state[m]
        if self.first:
            cot_pos, cot_strain = s["cot_f"]
            cot_g_in = None
        else:
            cot_g_in = self._recv(s["g_in"].shape, s["g_in"].dtype, self.prev, m, "A")
            cot_pos = self._recv(s["f_pos"].shape, torch.float64, self.prev, m, "A", 1)
            cot_strain = self._recv(s["f_strain"].shape, torch.float64, self.prev, m, "A", 2)
        tensors, seeds = [s["f_pos"], s["f_strain"]], [cot_pos, cot_strain]
        if not self.first:
            tensors.append(s["g_in"]), seeds.append(cot_g_in)
        inputs = list(self.parameters) + ([] if self.last else [s["g_out"]]) + ([] if self.first else [s["h_in"]])
        keep = [k for k, t in enumerate(tensors) if t.requires_grad]
        torch.autograd.backward([tensors[k] for k in keep], [seeds[k] for k in keep], retain_graph=True,
                                inputs=inputs)
        if not self.last:
            g = s["g_out"].grad
            self._send(g if g is not None else torch.zeros_like(s["g_out"]), self.next, m, "A")
            self._send(cot_pos, self.next, m, "A", 1)
            self._send(cot_strain, self.next, m, "A", 2)
        for key in ("f_pos", "f_strain", "g_in", "g_out"):
            s.pop(key, None)

    def backward(self, m: int) -> None:
        s, batch = self._graph(m), self.batches[m]
        del self.state[m]
        out = s["out"]
        if self.last:  # the energy term of the loss, and its cotangent w.r.t. E
            energy = out.detach().requires_grad_(True)
            part = self.weights["energy"] * loss_terms(energy, batch.forces, batch.stress, batch, self.counts)["energy"]
            self.loss_value += float(part.detach())
            seed = torch.autograd.grad(part, energy)[0]
        else:
            seed = self._recv(out.shape, out.dtype, self.next, m, "B")
        inputs = list(self.parameters) + ([] if self.first else [s["h_in"]])
        if out.requires_grad:
            torch.autograd.backward([out], [seed], inputs=inputs)
        if not self.first:
            g = s["h_in"].grad
            self._send(g if g is not None else torch.zeros_like(s["h_in"]), self.prev, m, "B")

    SWEEPS = {Sweep.F: forward, Sweep.B1: force_backward, Sweep.A: double_backward_up, Sweep.B: backward}

    def _execute(self, actions, batches) -> None:
        self.batches, self.wait_seconds, start = batches, 0.0, time.perf_counter()
        for action in actions:
            self.SWEEPS[action.sweep](self, action.microbatch)
        for request in self.pending:
            request.wait()
        self.pending, self.batches = [], None
        self.run_seconds = time.perf_counter() - start  # of which wait_seconds blocked in receives

    def run(self, actions, batches, counts: Counts, weights: dict) -> float:
        """Execute this stage's ``actions`` (schedule order) over ``batches``; gradients accumulate
        into the parameters' ``.grad``. Returns this stage's part of the loss (the force and stress
        terms on stage 0, the energy term on the last; sum over stages for the total)."""
        self.counts, self.weights, self.loss_value = counts, weights, 0.0
        self._execute(actions, batches)
        return self.loss_value

    def evaluate(self, actions, batches, model=None) -> np.ndarray:
        """Run ``actions`` (sweeps F and B1 only) with ``model`` (default: the trained one; e.g. its EMA:
        the same parts); return this stage's error sums [9] (``training.prediction_errors``: the energy's
        on the last stage, forces' and stress's on the first; sum over stages for the whole model's)."""
        self.net, self.evaluating, self.errors = model if model is not None else self.model, True, np.zeros(9)
        try:
            self._execute(actions, batches)
        finally:
            self.net, self.evaluating = self.model, False
        return self.errors


class PipelineTrainer:
    """Data parallel × pipeline parallel over torch.distributed's world (initialise it first): ranks
    [d·S, d·S + S) form pipeline replica d; stage s of every replica holds the same parts and their
    gradients are summed over replicas.

    ``build(parts)`` returns the model holding ``parts`` (a ``BlockPotential`` with a fixed seed, e.g.
    ``lambda parts: SchNet(..., parts=parts, seed=0)``): the trainer builds this rank's stage with it
    (``self.model``), never the whole model. ``schedule``: a name in ``schedule.SCHEDULES``; ``sweeps``:
    "forces" (four sweeps; energy, force and stress loss) or "energy" (two sweeps). ``boundaries``
    [S + 1] block indices, or None to balance block costs measured on ``sample`` (structures), one
    block at a time, on rank 0. ``two_bw``: PipeDream-2BW — the gradient of step t is computed with the
    weights of step t − 1 and applied to the current ones (one-step-stale updates, two weight versions
    of this stage's parameters). ``recompute``: activation recomputation (see ``PipelineStage``).
    Raises PipelineError for a layout that cannot work, on every rank, before any step.
    """

    def __init__(self, build, stages: int, microbatches: int, schedule: str = "1f1b", sweeps: str = "forces",
                 boundaries=None, sample=None, two_bw: bool = False, recompute: bool = False):
        import torch.distributed as dist

        from .schedule import SCHEDULES

        world, rank = dist.get_world_size(), dist.get_rank()
        layers = build(frozenset()).layers
        if stages < 1 or world % stages:
            raise PipelineError(f"{world} rank(s) cannot hold pipelines of {stages} stages (ranks = replicas × stages)")
        if stages > layers:
            raise PipelineError(f"{stages} stages need at least {stages} interaction blocks; the model has {layers}")
        if microbatches < 1:
            raise PipelineError(f"microbatches must be at least 1, got {microbatches}")
        if schedule not in SCHEDULES:
            raise PipelineError(f"unknown schedule {schedule!r}; known {sorted(SCHEDULES)}")
        if sweeps not in ("forces", "energy"):
            raise PipelineError(f"sweeps must be 'forces' or 'energy', got {sweeps!r}")
        self.stages, self.microbatches, self.replicas = stages, microbatches, world // stages
        self.schedule, self.sweeps = schedule, sweeps
        self.replica, stage = divmod(rank, stages)
        if boundaries is None:
            if sample is None:
                raise PipelineError("give boundaries, or sample structures to measure the block costs on")
            holder = [block_costs(build, sample) if rank == 0 else None]
            dist.broadcast_object_list(holder, src=0)
            boundaries = split_blocks(holder[0], stages)
        self.boundaries = check_boundaries(boundaries, stages, layers)
        self.model = build(stage_parts(layers, self.boundaries, stage))
        peers = (rank - 1 if stage > 0 else None, rank + 1 if stage < stages - 1 else None)
        self.stage = PipelineStage(self.model, stage, stages, self.boundaries, peers, recompute)
        self._actions = {}
        self.actions(microbatches, sweeps)  # check the schedule now
        groups = [dist.new_group([d * stages + s for d in range(self.replicas)]) for s in range(stages)]
        self.replica_group = groups[stage]
        self.two_bw = two_bw
        self.stale = [p.detach().clone() for p in self.stage.parameters] if two_bw else None

    @property
    def parameters(self) -> list:
        """This stage's parameters (give them to the optimizer)."""
        return self.stage.parameters

    def actions(self, microbatches: int, sweeps: str) -> list:
        """This stage's actions of the schedule for ``microbatches`` micro-batches and ``sweeps`` ("forces",
        "energy" or "evaluate"), checked by simulation once and cached."""
        from .schedule import SCHEDULES, SWEEPS, check

        key = microbatches, sweeps
        if key not in self._actions:
            lists = SCHEDULES[self.schedule](self.stages, microbatches, SWEEPS[sweeps])
            self.timeline = check(lists, self.stages, microbatches, SWEEPS[sweeps])
            self._actions[key] = lists[self.stage.stage]
        return self._actions[key]

    def _micro_batches(self, structures, model) -> list:
        """``structures`` in at most ``self.microbatches`` micro-batches (fewer when there are fewer structures)."""
        chunks = np.array_split(np.arange(len(structures)), min(self.microbatches, len(structures)))
        return [Batch([structures[k] for k in chunk], model, model.device) for chunk in chunks]

    def gradients(self, structures, weights: dict) -> float:
        """Accumulate d loss / d parameters of the global batch ``structures`` into this stage's
        parameters' ``.grad`` (zeroed first); return the loss (every rank). Replica d takes structures
        d, d + R, …; a replica with none adds zero gradients."""
        import torch.distributed as dist

        for p in self.parameters:
            p.grad = None
        mine = structures[self.replica::self.replicas]
        loss = 0.0
        if mine:
            batches = self._micro_batches(mine, self.model)
            loss = self.stage.run(self.actions(len(batches), self.sweeps), batches, Counts.of(structures), weights)
        if self.replicas > 1:
            def all_reduce(flat):
                dist.all_reduce(flat, group=self.replica_group)
                return flat
            sum_gradients(self.parameters, all_reduce)
        total = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total[0])

    def step(self, structures, weights: dict, optimizer, clip_norm: float = 0.0) -> float:
        """One optimizer step on the global batch ``structures`` (2BW: gradient at the previous
        weights, applied to the current ones); ``clip_norm`` > 0 clips the norm of the whole model's
        gradient (summed over stages). Returns the loss."""
        current = [p.detach().clone() for p in self.parameters] if self.two_bw else None
        if self.two_bw:
            with torch.no_grad():
                for p, old in zip(self.parameters, self.stale):
                    p.copy_(old)
        loss = self.gradients(structures, weights)
        if not np.isfinite(loss):  # the global loss: every rank stops here
            raise TrainingError(f"the loss is not finite (batch of {', '.join(s.source for s in structures)})")
        if self.two_bw:
            with torch.no_grad():
                for p, now in zip(self.parameters, current):
                    p.copy_(now)
            self.stale = current
        if clip_norm > 0:  # the whole model's norm: this stage's, squared and summed over the stages
            import torch.distributed as dist
            grads = [p.grad for p in self.parameters if p.grad is not None]
            square = (torch.nn.utils.get_total_norm(grads).to(torch.float64) ** 2 if grads
                      else torch.zeros((), dtype=torch.float64)).reshape(1)
            dist.all_reduce(square)  # every replica holds the same gradients: divide their copies out
            norm = torch.sqrt(square[0] / self.replicas)
            if not torch.isfinite(norm):
                raise TrainingError(f"the gradient norm is not finite (batch of {', '.join(s.source for s in structures)})")
            torch.nn.utils.clip_grads_with_norm_(self.parameters, clip_norm, norm)
        optimizer.step()
        return loss

    def error_sums(self, structures, batch_size: int, model=None) -> np.ndarray:
        """Pipelined evaluation: error sums [9] of the whole model (``model``: this stage's parts, default
        the trained ones; e.g. their EMA) over ``structures``, summed over every rank (identical on all).
        Replica d takes structures d, d + R, …, ``batch_size`` at a time, in micro-batches."""
        import torch.distributed as dist

        mine = structures[self.replica::self.replicas]
        net = model if model is not None else self.model
        sums = np.zeros(9)
        for start in range(0, len(mine), batch_size):
            batches = self._micro_batches(mine[start:start + batch_size], net)
            sums += self.stage.evaluate(self.actions(len(batches), "evaluate"), batches, net)
        total = torch.as_tensor(sums)
        dist.all_reduce(total)
        return total.numpy()

    def state_dict(self) -> dict:
        """The trainer's own state (2BW's stale weights of this stage), for a stage's checkpoint shard."""
        return {"stale": [p.cpu() for p in self.stale] if self.two_bw else []}

    def load_state_dict(self, state: dict) -> None:
        if self.two_bw:
            self.stale = [p.to(q.device) for p, q in zip(state["stale"], self.parameters)]

    def save_merged(self, path, model=None) -> None:
        """Write one ordinary ``potentials`` checkpoint of the whole model (``model``: this stage's parts
        to write, default the trained ones; e.g. their EMA) to ``path`` on rank 0, collectively over
        every rank: replica 0's stages send their parts to rank 0 one at a time
        (``potentials.save_parts``), so no rank ever holds more than its own parts and one other."""
        import torch.distributed as dist

        if self.replica == 0:  # the other replicas hold the same weights
            net = model if model is not None else self.model
            state = {k: v.detach().cpu() for k, v in net.state_dict().items()
                     if self.stage.first or net.part_of(k) is not None}  # shared buffers once, from stage 0
            if self.stage.first:  # rank 0
                def pieces():
                    yield state
                    for source in range(1, self.stages):
                        holder = [None]
                        dist.recv_object_list(holder, src=source)
                        yield holder[0]
                save_parts(net, str(path), pieces())
            else:
                dist.send_object_list([state], dst=0)
        dist.barrier()
