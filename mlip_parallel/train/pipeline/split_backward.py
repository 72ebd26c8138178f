"""Splitting a backward pass into its input part and its parameter part (zero-bubble pipelines, and A's
parameter part left to B under ``merge``): ``backward_split`` back-propagates only into what a
neighbouring stage waits for and returns ``DeferredGradients``, the gradients captured at the nodes where
the parameters' branches join that graph, which later add the parameter gradients. Known join nodes
(matrix product, product, softplus' backward) have their outputs computed by formula
(``_branch_outputs``), the others are called."""
from __future__ import annotations

import torch


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


def _zero_gradient(metadata):
    """The gradient a join receives for an output nothing reads: zeros of its shape, or None (undefined: what the
    engine passes) for a 0-dim output, which may stand for an undefined tensor (layer norm's double backward
    declares its weight's and bias's gradients so where the norm has neither)."""
    if len(metadata.shape) == 0:
        return None
    return torch.zeros(metadata.shape, dtype=metadata.dtype, device=metadata.device)


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
            grads = [g if g is not None else _zero_gradient(m) for g, m in zip(grads, join._input_metadata)]
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
        if arriving:  # added into each .grad as the engine reaches its parameter: no list of all the gradients
            edges = list(arriving)
            torch.autograd.backward([GradientEdge(node, k) for node, k in edges], [arriving[e] for e in edges],
                                    retain_graph=True, inputs=self.parameters)
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

