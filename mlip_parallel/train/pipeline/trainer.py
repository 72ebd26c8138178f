"""The pipeline's trainer: ``PipelineTrainer`` places the model's blocks on stages (``block_costs``,
``split_blocks``, ``check_boundaries``), measures the stages' costs in its first steps (``WARM_UP_STEPS``,
``combine_steps``), chooses the schedule, runs a global batch's micro-batches through its ``PipelineStage``,
sums gradients over pipeline replicas, and writes merged checkpoints part by part. Only pipeline parallelism:
the ``mlip-train`` job around it is ``train/trainer.py``'s, the loss and batches ``train/training.py``'s."""
from __future__ import annotations

import time

import numpy as np
import torch

from potentials.base import block_part, stage_parts
from potentials.checkpoint import save_parts
from potentials.lora import merged

from ...backend import get_backend
from ..training import Batch, Counts, TrainingError, batch_geometry, sum_gradients
from .schedule import (SCHEDULE_NAMES, SCHEDULES, SWEEPS, Costs, Sweep, auto, check, deferred_parts, is_split,
                       one_f_one_b, split, sweeps_of)
from .stage import PipelineError, PipelineStage, _wait_for_device


def block_costs(build, structures) -> list:
    """Measured seconds of each interaction block's forward + force backward on ``structures``
    (for cost-balanced boundaries). ``build(parts)`` returns a model holding ``parts``: the blocks are
    built and timed one at a time, on random input features of the right width. Blocks of the same shape
    (widths and parameter shapes) get their mean cost: timing noise (up to 2x per block on a shared
    machine) would otherwise split identical blocks unevenly, and stages would hold unequal parameters."""
    skeleton = build(frozenset())
    batch = Batch(structures, skeleton, skeleton.device)
    geometry = batch_geometry(batch)
    rows = skeleton.state_rows(len(batch.species), len(batch.i))
    ctx = skeleton.context(geometry.graph)
    generator = torch.Generator().manual_seed(0)
    costs, shapes = [], []
    for k in range(skeleton.n_blocks):
        model = build(frozenset({block_part(k)}))
        h_in = torch.randn(rows, model.feature_width(k), generator=generator, dtype=model.dtype)
        h_in = h_in.to(model.device).requires_grad_(True)
        seconds = []
        for _ in range(3):  # the first call warms up; keep the fastest
            start = time.perf_counter()
            out = model.block(k, h_in, geometry.graph, ctx)
            torch.autograd.grad(out, [h_in, geometry.pos], torch.ones_like(out), retain_graph=True, allow_unused=True)
            _wait_for_device(h_in.device)
            seconds.append(time.perf_counter() - start)
        costs.append(min(seconds))
        shapes.append((model.feature_width(k), model.feature_width(k + 1),
                       tuple(tuple(p.shape) for p in model.parameters())))
        del model, out
    means = {shape: float(np.mean([c for c, s in zip(costs, shapes) if s == shape])) for shape in set(shapes)}
    return [means[shape] for shape in shapes]


def release_freed_memory() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; with mlip-train's
    ``keep_freed_memory`` it would stay resident); nothing where the C library has no such call."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


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



