"""Pipeline-parallel schedules for training potentials: plain data, checked by simulation.

Stage ``s`` runs on rank ``s`` of ``S`` stages; micro-batches are ``m = 0..M-1``. A force-trained step
makes four sweeps over the stages per micro-batch, an energy-only step two, an evaluation (energies,
forces and stress without parameter gradients) F and B1 (``SWEEPS``):

* ``F``  forward, 0 -> S-1:   F(s,m) needs F(s-1,m).
* ``B1`` force backward, S-1 -> 0: B1(s,m) needs F(s,m) and B1(s+1,m).
* ``A``  double backward, first sweep, 0 -> S-1: A(s,m) needs B1(s,m), B1(0,m) (the loss is formed on
  stage 0 at the end of B1) and A(s-1,m).
* ``B``  double backward, second sweep, S-1 -> 0: B(s,m) needs A(s,m), A(s+1,m) and B(s+1,m).
  Energy only (no B1/A): B(s,m) needs F(s,m) and B(s+1,m).

(Terms on s-1 / s+1 are dropped at the ends of the pipeline.) A micro-batch is *in flight* on stage s
from the start of F(s,m) to the end of B(s,m): its activations are held meanwhile.

A schedule, as in ``torch.distributed.pipelining``, decides the order and never touches tensors: one
list of ``Action`` per stage, in execution order. ``check`` validates one without starting processes,
under this execution model: each stage executes its list in order; an action starts once every action
it depends on (on any stage) has completed; every action takes one time step; all stages step together;
sends never block.
"""
from dataclasses import dataclass
from enum import Enum

from ..errors import MLIPError


class Sweep(str, Enum):
    """One pass of a micro-batch through the stages: F forward (up), B1 force backward (down), A and B
    the two halves of the double backward (up, down). A str, so "F" == Sweep.F."""
    F = "F"
    B1 = "B1"
    A = "A"
    B = "B"

    def __str__(self):
        return self.value

    __format__ = str.__format__


SWEEPS = {"forces": (Sweep.F, Sweep.B1, Sweep.A, Sweep.B), "energy": (Sweep.F, Sweep.B),
          "evaluate": (Sweep.F, Sweep.B1)}


class ScheduleError(MLIPError, ValueError):
    """A schedule is malformed, deadlocks, or holds more micro-batches in flight than allowed."""


@dataclass(frozen=True, order=True)
class Action:
    """One sweep of one micro-batch on one stage.

    ``str`` is ``sweep + microbatch`` ("F3", "A0", "B12"), with a dot after sweeps whose name ends in a
    digit so that it stays unambiguous: "B1.3" is B1 of micro-batch 3, "B13" is B of micro-batch 13."""
    stage: int
    sweep: str
    microbatch: int

    def __str__(self):
        return f"{self.sweep}{'.' if self.sweep[-1].isdigit() else ''}{self.microbatch}"


def _where(a):
    return f"{a}@stage{a.stage}"


def dependencies(action, stages, sweeps=SWEEPS["forces"]):
    """The actions (on any stage) that must have completed before ``action`` may start."""
    s, m, sw = action.stage, action.microbatch, action.sweep
    i = sweeps.index(sw)
    deps = [Action(s, sweeps[i - 1], m)] if i else []  # the previous sweep on the same stage
    if sw in ("F", "A"):
        if s > 0:
            deps.append(Action(s - 1, sw, m))
        if sw == "A":
            deps.append(Action(0, "B1", m))
    else:  # B1, B run S-1 -> 0
        if s < stages - 1:
            if sw == "B" and "A" in sweeps:
                deps.append(Action(s + 1, "A", m))
            deps.append(Action(s + 1, sw, m))
    return list(dict.fromkeys(deps))


def gpipe(stages, microbatches, sweeps=SWEEPS["forces"]):
    """On every stage: every micro-batch of one sweep, then every micro-batch of the next sweep."""
    return [[Action(s, sw, m) for sw in sweeps for m in range(microbatches)] for s in range(stages)]


