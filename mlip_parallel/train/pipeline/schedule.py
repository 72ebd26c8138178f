"""Pipeline-parallel schedules for training potentials: plain data, checked and timed by simulation.

Stage ``s`` runs on rank ``s`` of ``S`` stages; micro-batches are ``m = 0..M-1``. A force-trained step
makes four sweeps over the stages per micro-batch, an energy-only step two, an evaluation (energies,
forces and stress without parameter gradients) F and B1 (``SWEEPS``):

* ``F``  forward, 0 -> S-1:   F(s,m) needs F(s-1,m).
* ``B1`` force backward, S-1 -> 0: B1(s,m) needs F(s,m) and B1(s+1,m).
* ``A``  double backward, first sweep, 0 -> S-1: A(s,m) needs B1(s,m), B1(0,m) (the loss is formed on
  stage 0 at the end of B1) and A(s-1,m).
* ``B``  double backward, second sweep, S-1 -> 0: B(s,m) needs A(s,m), A(s+1,m) and B(s+1,m).
  Energy only (no B1/A): B(s,m) needs F(s,m) and B(s+1,m).

(Terms on s-1 / s+1 are dropped at the ends of the pipeline.)

**Split sweeps** (``split``, as in zero-bubble pipelines, Qi et al. 2024): A and B each compute a part a
neighbour waits for (the cotangents sent on, and A's cotangent of the stage input that B sends down)
and the parameter gradients, which nobody needs before the optimizer step. With ``WA`` / ``WB`` in the
sweep set, A / B compute only the first part and WA(s,m) / WB(s,m), which need A(s,m) / B(s,m), the
deferred parameter gradients: a schedule places them where a stage would otherwise idle. (On stage 0,
B is all WB.) Splitting A costs extra work (its parameter part recomputes the input-side outputs of the
nodes where the parameters' branches join), so ``auto`` weighs plain, B-only and A-and-B splits. An
action defers its parameter part exactly when the schedule holds its W: a schedule may split only some,
e.g. B of the last micro-batches (``defer_tail``), whose W then fill the drain at no cost elsewhere.

A micro-batch is *in flight* on stage s from the start of its first action there to the end of its last
(its activations, and the graphs a deferred W still needs, are held meanwhile).

A schedule, as in ``torch.distributed.pipelining``, decides the order and never touches tensors: one
list of ``Action`` per stage, in execution order. ``check`` validates and times one without starting
processes, under this execution model: each stage executes its list in order; an action starts once
the stage is free, every action it depends on on this stage has completed, and the messages of those on
other stages have arrived: ``Costs.latency`` after they were sent, which is where that action ends unless
its costs time an earlier send (``Costs.sent``: stage 0's merged A sends its cotangent, then computes what
it leaves to B); an action takes ``Costs.seconds`` of its stage and sweep, or one time step without
costs (then all stages step together, and the result has a step × stage ``grid``). ``gpipe`` and
``one_f_one_b`` are fixed orders; ``list_schedule`` builds one from measured costs (greedy list
scheduling under an in-flight bound), and ``auto`` keeps the best predicted of all candidates that
respect the memory bound.
"""
import heapq
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from ...errors import MLIPError


class Sweep(str, Enum):
    """One pass of a micro-batch through the stages: F forward (up), B1 force backward (down), A and B
    the two halves of the double backward (up, down); WA and WB the deferred parameter-gradient parts of
    A and B (no messages). A str, so "F" == Sweep.F."""
    F = "F"
    B1 = "B1"
    A = "A"
    B = "B"
    WA = "WA"
    WB = "WB"

    __hash__ = str.__hash__  # the value's hash, computed in C (Enum's is Python: auto hashes actions a lot)

    def __str__(self):
        return self.value

    __format__ = str.__format__


SWEEPS = {"forces": (Sweep.F, Sweep.B1, Sweep.A, Sweep.B), "energy": (Sweep.F, Sweep.B),
          "evaluate": (Sweep.F, Sweep.B1)}
