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

A's parameter part runs in B (``merge``, the default). B1's graph reads the tensors the forward saved,
so a whole A back-propagates through the forward graph as well, and B then runs through it again: the
forward graph's backward twice per micro-batch, where one process runs it once with the summed
cotangents (on SchNet, stage 0's A cost 100 ms against 52 ms for F + B1). Under ``merge``, A computes
only the cotangent of g_s that the next stage waits for (``backward_split``: the input pass into g_s),
sends it, and keeps where the rest enters the graph with its gradients (``DeferredGradients.edges``: the
join nodes' parameter-side outputs, computed by formula where known, ``_branch_outputs``); B
back-propagates those together with its own seed, one traversal of the forward graph. The last stage,
which sends nothing up, leaves all of A to B. The price is memory: the gradients A leaves to B (on
SchNet about 0.7 × B1's graph) are held from A to B, and on the last stage B1's graph until B.

Energy-only training runs F and B; evaluation (validation and test errors) runs F and B1 without
``create_graph``. The order of sweeps over micro-batches is a schedule (``mlip_parallel.train.schedule``),
which never touches tensors; ``PipelineStage`` executes actions and never decides order. Parameter
gradients equal single-process double-backward gradients (the test). A global batch with fewer
structures than micro-batches runs with fewer micro-batches (a replica with none sits the step out).

Split sweeps (zero-bubble pipelines): where a stage's schedule holds WA(m) / WB(m), its A / B of
micro-batch m back-propagate only into what a neighbour waits for, and WA(m) / WB(m) later add the
parameter gradients from the gradients captured at the nodes where the parameters' branches join that
graph (``backward_split``).
Messages are posted ahead: a stage posts every receive of a step (``irecv``) before its first action
and never waits for a send (``isend``, completed at the end of the step). The trainer measures each
stage's seconds per sweep, the memory a micro-batch holds and the message latency in its first steps
(``schedule.Costs``, medians over steps scaled to a common machine speed, ``combine_steps``);
``schedule: auto`` times five warm-up steps (1F1B on plain and split sweeps in turn), then runs the order
the simulator predicts fastest.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from potentials.base import block_part, stage_parts
from potentials.checkpoint import save_parts

from ..errors import MLIPError
from .schedule import DEFERRED, Action, Sweep, deferred_parts, is_split
from .training import Batch, Counts, TrainingError, batch_geometry, loss_terms, prediction_errors, \
    structure_energies, sum_gradients, symmetric_stress


class PipelineError(MLIPError, ValueError):
    """A pipeline layout that cannot work: stages vs ranks or blocks, micro-batches, boundaries, schedule."""


def _wait_for_device(device) -> None:
    """On a CUDA device, wait for its queued work (so that a timing is device time, not the time to queue
    kernels or, with NCCL, messages); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
            _wait_for_device(h_in.device)
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
    return (m * len(Sweep) + list(Sweep).index(Sweep(sweep))) * 4 + part


def _node(t):
    """The autograd node that receives ``t``'s gradient: its grad_fn, or a leaf's gradient accumulator
    (``t`` a tensor, or a ``GradientEdge``: its node)."""
    if not isinstance(t, torch.Tensor):
        return t.node
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


def _slot(t) -> int:
    """The input of ``_node(t)`` that receives ``t``'s gradient."""
    if not isinstance(t, torch.Tensor):
        return t.output_nr
    return t.output_nr if t.grad_fn is not None else 0


def _branch_outputs(join, grads, wanted):
    """The outputs of autograd node ``join`` called with ``grads``, computed only at the indices ``wanted``
    (None elsewhere), for the nodes whose formulas are known here (matrix product, product, softplus'
    backward): a join's outputs towards the stage's inputs were computed in the input pass, and calling
    the node would compute them again. None for any other node (then it is called)."""
    name = join.name()
    if len(grads) != 1 or name not in _BRANCH_FORMULAS:
        return None
    try:
        saved = {k: getattr(join, f"_saved_{k}") for k in _BRANCH_FORMULAS[name][0]}
    except AttributeError:  # saved tensors released, or another autograd version
        return None
    formulas, grad = _BRANCH_FORMULAS[name][1], grads[0]
    if len(join.next_functions) != len(formulas) or any(v is None for v in saved.values()):
        return None
    return tuple(formulas[k](grad, **saved) if k in wanted else None for k in range(len(formulas)))


def _softplus_double_backward(grad, self, beta, threshold):
    """torch's softplus_double_backward, grad · σ'(β x) · β where β x < threshold (else 0), with its fused
    σ' kernel (sigmoid_backward: one pass, where the plain product took five)."""
    x = self * beta if beta != 1 else self
    out = torch.ops.aten.sigmoid_backward(grad, torch.sigmoid(x)).masked_fill_(x >= threshold, 0)
    return out.mul_(beta) if beta != 1 else out


_BRANCH_FORMULAS = {  # node name -> (its saved values, the formula of each output, in next_functions order)
    "MmBackward0": (("self", "mat2"), (lambda g, self, mat2: g.mm(mat2.t()),
                                       lambda g, self, mat2: self.t().mm(g))),
    "MulBackward0": (("self", "other"), (lambda g, self, other: g * other,
                                         lambda g, self, other: g * self)),
    "SoftplusBackwardBackward0": (("grad_output", "self", "beta", "threshold"), (
        lambda g, grad_output, self, beta, threshold: torch.ops.aten.softplus_backward(g, self, beta, threshold),
        lambda g, grad_output, self, beta, threshold:
            _softplus_double_backward(g * grad_output, self, beta, threshold))),
}


_GATHERS = ("IndexSelectBackward0",)  # nodes whose gradient ([E] edge rows) is larger than what they pass on ([N])


class DeferredGradients:
    """The parameter-gradient part of one backward pass, split off by ``backward_split`` and run later
    (the "W" of zero-bubble pipelines). ``run()`` adds the parameters' gradients to their ``.grad``: each
    join (a node where parameters' branches meet the graph to the inputs) is called with the gradient it
    received in the input pass, and one backward then runs from what it passes to those branches (and
    from the seeds of outputs that are branches themselves) to the parameters, through branch nodes only."""

    def __init__(self, parameters, joins, branch, seeded):
        self.parameters, self.joins, self.branch, self.seeded = parameters, joins, branch, seeded

    def edges(self) -> tuple:
        """(gradient edges, gradients): where the deferred part starts (the join nodes called now with the
        gradients they received), to back-propagate from, e.g. together with another backward pass that
        reaches the same parameters (one traversal of their common graph). Releases the captured graph."""
        from torch.autograd.graph import GradientEdge

        arriving = self._arriving()
        self.joins = self.branch = self.seeded = None
        for (node, k) in [e for e in arriving if e[0].name() in _GATHERS]:  # hold [N] rows, not [E]
            g = arriving.pop((node, k))
            with torch.no_grad():
                out = node(g)
            for (child, slot), g in zip(node.next_functions, out if isinstance(out, tuple) else (out,)):
                if child is not None and g is not None:
                    arriving[child, slot] = g + arriving[child, slot] if (child, slot) in arriving else g
        edges = list(arriving)
        return [GradientEdge(node, k) for node, k in edges], [arriving[e] for e in edges]

    def _arriving(self) -> dict:
        arriving = dict(self.seeded)  # (branch node, input) -> gradient
        for join, grads in self.joins:
            grads = [g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                     for g, m in zip(grads, join._input_metadata)]
            wanted = {k for k, (child, _) in enumerate(join.next_functions)
                      if child is not None and child in self.branch}
            with torch.no_grad():
                outputs = _branch_outputs(join, grads, wanted)
                if outputs is None:
                    outputs = join(*grads)
            for (child, k), g in zip(join.next_functions, outputs if isinstance(outputs, tuple) else (outputs,)):
                if g is None or child not in self.branch:
                    continue
                expected = child._input_metadata[k]
                if g.shape != expected.shape:  # what the engine does for a broadcast input
                    g = g.sum_to_size(expected.shape)
                arriving[child, k] = g.to(expected.dtype) + arriving[child, k] if (child, k) in arriving \
                    else g.to(expected.dtype)
        return arriving

    def run(self) -> None:
        from torch.autograd.graph import GradientEdge

        arriving = self._arriving()
        if arriving:
            edges = list(arriving)
            grads = torch.autograd.grad([GradientEdge(node, k) for node, k in edges], self.parameters,
                                        [arriving[e] for e in edges], retain_graph=True, allow_unused=True)
            with torch.no_grad():
                for p, g in zip(self.parameters, grads):
                    if g is not None:
                        fresh = g._is_view() or g.stride() != p.stride()  # .grad in the parameter's layout
                        p.grad = (torch.empty_like(p).copy_(g) if fresh else g) if p.grad is None else p.grad.add_(g)
        self.joins = self.branch = self.seeded = None  # release the graph

    @property
    def nbytes(self) -> int:
        """Bytes of the captured gradients (held until ``run``)."""
        grads = [g for _, captured in self.joins or () for g in captured if g is not None]
        return _storage_bytes(grads + list((self.seeded or {}).values()))


def _storage_bytes(tensors) -> int:
    """Bytes of the storages under ``tensors``, each storage once."""
    return sum(storage.nbytes() for storage in {t.untyped_storage().data_ptr(): t.untyped_storage()
                                                for t in tensors}.values())


def _startable(tensors, seeds) -> tuple:
    """The (tensors, seeds) a backward pass can start from: gradient edges, and tensors that require grad."""
    keep = [k for k, t in enumerate(tensors) if not isinstance(t, torch.Tensor) or t.requires_grad]
    return [tensors[k] for k in keep], [seeds[k] for k in keep]


class _Seeds:
    """Seeds of a backward pass put off (tensors or gradient edges, and their gradients), for B under
    ``PipelineStage.merge``: the last stage's whole A, which has nothing to send on; elsewhere the part of
    A left after its input pass (``DeferredGradients.edges``)."""

    def __init__(self, tensors, seeds):
        self.tensors, self.seeds = tensors, seeds

    def edges(self) -> tuple:
        return self.tensors, self.seeds

    @property
    def nbytes(self) -> int:
        """Bytes of the seeds' storages (each once)."""
        return _storage_bytes(self.seeds)


def backward_split(tensors, seeds, inputs, parameters) -> DeferredGradients:
    """Back-propagate ``seeds`` from ``tensors`` into the ``inputs``' ``.grad`` now, keeping the graph, and
    return the parameters' part for later: ``run()`` of the result then adds exactly the gradients that
    ``torch.autograd.backward(tensors, seeds, inputs=inputs + parameters)`` would have (up to the order
    of sums). The input pass skips the parameters' branches (the nodes that lead to parameters and not
    to the inputs); it captures the gradient arriving at each join, a node that leads to the inputs
    with a branch among its next functions (as ``torch.distributed.pipelining``'s
    ``stage_backward_input`` does)."""
    roots = {}
    for t, g in zip(tensors, seeds):
        slots = roots.setdefault(_node(t), {})
        slots[_slot(t)] = g + slots[_slot(t)] if _slot(t) in slots else g
    users, queue, seen = {}, list(roots), set(roots)  # node -> the nodes whose backward feeds it
    while queue:
        node = queue.pop()
        for child, _ in node.next_functions:
            if child is not None:
                users.setdefault(child, []).append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)

    def closure(starts, stop=()):  # nodes reachable along `users` (towards the outputs), not entering `stop`
        found, hit, queue = set(starts), set(), list(starts)
        while queue:
            for user in users.get(queue.pop(), ()):
                if user in stop:
                    hit.add(user)
                elif user not in found:
                    found.add(user)
                    queue.append(user)
        return found, hit

    leads_to_inputs, _ = closure([_node(t) for t in inputs if _node(t) in seen])
    branch, joins = closure([_node(p) for p in parameters if _node(p) in seen], leads_to_inputs)
    captured = {}
    handles = [node.register_prehook(lambda grads, node=node: captured.__setitem__(node, grads)) for node in joins]
    try:
        if tensors and inputs:
            torch.autograd.backward(list(tensors), list(seeds), retain_graph=True, inputs=list(inputs))
    finally:
        for handle in handles:
            handle.remove()
    seeded = {(node, k): g for node in roots if node in branch for k, g in roots[node].items()}
    return DeferredGradients(list(parameters), [(node, captured[node]) for node in joins if node in captured],
                             branch, seeded)


WARM_UP_STEPS = {True: 5, False: 3}  # timed steps: under auto (plain, split, plain, split, plain), else (plain × 3);
# after the cold first step, F, B1 and A are timed 4 times under auto, B 2 times plain and 2 split


def combine_steps(steps) -> tuple:
    """One stage's costs from its timed warm-up ``steps`` [k] of ({key: seconds}, {key: bytes}) (each a
    step's medians over its micro-batches, ``PipelineTrainer._timed``): per key the median over the
    steps that have it, the first (cold) step left out where a later one has the key. Seconds are first
    scaled step by step to a common machine speed: by the median over steps of the summed seconds of the
    keys every step has (F, B1, A; not the ".sent" offsets) over this step's. The speed of a shared
    2-core or busy machine drifts by ±10–20 % from step to step, and auto compares keys timed in
    different steps (B whole in plain steps, B.in and WB in split ones). Returns ({key: seconds},
    {key: bytes})."""
    seconds, memory = [step[0] for step in steps], [step[1] for step in steps]
    shared = [k for k in seconds[0] if not k.endswith(".sent") and all(k in t for t in seconds)]
    speed = [sum(t[k] for k in shared) for t in seconds]
    reference = float(np.median(speed[1:] if len(speed) > 1 else speed))
    scaled = [{k: v * (reference / x if x > 0 else 1.0) for k, v in t.items()} for t, x in zip(seconds, speed)]

    def median(tables):
        keys = dict.fromkeys(k for t in tables for k in t)
        return {k: float(np.median([t[k] for t in tables[1:] if k in t] or [tables[0][k]])) for k in keys}
    return median(scaled), median(memory)


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
        forces = [(1, (n, 3), torch.float64), (2, (structures, 3, 3), torch.float64)]
        if sweep == Sweep.F and not self.first:
            return [(0, (n, self.net.feature_width(self.blocks.start)), dtype, self.prev)]
        if sweep == Sweep.A and not self.first:
            return [(0, (n, self.net.feature_width(self.blocks.start)), dtype, self.prev)] + \
                [(part, shape, dt, self.prev) for part, shape, dt in forces]
        if sweep in (Sweep.B1, Sweep.B) and not self.last:
            h_out = (0, (n, self.net.feature_width(self.blocks.stop)), dtype, self.next)
            return [h_out] + ([(part, shape, dt, self.next) for part, shape, dt in forces] if sweep == Sweep.B1 else [])
        return []

    def message_device(self):
        """Where messages live: the stage's device, or the host where the process group cannot move
        CUDA tensors (gloo: ranks sharing a GPU)."""
        from ..backend import nccl_in_use
        return self.net.device if self.net.device.type != "cuda" or nccl_in_use() else torch.device("cpu")

    def _post_receives(self, actions) -> None:
        import torch.distributed as dist
        where = self.message_device()
        for action in actions:
            for part, shape, dtype, source in self._incoming(action):
                out = torch.empty(shape, dtype=dtype, device=where)
                key = action.microbatch, action.sweep, part
                self.inbox[key] = dist.irecv(out, source, tag=_tag(*key)), out

    def _send(self, tensor, to, m, sweep, part=0):
        import torch.distributed as dist
        message = tensor.detach().to(self.message_device()).contiguous()
        self.pending.append(dist.isend(message, to, tag=_tag(m, sweep, part)))
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
            return t
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
        terms = loss_terms(batch.energy, -carry_pos, symmetric_stress(carry_strain, batch.volumes), batch, self.counts)
        part = self.weights["forces"] * terms["forces"] + self.weights["stress"] * terms["stress"]
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
            part = self.weights["energy"] * loss_terms(energy, batch.forces, batch.stress, batch, self.counts)["energy"]
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

    def run(self, actions, batches, counts: Counts, weights: dict) -> float:
        """Execute this stage's ``actions`` (schedule order) over ``batches``; gradients accumulate
        into the parameters' ``.grad``. Returns this stage's part of the loss (the force and stress
        terms on stage 0, the energy term on the last; sum over stages for the total), summed in
        micro-batch order whatever the schedule."""
        self.counts, self.weights, self.losses = counts, weights, {}
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


class PipelineTrainer:
    """Data parallel × pipeline parallel over torch.distributed's world (initialise it first): ranks
    [d·S, d·S + S) form pipeline replica d; stage s of every replica holds the same parts and their
    gradients are summed over replicas.

    ``build(parts)`` returns the model holding ``parts`` (a ``BlockPotential`` with a fixed seed, e.g.
    ``lambda parts: SchNet(..., parts=parts, seed=0)``): the trainer builds this rank's stage with it
    (``self.model``), never the whole model. ``schedule``: a name in ``schedule.SCHEDULE_NAMES`` —
    "auto" (the default) runs its first five steps with 1F1B on plain and split sweeps in turn, timing
    them, and from then on the schedule that ``schedule.auto`` predicts fastest under those costs. Every
    schedule measures ``costs`` in its first steps on full global batches (``WARM_UP_STEPS``;
    seconds per stage and sweep, memory, message latency; the same on every rank: per stage the median
    over steps, ``combine_steps``, averaged over replicas), and ``timeline`` then predicts its step; ``costs`` given (a ``schedule.Costs``) skip the measurement.
    ``sweeps``: "forces" (four sweeps; energy, force and stress loss) or "energy" (two sweeps). ``boundaries`` [S + 1] block indices, or None to balance block costs measured on
    ``sample`` (structures), one block at a time, on rank 0. ``two_bw``: PipeDream-2BW — the gradient of
    step t is computed with the weights of step t − 1 and applied to the current ones (one-step-stale
    updates, two weight versions of this stage's parameters). ``recompute``: activation recomputation
    (see ``PipelineStage``). ``merge``: A computes only the cotangent the next stage waits for and B
    the rest of A with its own, one traversal of the forward graph (``PipelineStage.merge``; False: A
    runs through the forward graph itself, as one process would not). Raises PipelineError for a layout
    that cannot work, on every rank, before any step.

    Results are deterministic given the schedule; ``auto``'s depends on measured times, so two runs may
    differ in the last bits (float64: ~1e-16). The costs are part of ``state_dict``: a resumed run keeps
    the schedule of the run it continues.
    """

    def __init__(self, build, stages: int, microbatches: int, schedule: str = "auto", sweeps: str = "forces",
                 boundaries=None, sample=None, two_bw: bool = False, recompute: bool = False, costs=None,
                 merge: bool = True):
        import torch.distributed as dist

        from .schedule import SCHEDULE_NAMES

        world, rank = dist.get_world_size(), dist.get_rank()
        layers = build(frozenset()).layers
        if stages < 1 or world % stages:
            raise PipelineError(f"{world} rank(s) cannot hold pipelines of {stages} stages (ranks = replicas × stages)")
        if stages > layers:
            raise PipelineError(f"{stages} stages need at least {stages} interaction blocks; the model has {layers}")
        if microbatches < 1:
            raise PipelineError(f"microbatches must be at least 1, got {microbatches}")
        if schedule not in SCHEDULE_NAMES:
            raise PipelineError(f"unknown schedule {schedule!r}; known {list(SCHEDULE_NAMES)}")
        if sweeps not in ("forces", "energy"):
            raise PipelineError(f"sweeps must be 'forces' or 'energy', got {sweeps!r}")
        if costs is not None and len(costs.seconds) != stages:
            raise PipelineError(f"costs are given for {len(costs.seconds)} stages, the pipeline has {stages}")
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
        self.stage.merge_a_into_b = merge
        if costs is not None and not self._usable(costs):
            raise PipelineError("schedule auto needs costs that time the split sweeps "
                                f"({'/'.join(self._split_sweeps())}: e.g. B.in and WB), got keys {sorted(costs.seconds[0])}")
        self.costs, self._actions, self._warm_up = costs, {}, []  # the warm-up steps' measurements
        self._timed_size = 0  # structures in the global batches the warm-up times (the most seen)
        self.actions(microbatches, sweeps)  # check the schedule now
        groups = [dist.new_group([d * stages + s for d in range(self.replicas)]) for s in range(stages)]
        self.replica_group = groups[stage]
        self.two_bw = two_bw
        self.stale = [p.detach().clone() for p in self.stage.parameters] if two_bw else None

    @property
    def parameters(self) -> list:
        """This stage's parameters (give them to the optimizer)."""
        return self.stage.parameters

    def plan(self, microbatches: int, sweeps: str) -> tuple:
        """(name, schedule [S lists], check's result) for ``microbatches`` micro-batches and ``sweeps``
        ("forces", "energy" or "evaluate"), checked by simulation once and cached: the fixed order named
        by ``self.schedule``, or under auto, until the costs are measured, 1F1B alternately on plain and
        split sweeps (the timed warm-up, ``WARM_UP_STEPS``: plain, split, plain, split, plain), then
        ``schedule.auto``'s choice. Once ``self.costs`` are known the result predicts the step in seconds
        (``schedule.render`` shows it)."""
        from .schedule import SCHEDULES, SWEEPS, auto, check, one_f_one_b, split, sweeps_of

        warming_up = self.costs is None and sweeps != "evaluate"  # (an evaluation has no split sweeps)
        key = microbatches, sweeps, len(self._warm_up) % 2 if warming_up else None
        if key not in self._actions:
            kind = SWEEPS[sweeps]
            split_kind = split(kind, self._split_parts())

            def timing(needed):  # the costs, when they time every action of ``needed``
                return self.costs if self.costs is not None and self.costs.times(needed) else None
            if self.schedule != "auto":
                name, lists = self.schedule, SCHEDULES[self.schedule](self.stages, microbatches, kind)
            elif warming_up:  # the timed warm-up (measured or loaded costs under auto time split_kind: _usable)
                split_step = len(self._warm_up) % 2 == 1
                tag = "+".join(self._split_parts())
                name, lists = f"1f1b{' split ' + tag if split_step else ''} (timed warm-up)", \
                    one_f_one_b(self.stages, microbatches, split_kind if split_step else kind)
            else:
                name, lists, _ = auto(self.stages, microbatches, kind, timing(split_kind))
            used = sweeps_of(lists)
            self._actions[key] = name, lists, check(lists, self.stages, microbatches, used, costs=timing(used))
        return self._actions[key]

    def _split_parts(self) -> tuple:
        """The sweeps whose parameter parts auto may defer (and its warm-up times split): with A merged into B
        (``PipelineStage.merge``) A is already the part the next stage waits for, so B only; else A and B."""
        return (Sweep.B,) if self.stage.merge_a_into_b else (Sweep.A, Sweep.B)

    def _split_sweeps(self) -> tuple:
        """This trainer's sweeps with the parameter parts of ``_split_parts`` split off."""
        from .schedule import SWEEPS, split
        return split(SWEEPS[self.sweeps], self._split_parts())

    def _usable(self, costs) -> bool:
        """Whether ``costs`` serve this trainer: any under a fixed schedule (they only predict its step);
        under auto only costs that time the split sweeps too, which it weighs against the plain ones."""
        return self.schedule != "auto" or costs.times(self._split_sweeps())

    def actions(self, microbatches: int, sweeps: str) -> list:
        """This stage's actions of ``plan(microbatches, sweeps)``; the plan is kept as ``self.timeline``
        (check's result) and ``self.schedule_name``."""
        self.schedule_name, lists, self.timeline = self.plan(microbatches, sweeps)
        return lists[self.stage.stage]

    def _micro_batches(self, structures, model) -> list:
        """``structures`` in at most ``self.microbatches`` micro-batches (fewer when there are fewer structures)."""
        chunks = np.array_split(np.arange(len(structures)), min(self.microbatches, len(structures)))
        return [Batch([structures[k] for k in chunk], model, model.device) for chunk in chunks]

    def _latency(self, batches) -> float | None:
        """Half the fastest of three round trips, to the next stage, of a message the size of a micro-batch's
        features (None on the last stage). Collective over the stages of this replica."""
        import torch.distributed as dist

        stage, best, device = self.stage, None, self.stage.message_device()
        rows = max(1, int(np.mean([len(b.species) for b in batches])))  # the same on every stage of the replica

        def message(block):  # features entering ``block``
            return torch.zeros(rows, self.model.feature_width(block), dtype=self.model.dtype, device=device)
        for _ in range(3):
            if not stage.first:
                echo = message(stage.blocks.start)
                dist.recv(echo, stage.prev), dist.send(echo, stage.prev)
            if not stage.last:
                ping = message(stage.blocks.stop)
                _wait_for_device(device)
                begin = time.perf_counter()
                dist.send(ping, stage.next), dist.recv(ping, stage.next)
                _wait_for_device(device)
                trip = (time.perf_counter() - begin) / 2
                best = trip if best is None else min(best, trip)
        return best

    @staticmethod
    def _timed(stage) -> tuple:
        """({key: seconds}, {key: bytes}) of a stage's last run: medians over its micro-batches, by sweep
        (a split A or B as "A.in", "B.in"), and "<key>.sent" the seconds until the sweep's last message
        (``schedule.Costs``)."""
        split = deferred_parts(a for a, _, _ in stage.timings)
        deferred = {w.sweep for w in split}
        times, held = {}, {}
        for action, seconds, sent in stage.timings:
            key = f"{action.sweep}.in" if is_split(action, split) else str(action.sweep)
            times.setdefault(key, []).append(seconds)
            if sent is not None:
                times.setdefault(f"{key}.sent", []).append(sent)
        for counted in stage.memory.values():
            for key, value in counted.items():
                if key != "seen" and (key in ("F", "B1", "A", "merged") or key in deferred):
                    held.setdefault(key, []).append(value)
        return ({k: float(np.median(v)) for k, v in times.items()}, {k: float(np.median(v)) for k, v in held.items()})

    def _measure_costs(self, steps) -> None:
        """Set ``self.costs`` from every rank's warm-up ``steps`` (each ((seconds, memory), latency), or None
        where its replica had no structure): per stage ``combine_steps`` of each replica's steps, averaged
        over replicas; the latency the median over steps and links. Collective over all ranks, and the
        same costs on each; no costs (the warm-up starts over) when a stage has no replica that ran every
        step."""
        import torch.distributed as dist

        from .schedule import Costs

        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, None if None in steps else steps)
        self._warm_up, seconds, memory, latencies = [], [], [], []
        for s in range(self.stages):
            runs = [gathered[d * self.stages + s] for d in range(self.replicas)]
            runs = [r for r in runs if r is not None]
            if not runs:
                return
            combined = [combine_steps([step[0] for step in run]) for run in runs]
            seconds.append({k: float(np.mean([c[0][k] for c in combined])) for k in combined[0][0]})
            memory.append({k: float(np.mean([c[1][k] for c in combined])) for k in combined[0][1]})
            latencies += [step[1] for run in runs for step in run if step[1] is not None]
        self.costs = Costs(tuple(seconds), float(np.median(latencies)) if latencies else 0.0, tuple(memory))
        self._actions = {}

    def gradients(self, structures, weights: dict) -> float:
        """Accumulate d loss / d parameters of the global batch ``structures`` into this stage's
        parameters' ``.grad`` (zeroed first); return the loss (every rank). Replica d takes structures
        d, d + R, …; a replica with none adds zero gradients. The first steps on global batches as
        large as any seen (not a remainder batch: its micro-batches are smaller, or fewer) measure the
        costs of their actions (``self.costs``): ``WARM_UP_STEPS[auto or not]`` of them."""
        import torch.distributed as dist

        for p in self.parameters:
            p.grad = None
        mine = structures[self.replica::self.replicas]
        loss, measured = 0.0, None
        size = len(structures)  # the same on every rank
        if self.costs is None and size > self._timed_size:
            self._timed_size, self._warm_up = size, []
        timed = self.costs is None and size == self._timed_size
        if mine:
            batches = self._micro_batches(mine, self.model)
            self.stage.measuring = timed
            try:
                loss = self.stage.run(self.actions(len(batches), self.sweeps), batches, Counts.of(structures), weights)
            finally:
                self.stage.measuring = False
            if timed:
                measured = self._timed(self.stage), self._latency(batches)
        if timed:
            self._warm_up.append(measured)
            if len(self._warm_up) == WARM_UP_STEPS[self.schedule == "auto"]:
                self._measure_costs(self._warm_up)
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
        """The trainer's own state, for a stage's checkpoint shard: 2BW's stale weights of this stage, and
        the measured costs (auto's schedule)."""
        costs = None if self.costs is None else {
            "seconds": [dict(row) for row in self.costs.seconds], "latency": self.costs.latency,
            "memory": [dict(row) for row in self.costs.memory] if self.costs.memory is not None else None}
        return {"stale": [p.cpu() for p in self.stale] if self.two_bw else [], "costs": costs}

    def load_state_dict(self, state: dict) -> None:
        from .schedule import Costs

        if self.two_bw:
            self.stale = [p.to(q.device) for p, q in zip(state["stale"], self.parameters)]
        costs = state.get("costs")
        if costs is not None and len(costs["seconds"]) == self.stages:
            memory = tuple(costs["memory"]) if costs.get("memory") is not None else None
            loaded = Costs(tuple(costs["seconds"]), costs["latency"], memory)
            if self._usable(loaded):  # else (a fixed schedule's costs, resumed under auto) measured again
                self.costs, self._actions = loaded, {}

    def save_merged(self, path, model=None, extra: dict | None = None) -> None:
        """Write one ordinary ``potentials`` checkpoint of the whole model (``model``: this stage's parts
        to write, default the trained ones; e.g. their EMA) to ``path`` on rank 0, collectively over
        every rank: replica 0's stages send their parts to rank 0 one at a time
        (``potentials.save_parts``), so no rank ever holds more than its own parts and one other.
        ``extra``: plain entries stored beside the weights (rank 0's)."""
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
                save_parts(net, str(path), pieces(), extra=extra)
            else:
                dist.send_object_list([state], dst=0)
        dist.barrier()