def one_f_one_b(stages, microbatches, sweeps=SWEEPS["forces"]):
    """Memory-bounded 1F1B-style order: at most S micro-batches in flight on any stage. Built by running
    the execution model greedily: at every step each stage runs, if one is ready, a backward sweep of its
    oldest in-flight micro-batch (the oldest first, so memory is freed soonest), else starts its next
    forward while fewer than S micro-batches are in flight on it, else idles. For the energy loss
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
        for a in row:
            lists[a.stage].append(a)
            if a.sweep == sweeps[-1]:
                in_flight[a.stage].remove(a.microbatch)
        done.update(row)
    return lists


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _validate(schedule, stages, microbatches, sweeps):
    if tuple(sweeps) not in SWEEPS.values():
        raise ScheduleError(f"unknown sweep set {tuple(sweeps)}; expected one of {list(SWEEPS.values())}")
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
        missing = [str(Action(s, sw, m)) for sw in sweeps for m in range(microbatches) if Action(s, sw, m) not in seen]
        if missing:
            raise ScheduleError(f"stage {s}: missing actions {', '.join(missing)}")


def check(schedule, stages, microbatches, sweeps=SWEEPS["forces"], max_in_flight=None):
    """Validate ``schedule`` by simulating the execution model; raise ``ScheduleError`` on a malformed list,
    a deadlock, or more than ``max_in_flight`` micro-batches in flight on a stage. Returns {"steps",
    "grid" (rows = steps, columns = stages, Action or None), "busy", "bubble_fraction", "max_in_flight"}."""
    sweeps = tuple(sweeps)
    _validate(schedule, stages, microbatches, sweeps)
    done, pos, grid = set(), [0] * stages, []
    in_flight, peak = [set() for _ in range(stages)], [0] * stages
    first, last = sweeps[0], sweeps[-1]
    while any(pos[s] < len(schedule[s]) for s in range(stages)):
        t, row = len(grid), [None] * stages
        for s in range(stages):
            if pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                if all(d in done for d in dependencies(a, stages, sweeps)):
                    row[s] = a
        if not any(row):
            stuck = [f"{_where(schedule[s][pos[s]])} waits for "
                     + ", ".join(_where(d) for d in dependencies(schedule[s][pos[s]], stages, sweeps) if d not in done)
                     for s in range(stages) if pos[s] < len(schedule[s])]
            raise ScheduleError(f"deadlock at step {t}: " + "; ".join(stuck))
        for s, a in enumerate(row):
            if a is None:
                continue
            pos[s] += 1
            if a.sweep == first:
                in_flight[s].add(a.microbatch)
            peak[s] = max(peak[s], len(in_flight[s]))
            if max_in_flight is not None and len(in_flight[s]) > max_in_flight:
                raise ScheduleError(f"stage {s} holds {len(in_flight[s])} micro-batches in flight at step {t} "
                                    f"(during {a}), more than max_in_flight={max_in_flight}")
            if a.sweep == last:
                in_flight[s].discard(a.microbatch)
        done.update(a for a in row if a is not None)
        grid.append(row)
    busy = sum(len(acts) for acts in schedule)
    steps = len(grid)
    return {"steps": steps, "grid": grid, "busy": busy,
            "bubble_fraction": 1 - busy / (steps * stages) if steps else 0.0, "max_in_flight": peak}


def render(result, microbatches=None, sweeps=None):
    """A step x stage table of a ``check`` result (or of a schedule, checked first): a header, then one line
    per time step, one column per stage, "." where the stage idles."""
    if not isinstance(result, dict):
        acts = [a for stage in result for a in stage]
        if sweeps is None:
            sweeps = SWEEPS["forces"] if any(a.sweep == "B1" for a in acts) else SWEEPS["energy"]
        if microbatches is None:
            microbatches = 1 + max((a.microbatch for a in acts), default=-1)
        result = check(result, len(result), microbatches, sweeps)
    grid = result["grid"]
    stages = len(grid[0]) if grid else 0
    cells = [[str(a) if a is not None else "." for a in row] for row in grid]
    w = max([len(c) for row in cells for c in row] + [len(f"s{stages - 1}")] if stages else [1])
    lines = ["step " + " ".join(f"s{s}".rjust(w) for s in range(stages))]
    lines += [f"{t:4d} " + " ".join(c.rjust(w) for c in row) for t, row in enumerate(cells)]
    return "\n".join(lines)


def theoretical_bubble(stages, microbatches):
    """(S-1)/(M+S-1): the idle fraction of GPipe, for any number of sweeps (each takes M+S-1 steps)."""
    return (stages - 1) / (microbatches + stages - 1)