DEFERRED = {Sweep.A: Sweep.WA, Sweep.B: Sweep.WB}  # a backward sweep -> its deferred parameter-gradient part
MEMORY_FACTOR = 1.2  # auto's in-flight bound, relative to 1F1B's


def split(sweeps, parts=(Sweep.A, Sweep.B)) -> tuple:
    """``sweeps`` with the parameter-gradient parts of those of ``parts`` (A, B) that they hold deferred
    to sweeps of their own, WA and WB (an evaluation, which has none, is unchanged)."""
    sweeps = tuple(sweeps)
    return sweeps + tuple(DEFERRED[sw] for sw in sweeps if sw in DEFERRED and sw in parts)


SWEEP_SETS = tuple(dict.fromkeys([*SWEEPS.values(), *(split(s, (Sweep.B,)) for s in SWEEPS.values()),
                                  *(split(s) for s in SWEEPS.values())]))


class ScheduleError(MLIPError, ValueError):
    """A schedule is malformed, deadlocks, or holds more micro-batches in flight than allowed."""


class Action(NamedTuple):
    """One sweep of one micro-batch on one stage (a tuple: hashed and compared in C, as ``auto`` needs).

    ``str`` is ``sweep + microbatch`` ("F3", "A0", "B12", "WB2"), with a dot after sweeps whose name ends
    in a digit so that it stays unambiguous: "B1.3" is B1 of micro-batch 3, "B13" is B of micro-batch 13."""
    stage: int
    sweep: str
    microbatch: int

    def __str__(self):
        return f"{self.sweep}{'.' if self.sweep[-1].isdigit() else ''}{self.microbatch}"


@dataclass(frozen=True)
class Costs:
    """Measured seconds of one action of each sweep on each stage, ``seconds[s][key]`` (per micro-batch):
    keys are the sweeps, with "A" and "B" the whole sweeps, "A.in" and "B.in" their parts a neighbour
    waits for when WA / WB are split off (a whole sweep without its own key costs A.in + WA), and
    "<key>.sent" the seconds from the start of such an action to its last message to a neighbour (``sent``);
    the ``latency`` of a message between neighbouring stages (seconds); and optionally ``memory[s]``, the
    bytes a micro-batch holds on stage s: "F" from the start of F to the end of its last action (the
    forward graph), "B1" from the start of B1 to the end of A, or of WA when split (the double-backward
    graph), or to the end of B (of WB when split) where "merged" is set (the stage's A runs in B), "A" from
    the start of A to the end of B (the gradients A leaves to B), "WA" / "WB" from the start of A / B to the
    end of WA / WB (the gradients captured for them)."""
    seconds: tuple
    latency: float = 0.0
    memory: tuple = None
    _known: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # ``_timing``'s

    def times(self, sweeps) -> bool:
        """Whether these costs give every action of ``sweeps`` a duration on every stage."""
        return all(key in row for row in self.seconds for sw in sweeps for key in _cost_keys(row, sw, sweeps))

    def _timing(self, action, sweeps) -> tuple:
        """(duration, sent) of ``action`` under ``sweeps``, worked out once (``auto`` asks again and again)."""
        key = action.stage, action.sweep, sweeps
        known = self._known.get(key)
        if known is None:
            row = self.seconds[action.stage]
            keys = _cost_keys(row, action.sweep, sweeps)
            try:
                whole = float(sum(row[k] for k in keys))
            except KeyError:
                raise ScheduleError(f"costs have no duration of sweep {action.sweep} on stage {action.stage} "
                                    f"(sweeps {'/'.join(sweeps)})") from None
            sent = row.get(f"{keys[0]}.sent") if len(keys) == 1 else None
            known = self._known[key] = whole, whole if sent is None else min(float(sent), whole)
        return known

    def duration(self, action, sweeps) -> float:
        return self._timing(action, tuple(sweeps))[0]

    def sent(self, action, sweeps) -> float:
        """Seconds from the start of ``action`` until its messages to the neighbours have left: the row's
        "<key>.sent" where the action is one timed key that has one, else the whole ``duration``."""
        return self._timing(action, tuple(sweeps))[1]