class PipelineTrainer:
    """Data parallel × pipeline parallel over torch.distributed's world (initialise it first; ``comm``: the backend
    its ranks talk through, default ``get_backend("torch")``): ranks
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
                 merge: bool = True, comm=None):
        self.comm = comm = get_backend("torch") if comm is None else comm
        world, rank = comm.size, comm.rank
        blocks = build(frozenset()).n_blocks
        if stages < 1 or world % stages:
            raise PipelineError(f"{world} rank(s) cannot hold pipelines of {stages} stages (ranks = replicas × stages)")
        if stages > blocks:
            raise PipelineError(f"{stages} stages need at least {stages} interaction blocks; the model has {blocks}")
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
            costs_of_blocks = block_costs(build, sample) if rank == 0 else None
            if rank == 0:
                release_freed_memory()  # the one-block models it built and freed (~190 MB at F=768)
            boundaries = split_blocks(comm.bcast(costs_of_blocks), stages)
        self.boundaries = check_boundaries(boundaries, stages, blocks)
        self.model = build(stage_parts(blocks, self.boundaries, stage))
        peers = (rank - 1 if stage > 0 else None, rank + 1 if stage < stages - 1 else None)
        self.stage = PipelineStage(self.model, stage, stages, self.boundaries, peers, comm, recompute)
        self.stage.merge_a_into_b = merge
        if costs is not None and not self._usable(costs):
            raise PipelineError("schedule auto needs costs that time the split sweeps "
                                f"({'/'.join(self._split_sweeps())}: e.g. B.in and WB), got keys {sorted(costs.seconds[0])}")
        self.costs, self._actions, self._warm_up = costs, {}, []  # the warm-up steps' measurements
        self._timed_size = 0  # structures in the global batches the warm-up times (the most seen)
        self.actions(microbatches, sweeps)  # check the schedule now
        groups = [comm.subgroup([d * stages + s for d in range(self.replicas)]) for s in range(stages)]
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
        """``structures`` in at most ``self.microbatches`` micro-batches (fewer when there are fewer structures),
        dealt round: micro-batch m takes structures m, m + M, ... (of a batch by size, ordered largest first, each
        about as many atoms)."""
        count = min(self.microbatches, len(structures))
        chunks = [np.arange(m, len(structures), count) for m in range(count)]
        return [Batch([structures[k] for k in chunk], model, model.device) for chunk in chunks]

    def _latency(self, batches) -> float | None:
        """Half the fastest of three round trips, to the next stage, of a message the size of a micro-batch's
        features (None on the last stage). Collective over the stages of this replica."""
        stage, best, device = self.stage, None, self.stage.message_device()
        # the same on every stage of the replica
        rows = max(1, int(np.mean([self.model.state_rows(len(b.species), len(b.i)) for b in batches])))

        def message(block):  # features entering ``block``
            return torch.zeros(rows, self.model.feature_width(block), dtype=self.model.dtype, device=device)
        for _ in range(3):
            if not stage.first:
                echo = message(stage.blocks.start)
                self.comm.recv(echo, stage.prev), self.comm.send(echo, stage.prev)
            if not stage.last:
                ping = message(stage.blocks.stop)
                _wait_for_device(device)
                begin = time.perf_counter()
                self.comm.send(ping, stage.next), self.comm.recv(ping, stage.next)
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
        gathered = self.comm.allgather(None if None in steps else steps)
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

    def gradients(self, structures, rule) -> float:
        """Accumulate d loss / d parameters of the global batch ``structures`` into this stage's
        parameters' ``.grad`` (zeroed first); return the loss (every rank). Replica d takes structures
        d, d + R, …; a replica with none adds zero gradients. The first steps on global batches as
        large as any seen (not a remainder batch: its micro-batches are smaller, or fewer) measure the
        costs of their actions (``self.costs``): ``WARM_UP_STEPS[auto or not]`` of them."""
        for p in self.parameters:
            p.grad = None
        mine = list(structures[self.replica::self.replicas])  # (of a streamed batch's view: read here, once)
        loss, measured = 0.0, None
        size = len(structures)  # the same on every rank
        # the global batch's counts from the replicas' shares (each counted by its replica's every stage)
        sums = self.comm.allreduce_(torch.as_tensor(Counts.sums(mine), dtype=torch.float64))
        counts = Counts.of_sums(sums.numpy() / self.stages)
        if self.costs is None and size > self._timed_size:
            self._timed_size, self._warm_up = size, []
        timed = self.costs is None and size == self._timed_size
        if mine:
            batches = self._micro_batches(mine, self.model)
            self.stage.measuring = timed
            try:
                loss = self.stage.run(self.actions(len(batches), self.sweeps), batches, counts, rule)
            finally:
                self.stage.measuring = False
            if timed:
                measured = self._timed(self.stage), self._latency(batches)
        if timed:
            self._warm_up.append(measured)
            if len(self._warm_up) == WARM_UP_STEPS[self.schedule == "auto"]:
                self._measure_costs(self._warm_up)
        shared = {id(p) for p in self.stage.shared}
        if self.replicas > 1:
            sum_gradients([p for p in self.parameters if id(p) not in shared],
                          lambda flat: self.comm.allreduce_(flat, group=self.replica_group))
        if shared:  # a weight every stage holds: its gradient summed over every stage and replica
            sum_gradients(self.stage.shared, self.comm.allreduce_)
        return float(self.comm.allreduce_(torch.tensor([loss], dtype=torch.float64))[0])

    def step(self, structures, rule, optimizer, clip_norm: float = 0.0) -> float:
        """One optimizer step on the global batch ``structures`` (2BW: gradient at the previous
        weights, applied to the current ones); ``clip_norm`` > 0 clips the norm of the whole model's
        gradient (summed over stages). Returns the loss."""
        current = [p.detach().clone() for p in self.parameters] if self.two_bw else None
        if self.two_bw:
            with torch.no_grad():
                for p, old in zip(self.parameters, self.stale):
                    p.copy_(old)
        loss = self.gradients(structures, rule)
        if not np.isfinite(loss):  # the global loss: every rank stops here
            raise TrainingError(f"the loss is not finite (batch of {', '.join(s.source for s in structures)})")
        if self.two_bw:
            with torch.no_grad():
                for p, now in zip(self.parameters, current):
                    p.copy_(now)
            self.stale = current
        if clip_norm > 0:  # the whole model's norm: this stage's, squared and summed over the stages
            shared = {id(p) for p in self.stage.shared} if not self.stage.first else set()  # counted on stage 0 only
            grads = [p.grad for p in self.parameters if p.grad is not None and id(p) not in shared]
            square = (torch.nn.utils.get_total_norm(grads).to(torch.float64) ** 2 if grads
                      else torch.zeros((), dtype=torch.float64)).reshape(1)
            self.comm.allreduce_(square)  # every replica holds the same gradients: divide their copies out
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
        mine = structures[self.replica::self.replicas]
        net = model if model is not None else self.model
        sums = np.zeros(9)
        for start in range(0, len(mine), batch_size):
            batches = self._micro_batches(mine[start:start + batch_size], net)
            sums += self.stage.evaluate(self.actions(len(batches), "evaluate"), batches, net)
        return self.comm.allreduce_(torch.as_tensor(sums)).numpy()

    def state_dict(self) -> dict:
        """The trainer's own state, for a stage's checkpoint shard: 2BW's stale weights of this stage, the
        measured costs (auto's schedule), and before they are known the warm-up steps timed so far (a run
        stopped within its warm-up resumes it where it was, with the same plain and split steps)."""
        costs = None if self.costs is None else {
            "seconds": [dict(row) for row in self.costs.seconds], "latency": self.costs.latency,
            "memory": [dict(row) for row in self.costs.memory] if self.costs.memory is not None else None}
        warm_up = None if self.costs is not None else {"schedule": self.schedule, "steps": list(self._warm_up),
                                                       "size": self._timed_size}
        return {"stale": [p.cpu() for p in self.stale] if self.two_bw else [], "costs": costs, "warm_up": warm_up}

    def load_state_dict(self, state: dict) -> None:
        if self.two_bw:
            self.stale = [p.to(q.device) for p, q in zip(state["stale"], self.parameters)]
        costs = state.get("costs")
        if costs is not None and len(costs["seconds"]) == self.stages:
            memory = tuple(costs["memory"]) if costs.get("memory") is not None else None
            loaded = Costs(tuple(costs["seconds"]), costs["latency"], memory)
            if self._usable(loaded):  # else (a fixed schedule's costs, resumed under auto) measured again
                self.costs, self._actions = loaded, {}
        warm_up = state.get("warm_up")
        if self.costs is None and warm_up is not None and warm_up["schedule"] == self.schedule:
            self._warm_up, self._timed_size, self._actions = list(warm_up["steps"]), int(warm_up["size"]), {}

    def save_merged(self, path, model=None, extra: dict | None = None) -> None:
        """Write one ordinary ``potentials`` checkpoint of the whole model (``model``: this stage's parts
        to write, default the trained ones; e.g. their EMA) to ``path`` on rank 0, collectively over
        every rank: replica 0's stages send rank 0 their entries' shapes, then the tensors one at a time,
        which ``potentials.save_parts`` writes into place as they arrive: no rank holds more than its own
        parts and one tensor of another's. ``extra``: plain entries stored beside the weights (rank 0's)."""
        if self.replica == 0:  # the other replicas hold the same weights
            net = merged(model if model is not None else self.model)  # (LoRA: the updates added into the weights)
            state = {k: v.detach() for k, v in net.state_dict().items()
                     if self.stage.first or net.part_of(k) is not None}  # shared buffers once, from stage 0
            layout = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
            where = self.stage.message_device()
            if self.stage.first:  # rank 0
                layouts = [layout]
                for source in range(1, self.stages):
                    layouts.append(self.comm.recv_object(source))

                def tensors():
                    yield from state.items()
                    for source in range(1, self.stages):
                        for key, (shape, dtype) in layouts[source].items():
                            received = torch.empty(shape, dtype=dtype, device=where)
                            if received.numel():
                                self.comm.recv(received, source)
                            yield key, received
                save_parts(net, str(path), {k: v for lay in layouts for k, v in lay.items()}, tensors(), extra=extra)
            else:
                self.comm.send_object(layout, 0)
                for value in state.values():
                    if value.numel():
                        self.comm.send(value.to(where).contiguous(), 0)
        self.comm.barrier()
