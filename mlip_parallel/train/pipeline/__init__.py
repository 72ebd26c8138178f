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
``create_graph``. The order of sweeps over micro-batches is a schedule (``mlip_parallel.train.pipeline.schedule``),
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

The parts, one file each: ``stage`` (a stage's execution of sweeps and messages), ``trainer`` (the
trainer around it: layout, cost measurement, schedule choice, replicas, checkpoints), ``split_backward``
(the autograd machinery that splits a backward into its input and parameter parts) and ``schedule``
(the orders of sweeps, and the simulator that predicts them).
"""
from .split_backward import DeferredGradients, backward_split
from .stage import PipelineError, PipelineStage
from .trainer import WARM_UP_STEPS, PipelineTrainer, block_costs, check_boundaries, combine_steps, split_blocks

__all__ = ["DeferredGradients", "PipelineError", "PipelineStage", "PipelineTrainer", "WARM_UP_STEPS",
           "backward_split", "block_costs", "check_boundaries", "combine_steps", "split_blocks"]