def _cost_keys(row, sweep, sweeps) -> list:
    """The keys of a ``Costs.seconds`` row whose seconds sum to one action of ``sweep`` under ``sweeps``: its
    input part alone where the sweep set defers its parameter part ("B.in" with WB in the set), else the
    whole sweep ("B"), or where the row has no whole, its parts ("B.in" + "WB")."""
    deferred = DEFERRED.get(sweep)
    if deferred is not None and deferred in sweeps:
        return [f"{sweep}.in"]
    if deferred is not None and str(sweep) not in row:
        return [f"{sweep}.in", str(deferred)]
    return [str(sweep)]


def _where(a):
    return f"{a}@stage{a.stage}"


def dependencies(action, stages, sweeps=SWEEPS["forces"]):
    """The actions (on any stage) that must have completed before ``action`` may start."""
    s, m, sw = action.stage, action.microbatch, action.sweep
    if sw in (Sweep.WA, Sweep.WB):
        return [Action(s, Sweep.A if sw == Sweep.WA else Sweep.B, m)]
    if sw == Sweep.F:
        return [Action(s - 1, sw, m)] if s > 0 else []
    if sw == Sweep.A:
        deps = [Action(s, Sweep.B1, m)] + ([Action(s - 1, sw, m)] if s > 0 else []) + [Action(0, Sweep.B1, m)]
    elif sw == Sweep.B1:
        deps = [Action(s, Sweep.F, m)] + ([Action(s + 1, sw, m)] if s < stages - 1 else [])
    else:  # B runs S-1 -> 0, after this stage's A (or F, energy only) and the next stage's A and B
        double = Sweep.A in sweeps
        deps = [Action(s, Sweep.A if double else Sweep.F, m)]
        if s < stages - 1:
            deps += ([Action(s + 1, Sweep.A, m)] if double else []) + [Action(s + 1, sw, m)]
    return list(dict.fromkeys(deps))


def gpipe(stages, microbatches, sweeps=SWEEPS["forces"]):
    """On every stage: every micro-batch of one sweep, then every micro-batch of the next sweep."""
    return [[Action(s, sw, m) for sw in sweeps for m in range(microbatches)] for s in range(stages)]


def one_f_one_b(stages, microbatches, sweeps=SWEEPS["forces"]):
    """Memory-bounded 1F1B-style order: at most S micro-batches in flight on any stage. Built by running
    the unit-time execution model greedily: at every step each stage runs, if one is ready, a backward
    sweep of its oldest in-flight micro-batch (the oldest first, so memory is freed soonest), else starts
    its next forward while fewer than S micro-batches are in flight on it, else idles. For the energy loss
    (two sweeps) this is the classic one-forward-one-backward steady state; for the four force sweeps
    it fills the round trip of B1 → A → B with other micro-batches' work."""
    sweeps = tuple(sweeps)
    first, backward = sweeps[0], sweeps[1:]
    lists = [[] for _ in range(stages)]
    done, in_flight, next_forward = set(), [[] for _ in range(stages)], [0] * stages
    total = stages * microbatches * len(sweeps)
    while len(done) < total:
        row = []
        for s in range(stages):
            ready = [Action(s, sw, m) for m in in_flight[s] for sw in backward
                     if Action(s, sw, m) not in done
                     and all(d in done for d in dependencies(Action(s, sw, m), stages, sweeps))]
            forward = Action(s, first, next_forward[s])
            if ready:
                row.append(ready[0])
            elif next_forward[s] < microbatches and len(in_flight[s]) < stages \
                    and all(d in done for d in dependencies(forward, stages, sweeps)):
                row.append(forward)
                next_forward[s] += 1
                in_flight[s].append(forward.microbatch)
        if not row:  # cannot happen under the dependency rules; a guard against an endless loop
            raise ScheduleError(f"1F1B construction stalled with {total - len(done)} actions left")
        done.update(row)
        for a in row:
            lists[a.stage].append(a)
            if all(Action(a.stage, sw, a.microbatch) in done for sw in sweeps):
                in_flight[a.stage].remove(a.microbatch)
    return lists


def _validate(schedule, stages, microbatches, sweeps):
    if tuple(sweeps) not in SWEEP_SETS:
        raise ScheduleError(f"unknown sweep set {tuple(sweeps)}; expected one of {list(SWEEP_SETS)}")
    if len(schedule) != stages:
        raise ScheduleError(f"schedule has {len(schedule)} stage lists, expected {stages}")
    for s, acts in enumerate(schedule):
        seen = set()
        for a in acts:
            if not isinstance(a, Action) or a.stage != s:
                raise ScheduleError(f"stage {s}'s list holds {a!r}, which is not an action of stage {s}")
            if a.sweep not in sweeps or not 0 <= a.microbatch < microbatches:
                raise ScheduleError(f"stage {s}: unknown action {a!r} (sweeps {sweeps}, {microbatches} micro-batches)")
            if a in seen:
                raise ScheduleError(f"stage {s}: action {a} is repeated")
            seen.add(a)
        missing = [str(Action(s, sw, m)) for sw in sweeps for m in range(microbatches)
                   if sw not in DEFERRED.values() and Action(s, sw, m) not in seen]  # a W only where split
        if missing:
            raise ScheduleError(f"stage {s}: missing actions {', '.join(missing)}")


def sweeps_of(schedule) -> tuple:
    """The sweep set (one of ``SWEEP_SETS``) whose sweeps ``schedule`` holds (a W part on any stage and
    micro-batch counts)."""
    present = {a.sweep for stage in schedule for a in stage}
    for sweeps in SWEEP_SETS:
        if present == set(sweeps):
            return sweeps
    raise ScheduleError(f"a schedule of sweeps {sorted(present)} matches no sweep set of {list(SWEEP_SETS)}")


def check(schedule, stages, microbatches, sweeps=SWEEPS["forces"], max_in_flight=None, costs=None):
    """Validate ``schedule`` by simulating the execution model; raise ``ScheduleError`` on a malformed list,
    a deadlock, or more than ``max_in_flight`` micro-batches in flight on a stage. ``costs``: a ``Costs``
    (None: every action one time step, no latency). Returns {"time" (predicted step time: steps, or
    seconds), "steps" (the same), "start", "end" (Action -> time), "busy" (summed action time),
    "stage_busy" [S] (each stage's summed action time),
    "bubble_fraction" (idle share of stages × time), "max_in_flight" [S], "costs"}, and without costs
    "grid" (rows = steps, columns = stages, the Action started there or None)."""
    sweeps = tuple(sweeps)
    _validate(schedule, stages, microbatches, sweeps)
    own = _own_sweeps(schedule, sweeps)
    duration = (lambda a: 1) if costs is None else (lambda a: costs.duration(a, own(a)))
    sent = duration if costs is None else (lambda a: costs.sent(a, own(a)))
    latency = 0 if costs is None else costs.latency  # integer steps without costs
    start, end, pos, free = {}, {}, [0] * stages, [0] * stages
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                deps = dependencies(a, stages, sweeps)
                if any(d not in end for d in deps):
                    break
                start[a] = max([free[s]] + [end[d] if d.stage == s else start[d] + sent(d) + latency for d in deps])
                end[a] = free[s] = start[a] + duration(a)
                pos[s] += 1
                progress = True
    unit = "step" if costs is None else "time"
    if any(pos[s] < len(schedule[s]) for s in range(stages)):
        stuck = [f"{_where(schedule[s][pos[s]])} waits for "
                 + ", ".join(_where(d) for d in dependencies(schedule[s][pos[s]], stages, sweeps) if d not in end)
                 for s in range(stages) if pos[s] < len(schedule[s])]
        raise ScheduleError(f"deadlock at {unit} {max(end.values(), default=0):g}: " + "; ".join(stuck))
    memory = None if costs is None or costs.memory is None else \
        [_peak_memory(acts, sweeps, costs.memory[s]) for s, acts in enumerate(schedule)]
    peak = []
    for s, acts in enumerate(schedule):  # in flight: from a micro-batch's first action on s to the end of its last
        last = {a.microbatch: k for k, a in enumerate(acts)}
        held, peak_s = set(), 0
        for k, a in enumerate(acts):
            held.add(a.microbatch)
            peak_s = max(peak_s, len(held))
            if max_in_flight is not None and len(held) > max_in_flight:
                raise ScheduleError(f"stage {s} holds {len(held)} micro-batches in flight at {unit} {start[a]:g} "
                                    f"(during {a}), more than max_in_flight={max_in_flight}")
            if last[a.microbatch] == k:
                held.discard(a.microbatch)
        peak.append(peak_s)
    stage_busy = [0] * stages
    for a in start:
        stage_busy[a.stage] += end[a] - start[a]
    busy = sum(stage_busy)
    total = max(end.values(), default=0)
    result = {"time": total, "steps": total, "start": start, "end": end, "busy": busy, "stage_busy": stage_busy,
              "bubble_fraction": 1 - busy / (total * stages) if total else 0.0, "max_in_flight": peak,
              "costs": costs, "peak_memory": memory}
    if costs is None:
        grid = [[None] * stages for _ in range(total)]
        for a, t in start.items():
            grid[t][a.stage] = a
        result["grid"] = grid
    return result


def deferred_parts(actions) -> set:
    """The W actions (WA, WB) among ``actions``: A(s,m) / B(s,m) is split exactly where WA(s,m) / WB(s,m)
    is among them."""
    return {a for a in actions if a.sweep in DEFERRED.values()}


def is_split(action, deferred) -> bool:
    """Whether ``action`` (an A or B) defers its parameter part: its W is among ``deferred``
    (``deferred_parts``)."""
    w = DEFERRED.get(action.sweep)
    return w is not None and Action(action.stage, w, action.microbatch) in deferred


def _own_sweeps(schedule, sweeps):
    """action -> the sweeps that cost it: ``sweeps`` without the W parts that ``schedule`` does not hold
    for the action's stage and micro-batch (``deferred_parts``)."""
    held = deferred_parts(a for acts in schedule for a in acts)
    return lambda a: tuple(sw for sw in sweeps
                           if sw not in DEFERRED.values() or Action(a.stage, sw, a.microbatch) in held)


def _peak_memory(actions, sweeps, held) -> float:
    """Most bytes one stage holds while running ``actions`` in order (``Costs.memory``'s model; an A or B
    is split where its W is among the actions)."""
    def bytes_of(key, present=True):
        return held.get(key, 0.0) if present else 0.0
    deferred = deferred_parts(actions)
    # B1's graph held until B (or WB), not freed by A; the stage merges only in runs that split no A
    merged = bool(held.get("merged")) and not any(w.sweep == Sweep.WA for w in deferred)

    def change(a) -> tuple:  # (bytes a holds from its start, bytes freed at its end)
        split = is_split(a, deferred)  # an A or B: the split's flag; WB frees B1's merged graph
        gains = {Sweep.F: bytes_of("F"), Sweep.B1: bytes_of("B1", Sweep.A in sweeps),
                 Sweep.A: bytes_of("WA", split) + bytes_of("A"), Sweep.B: bytes_of("WB", split)}
        frees = {Sweep.A: bytes_of("B1", not split and not merged), Sweep.WA: bytes_of("B1") + bytes_of("WA"),
                 Sweep.B: bytes_of("A") + bytes_of("B1", merged and not split),
                 Sweep.WB: bytes_of("WB") + bytes_of("B1", merged)}
        return gains.get(a.sweep, 0.0), frees.get(a.sweep, 0.0)
    last = {a.microbatch: k for k, a in enumerate(actions)}
    now = peak = 0.0
    for k, a in enumerate(actions):
        gain, free = change(a)
        now += gain
        peak = max(peak, now)
        now -= free + (bytes_of("F") if last[a.microbatch] == k else 0.0)
    return peak


def in_flight_bound(stages, microbatches, factor=MEMORY_FACTOR) -> int:
    """The most micro-batches ``auto`` may hold in flight on a stage: ``factor`` × 1F1B's min(S, M)."""
    one_f_one_b_peak = min(stages, microbatches)
    return max(one_f_one_b_peak, math.floor(factor * one_f_one_b_peak + 1e-9))


def _levels(actions, successors, duration, sent, latency) -> dict:
    """Critical-path length from the start of each action to the end of the step: its own duration, or
    the longest chain of actions that wait for it (``successors[a]``), from its end on its stage, from
    its message (``sent`` plus ``latency``) on another."""
    level = {}
    for a in actions:  # memoised depth-first
        stack = [a]
        while stack:
            x = stack[-1]
            todo = [y for y in successors[x] if y not in level]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            level[x] = max([duration(x)] + [level[y] + (duration(x) if y.stage == x.stage else sent(x) + latency)
                                             for y in successors[x]])
    return level


def _rank(sweep) -> int:
    """0: a backward part a neighbour (or this stage's next backward) waits for; 1: a new forward; 2: a deferred W."""
    return 2 if sweep in (Sweep.WA, Sweep.WB) else 1 if sweep == Sweep.F else 0


PRIORITIES = {  # rank the ready actions of an idle stage (smallest first)
    "critical-path": lambda a, level: (-level[a], a.microbatch),
    "cotangents-first": lambda a, level: (_rank(a.sweep), a.microbatch, -level[a]),
    "cotangents-then-w": lambda a, level: ((0, 2, 1)[_rank(a.sweep)], a.microbatch, -level[a]),
    "oldest-first": lambda a, level: (a.microbatch, _rank(a.sweep), -level[a]),
}


def list_schedule(stages, microbatches, sweeps=SWEEPS["forces"], costs=None, max_in_flight=None,
                  priority="critical-path"):
    """A schedule built by greedy list scheduling in the execution model of ``check`` with ``costs``:
    whenever a stage is idle it starts, of its actions that are ready (dependencies done and their
    messages arrived), the first by ``priority`` (a name in ``PRIORITIES``; critical-path: the longest
    remaining chain first, which ranks deferred W parts last so they fill what would be idle time).
    Forwards start in micro-batch order, and only while fewer than ``max_in_flight`` (default S)
    micro-batches are in flight on the stage."""
    sweeps = tuple(sweeps)
    if priority not in PRIORITIES:
        raise ScheduleError(f"unknown priority {priority!r}; known {sorted(PRIORITIES)}")
    bound = stages if max_in_flight is None else max_in_flight
    if bound < 1:
        raise ScheduleError(f"max_in_flight must be at least 1, got {bound}")
    duration = (lambda a: 1.0) if costs is None else (lambda a: costs.duration(a, sweeps))
    sent = duration if costs is None else (lambda a: costs.sent(a, sweeps))
    latency = 0.0 if costs is None else costs.latency
    actions = [Action(s, sw, m) for s in range(stages) for sw in sweeps for m in range(microbatches)]
    deps = {a: dependencies(a, stages, sweeps) for a in actions}
    waiting_on = {a: len(deps[a]) for a in actions}
    successors = {a: [] for a in actions}
    for a in actions:
        for d in deps[a]:
            successors[d].append(a)
    level, key = _levels(actions, successors, duration, sent, latency), PRIORITIES[priority]
    ready = [dict() for _ in range(stages)]  # action -> time its inputs are there
    for a in actions:
        if not deps[a]:
            ready[a.stage][a] = 0.0
    start, end, free, lists = {}, {}, [0.0] * stages, [[] for _ in range(stages)]
    held, left = [set() for _ in range(stages)], {(a.stage, a.microbatch): len(sweeps) for a in actions}
    next_forward, first = [0] * stages, sweeps[0]
    events, now = [0.0], 0.0
    while len(end) < len(actions):
        if not events:
            raise ScheduleError(f"list scheduling stalled with {len(actions) - len(end)} actions left")
        now = heapq.heappop(events)
        progress = True
        while progress:  # several actions may start at one instant (zero-duration parts)
            progress = False
            for s in range(stages):
                if free[s] > now:
                    continue
                candidates = [a for a, t in ready[s].items() if t <= now and (
                    a.sweep != first or (a.microbatch == next_forward[s] and len(held[s]) < bound))]
                if not candidates:
                    continue
                a = min(candidates, key=lambda a: key(a, level))
                del ready[s][a]
                start[a], end[a] = now, now + duration(a)
                free[s] = end[a]
                heapq.heappush(events, free[s])
                lists[s].append(a)
                progress = True
                if a.sweep == first:
                    next_forward[s] += 1
                held[s].add(a.microbatch)
                left[s, a.microbatch] -= 1
                if not left[s, a.microbatch]:
                    held[s].discard(a.microbatch)
                for b in successors[a]:
                    waiting_on[b] -= 1
                    if not waiting_on[b]:
                        ready[b.stage][b] = max(end[d] if d.stage == b.stage else start[d] + sent(d) + latency
                                                for d in deps[b])
                        heapq.heappush(events, ready[b.stage][b])
    return lists


def defer_tail(schedule, count):
    """``schedule`` (plain B) with B of the last ``count`` micro-batches split on every stage but the first,
    their WB last on the stage. In the drain a stage then sends its cotangent down at once and computes
    the parameter gradients while the stages below finish, and only these B pay the split's extra work.
    (Stage 0's B sends nothing: it is all parameter part.)"""
    out = [list(schedule[0])]
    for acts in schedule[1:]:
        tail = [a for a in acts if a.sweep == Sweep.B][-count:] if count > 0 else []
        out.append(list(acts) + [Action(a.stage, Sweep.WB, a.microbatch) for a in tail])
    return out


def candidates(stages, microbatches, sweeps=SWEEPS["forces"], costs=None, max_in_flight=None):
    """{name: schedule} of every schedule ``auto`` considers: GPipe and 1F1B on ``sweeps`` and on their
    split, list schedules for each priority, in-flight bound (S .. ``max_in_flight``) and sweep set, and
    each plain one with B split for its last 1 .. min(S, M) micro-batches (``defer_tail``)."""
    bound = in_flight_bound(stages, microbatches) if max_in_flight is None else max_in_flight
    out, plain = {}, []
    for kind in dict.fromkeys([tuple(sweeps), split(sweeps, (Sweep.B,)), split(sweeps)]):
        if costs is not None and not costs.times(kind):
            continue  # e.g. A split, where the stages merge A's parameter part into B and never time WA
        tag = {0: "", 1: " split"}.get(len(kind) - len(sweeps), " split A+B")
        out["gpipe" + tag] = gpipe(stages, microbatches, kind)
        out["1f1b" + tag] = one_f_one_b(stages, microbatches, kind)
        for limit in range(min(stages, bound), bound + 1):
            for priority in PRIORITIES:
                out[f"list {priority} in-flight {limit}{tag}"] = list_schedule(stages, microbatches, kind, costs,
                                                                              limit, priority)
        if not tag:
            plain = list(out)
    if stages > 1 and Sweep.B in sweeps and (costs is None or costs.times(split(sweeps, (Sweep.B,)))):
        for name in plain:
            for count in range(1, min(stages, microbatches) + 1):
                out[f"{name} split last {count}"] = defer_tail(out[name], count)
    return out


def auto(stages, microbatches, sweeps=SWEEPS["forces"], costs=None, factor=MEMORY_FACTOR):
    """The candidate (``candidates``) with the least predicted step time under ``costs`` among those within
    the memory bound: with ``costs.memory``, a modelled peak per stage at most ``factor`` × 1F1B's (on
    ``sweeps``, same costs; list schedules then try up to 2 S in flight); otherwise at most ``factor`` ×
    1F1B's micro-batches in flight (``in_flight_bound``). Ties go to the fewer in flight, then the first
    found. Returns (name, schedule, check's result)."""
    sweeps = tuple(sweeps)
    memory = costs is not None and costs.memory is not None
    if memory:
        reference = check(one_f_one_b(stages, microbatches, sweeps), stages, microbatches, sweeps, costs=costs)
        budget = [factor * peak * (1 + 1e-9) for peak in reference["peak_memory"]]
        bound = min(microbatches, 2 * stages)
    else:
        bound = in_flight_bound(stages, microbatches, factor)
    best = None
    for name, schedule in candidates(stages, microbatches, sweeps, costs, bound).items():
        result = check(schedule, stages, microbatches, sweeps_of(schedule) if microbatches else sweeps, costs=costs)
        if max(result["max_in_flight"], default=0) > bound or (
                memory and any(p > b for p, b in zip(result["peak_memory"], budget))):
            continue
        score = (round(result["time"], 12), max(result["max_in_flight"], default=0))
        if best is None or score < best[0]:
            best = score, name, schedule, result
    return best[1:]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}  # fixed orders: (stages, microbatches, sweeps) -> lists
SCHEDULE_NAMES = ("auto", *SCHEDULES)  # auto: the best predicted under measured costs (``auto``)


def render(result, microbatches=None, sweeps=None):
    """A table of a ``check`` result (or of a schedule, checked first without costs): a header, then one
    line per time step, one column per stage, "." where the stage idles. With costs (measured durations),
    one line per instant an action starts, "A3 105" (the action and its milliseconds), "|" where a stage
    is still busy, and a last line with the predicted step time and bubble."""
    if not isinstance(result, dict):
        if sweeps is None:
            sweeps = sweeps_of(result)
        if microbatches is None:
            microbatches = 1 + max((a.microbatch for stage in result for a in stage), default=-1)
        result = check(result, len(result), microbatches, sweeps)
    if "grid" in result:
        grid = result["grid"]
        stages = len(grid[0]) if grid else 0
        cells = [[str(a) if a is not None else "." for a in row] for row in grid]
        label = "step"
    else:
        start, end = result["start"], result["end"]
        stages = 1 + max((a.stage for a in start), default=-1)
        times = sorted(set(start.values()))
        cells, label = [], "ms"
        for t in times:
            row = []
            for s in range(stages):
                here = [a for a in start if a.stage == s and start[a] == t and end[a] > t] or \
                       [a for a in start if a.stage == s and start[a] == t]
                busy = any(a.stage == s and start[a] < t < end[a] for a in start)
                row.append(f"{here[0]} {1e3 * (end[here[0]] - t):.0f}" if here else "|" if busy else ".")
            cells.append(row)
        grid = times
    w = max([len(c) for row in cells for c in row] + [len(f"s{stages - 1}")] if stages else [1])
    lines = [f"{label:>4s} " + " ".join(f"s{s}".rjust(w) for s in range(stages))]
    if "grid" in result:
        lines += [f"{t:4d} " + " ".join(c.rjust(w) for c in row) for t, row in enumerate(cells)]
    else:
        lines += [f"{1e3 * t:4.0f} " + " ".join(c.rjust(w) for c in row) for t, row in zip(grid, cells)]
        lines.append(f"predicted step {1e3 * result['time']:.0f} ms, bubble {result['bubble_fraction']:.3f}, "
                     f"in flight {result['max_in_flight']}")
    return "\n".join(lines)


def theoretical_bubble(stages, microbatches):
    """(S-1)/(M+S-1): the idle fraction of GPipe, for any number of sweeps (each takes M+S-1 steps)."""
    return (stages - 1) / (microbatches + stages - 1)
