"""Pipeline schedules (mlip_parallel.train.pipeline.schedule): validity, memory bound, bubble, and the checker's errors;
split sweeps (the deferred W), the timed simulator, list scheduling and auto."""
from collections import Counter
from fractions import Fraction

import pytest

from mlip_parallel.train.pipeline.schedule import (PRIORITIES, SCHEDULES, SWEEPS, Action, Costs, ScheduleError, auto, check,
                                          defer_tail, dependencies, gpipe, in_flight_bound, list_schedule,
                                          one_f_one_b, render, split, sweeps_of, theoretical_bubble)

GRID = [(S, M) for S in range(1, 6) for M in range(1, 9)]


def _steps_of(grid):
    return {a: t for t, row in enumerate(grid) for a in row if a is not None}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", sorted(SWEEPS))
def test_schedules_are_complete_and_deadlock_free(name, kind):
    sweeps = SWEEPS[kind]
    for S, M in GRID:
        schedule = SCHEDULES[name](S, M, sweeps)
        assert len(schedule) == S
        for s, acts in enumerate(schedule):
            assert Counter((a.stage, a.sweep, a.microbatch) for a in acts) == Counter(
                (s, sw, m) for sw in sweeps for m in range(M)), (name, kind, S, M, s)
        result = check(schedule, S, M, sweeps)
        assert result["busy"] == len(sweeps) * S * M
        # independent of check's simulation: every dependency finished in an earlier step, one action per cell
        when = _steps_of(result["grid"])
        assert len(when) == result["busy"] and len(result["grid"]) == result["steps"]
        for a, t in when.items():
            assert all(when[d] < t for d in dependencies(a, S, sweeps)), (name, kind, S, M, a)


@pytest.mark.parametrize("kind", sorted(SWEEPS))
def test_1f1b_bounds_in_flight_below_gpipe(kind):
    sweeps = SWEEPS[kind]
    for S, M in GRID:
        ofob = check(one_f_one_b(S, M, sweeps), S, M, sweeps, max_in_flight=S)
        assert max(ofob["max_in_flight"]) == min(S, M)
        gp = check(gpipe(S, M, sweeps), S, M, sweeps)
        assert gp["max_in_flight"] == [M] * S
        if M > S:
            assert max(ofob["max_in_flight"]) < max(gp["max_in_flight"])


@pytest.mark.parametrize("kind", sorted(SWEEPS))
def test_gpipe_bubble_is_theoretical(kind):
    """GPipe with K sweeps: each sweep is a wavefront of M + S - 1 steps and the pipeline turns around at its
    ends without idling, so steps = K (M + S - 1), busy = K M S and the bubble is (S-1)/(M+S-1) for any K:
    2 sweeps (energy) and 4 sweeps (forces) alike."""
    sweeps = SWEEPS[kind]
    K = len(sweeps)
    for S, M in GRID:
        r = check(gpipe(S, M, sweeps), S, M, sweeps)
        assert r["steps"] == K * (M + S - 1)
        assert Fraction(r["busy"], r["steps"] * S) == 1 - Fraction(S - 1, M + S - 1)
        assert r["bubble_fraction"] == pytest.approx(theoretical_bubble(S, M), abs=1e-12)


def test_1f1b_energy_matches_gpipe_steps():
    for S, M in GRID:
        assert check(one_f_one_b(S, M, SWEEPS["energy"]), S, M, SWEEPS["energy"])["steps"] == 2 * (M + S - 1)


def test_1f1b_forces_bubble_not_worse_than_gpipe():
    """With four sweeps the greedy 1F1B order fills the B1 → A → B round trip with other micro-batches'
    work: its bubble is at most GPipe's while it holds at most S micro-batches instead of M."""
    for S, M in GRID:
        ofob = check(one_f_one_b(S, M), S, M)
        assert ofob["bubble_fraction"] <= check(gpipe(S, M), S, M)["bubble_fraction"] + 1e-12, (S, M)


def test_action_str_is_unambiguous():
    assert str(Action(0, "F", 3)) == "F3"
    assert str(Action(0, "B1", 3)) == "B1.3"
    assert str(Action(0, "B", 13)) == "B13"
    assert str(Action(0, "B1", 3)) != str(Action(0, "B", 13))


def test_check_reports_deadlock_between_two_stages():
    sweeps = SWEEPS["energy"]  # stage 0 waits for B0 of stage 1, which first waits for F1 of stage 0
    A = lambda s, sw, m: Action(s, sw, m)  # noqa: E731
    schedule = [[A(0, "F", 0), A(0, "B", 0), A(0, "F", 1), A(0, "B", 1)],
                [A(1, "F", 1), A(1, "F", 0), A(1, "B", 0), A(1, "B", 1)]]
    with pytest.raises(ScheduleError, match="deadlock") as err:
        check(schedule, 2, 2, sweeps)
    msg = str(err.value)
    assert "B0@stage0 waits for B0@stage1" in msg and "F1@stage1 waits for F1@stage0" in msg


def test_check_reports_deadlock_of_early_force_backward():
    sweeps = SWEEPS["forces"]  # stage 1 starts with B1 before its own forward; stage 0 waits on it
    schedule = [[Action(0, sw, 0) for sw in sweeps],
                [Action(1, sw, 0) for sw in ("B1", "F", "A", "B")]]
    with pytest.raises(ScheduleError, match="deadlock") as err:
        check(schedule, 2, 1, sweeps)
    assert "B1.0@stage0 waits for B1.0@stage1" in str(err.value)
    assert "B1.0@stage1 waits for F0@stage1" in str(err.value)


def test_check_reports_malformed_lists():
    sweeps = SWEEPS["forces"]
    good = gpipe(2, 2, sweeps)
    with pytest.raises(ScheduleError, match=r"stage 1: missing actions A1"):
        check([good[0], [a for a in good[1] if a != Action(1, "A", 1)]], 2, 2, sweeps)
    with pytest.raises(ScheduleError, match=r"stage 0: action B1.0 is repeated"):
        check([good[0] + [Action(0, "B1", 0)], good[1]], 2, 2, sweeps)
    with pytest.raises(ScheduleError, match="not an action of stage 0"):
        check([good[0] + [Action(1, "F", 0)], good[1]], 2, 2, sweeps)
    with pytest.raises(ScheduleError, match="unknown action"):
        check([good[0] + [Action(0, "X", 0)], good[1]], 2, 2, sweeps)
    with pytest.raises(ScheduleError, match="2 stage lists, expected 3"):
        check(good, 3, 2, sweeps)
    assert issubclass(ScheduleError, ValueError)


def test_check_reports_in_flight_violation():
    with pytest.raises(ScheduleError, match=r"stage 0 holds 3 micro-batches in flight at step 2.*max_in_flight=2"):
        check(gpipe(2, 4), 2, 4, SWEEPS["forces"], max_in_flight=2)


def test_render_grid():
    result = check(one_f_one_b(3, 4), 3, 4, SWEEPS["forces"])
    text = render(result)
    lines = text.splitlines()
    assert len(lines) == result["steps"] + 1
    assert lines[0].split() == ["step", "s0", "s1", "s2"]
    assert lines[1].split() == ["0", "F0", ".", "."]
    assert all(len(line.split()) == 4 for line in lines[1:])
    assert "B1.0" in text
    assert render(one_f_one_b(3, 4)) == text  # a schedule is checked first


# ----------------------------------------------- split sweeps, measured costs, list scheduling, auto
SPLITS = {"plain": lambda sweeps: tuple(sweeps), "B": lambda sweeps: split(sweeps, ("B",)), "A+B": split}


def _random_costs(stages, seed, memory=False):
    import random
    rng = random.Random(seed)
    seconds = tuple({k: rng.uniform(0.2, 3.0) for k in ("F", "B1", "A", "B", "A.in", "WA", "B.in", "WB")}
                    for _ in range(stages))
    held = tuple({"F": rng.uniform(1, 2), "B1": rng.uniform(1, 3), "WA": rng.uniform(0, 1), "WB": rng.uniform(0, 1)}
                 for _ in range(stages))
    return Costs(seconds, latency=rng.uniform(0, 0.3), memory=held if memory else None)


def test_split_sweeps_and_their_dependencies():
    assert split(SWEEPS["forces"]) == ("F", "B1", "A", "B", "WA", "WB")
    assert split(SWEEPS["forces"], ("B",)) == ("F", "B1", "A", "B", "WB")
    assert split(SWEEPS["energy"]) == ("F", "B", "WB")
    assert split(SWEEPS["evaluate"]) == SWEEPS["evaluate"]
    forces = split(SWEEPS["forces"])
    # WA / WB need only their own A / B; A and B (the parts neighbours wait for) keep the whole sweeps' dependencies
    assert dependencies(Action(1, "WA", 2), 3, forces) == [Action(1, "A", 2)]
    assert dependencies(Action(1, "WB", 2), 3, forces) == [Action(1, "B", 2)]
    assert set(dependencies(Action(1, "B", 2), 3, forces)) == {Action(1, "A", 2), Action(2, "A", 2), Action(2, "B", 2)}
    assert set(dependencies(Action(1, "A", 2), 3, forces)) == {Action(1, "B1", 2), Action(0, "A", 2), Action(0, "B1", 2)}
    assert set(dependencies(Action(0, "B", 0), 2, split(SWEEPS["energy"]))) == {Action(0, "F", 0), Action(1, "B", 0)}
    assert str(Action(0, "WB", 13)) == "WB13" and sweeps_of(gpipe(2, 2, forces)) == forces


@pytest.mark.parametrize("kind, parts", [("forces", "B"), ("forces", "A+B"), ("energy", "B")])
def test_split_and_list_schedules_are_complete_and_deadlock_free(kind, parts):
    """Every fixed order on split sweeps and every list schedule (each priority, under random measured costs and
    bounds 1 .. S + 1): all actions once, no deadlock, each action after its dependencies (plus the latency
    across stages), each W after its A or B, and never more in flight than the bound."""
    sweeps = SPLITS[parts](SWEEPS[kind])
    for S, M in GRID[::2]:
        costs = _random_costs(S, 7 * S + M)
        schedules = {"gpipe": gpipe(S, M, sweeps), "1f1b": one_f_one_b(S, M, sweeps)}
        for bound in range(1, S + 2):
            for priority in PRIORITIES:
                schedules[priority, bound] = list_schedule(S, M, sweeps, costs, bound, priority)
        for name, schedule in schedules.items():
            bound = name[1] if isinstance(name, tuple) else None
            r = check(schedule, S, M, sweeps, max_in_flight=bound, costs=costs)
            assert r["busy"] == pytest.approx(sum(costs.duration(a, sweeps) for acts in schedule for a in acts))
            for a, t in r["start"].items():
                for d in dependencies(a, S, sweeps):
                    assert r["end"][d] + (costs.latency if d.stage != a.stage else 0) <= t + 1e-12, (name, S, M, a, d)
            assert all(r["start"][Action(a.stage, "W" + a.sweep, a.microbatch)] >= r["end"][a]
                       for acts in schedule for a in acts if "W" + a.sweep in sweeps)


def test_w_keeps_a_micro_batch_in_flight():
    """A micro-batch is in flight until its last action on the stage: deferring every W to the end holds all M."""
    sweeps = split(SWEEPS["forces"])
    late_w = [[a for a in acts if a.sweep[0] != "W"] + [a for a in acts if a.sweep[0] == "W"]
              for acts in one_f_one_b(2, 4, sweeps)]
    assert check(late_w, 2, 4, sweeps)["max_in_flight"] == [4, 4]
    with pytest.raises(ScheduleError, match=r"stage 0 holds 3 micro-batches in flight at step \d+ \(during F2\), "
                                            r"more than max_in_flight=2"):
        check(late_w, 2, 4, sweeps, max_in_flight=2)
    early_w = [[Action(0, sw, 0) for sw in ("F", "B1", "A", "WB", "B", "WA")], [Action(1, sw, 0) for sw in sweeps]]
    with pytest.raises(ScheduleError, match=r"deadlock.*WB0@stage0 waits for B0@stage0"):
        check(early_w, 2, 1, sweeps)


def test_timed_simulation():
    """Unit costs without latency reproduce the unit-time model; latency delays every message; a whole A or B
    costs its own measurement, or its parts' sum; the memory model holds the double-backward graph until WA."""
    sweeps = SWEEPS["forces"]
    for S, M in GRID[::5]:
        unit = Costs(tuple({sw: 1.0 for sw in ("F", "B1", "A", "B")} for _ in range(S)))
        for order in (gpipe, one_f_one_b):
            a, b = check(order(S, M), S, M), check(order(S, M), S, M, costs=unit)
            assert a["steps"] == b["time"] and a["bubble_fraction"] == pytest.approx(b["bubble_fraction"])
    # one micro-batch on 2 stages: 8 actions in a chain, 4 of its links cross stages
    costs = Costs(({sw: 1.0 for sw in ("F", "B1", "A", "B")},) * 2, latency=0.5)
    assert check(gpipe(2, 1), 2, 1, costs=costs)["time"] == pytest.approx(8 + 4 * 0.5)
    parts = Costs(({"F": 1.0, "B1": 1.0, "A": 1.5, "A.in": 0.5, "WA": 1.25, "B.in": 0.25, "WB": 0.75},) * 2)
    assert parts.duration(Action(0, "A", 0), sweeps) == 1.5  # measured whole
    assert parts.duration(Action(0, "B", 0), sweeps) == 1.0  # B.in + WB
    assert parts.duration(Action(0, "B", 0), split(sweeps, ("B",))) == 0.25
    assert parts.duration(Action(0, "A", 0), split(sweeps, ("B",))) == 1.5
    assert parts.duration(Action(0, "A", 0), split(sweeps)) == 0.5
    # B split: stage 1's WB overlaps stage 0's B, so the chain is shorter by stage 1's WB
    only_b = split(sweeps, ("B",))
    chain = 1 + 1 + 1 + 1 + 1.5 + 1.5 + 0.25 + 1  # F F B1 B1 A A, stage 1's B.in, stage 0's B.in + WB
    assert check(gpipe(2, 1, only_b), 2, 1, only_b, costs=parts)["time"] == pytest.approx(chain)
    with pytest.raises(ScheduleError, match="costs have no duration of sweep WA on stage 0"):
        no_wa = Costs(({"F": 1, "B1": 1, "A.in": 1, "B.in": 1, "WB": 1},))
        check(gpipe(1, 1, split(sweeps)), 1, 1, split(sweeps), costs=no_wa)
    held = Costs(parts.seconds, memory=({"F": 1.0, "B1": 10.0, "WA": 100.0, "WB": 1000.0},) * 2)
    order = [[Action(s, sw, 0) for sw in ("F", "B1", "A", "B", "WB", "WA")] for s in range(2)]
    assert check(order, 2, 1, split(sweeps), costs=held)["peak_memory"] == [1111.0, 1111.0]
    assert check(gpipe(2, 1), 2, 1, sweeps, costs=held)["peak_memory"] == [11.0, 11.0]


def test_messages_leave_when_sent():
    """A remote successor waits for the action's message (``Costs.sent``: "<key>.sent", capped at the
    duration), not for its end; a local one for its end. List scheduling and auto plan with the same model."""
    sweeps = SWEEPS["forces"]
    row = {"F": 1.0, "B1": 1.0, "A": 1.5, "B": 1.0}
    at_end, early = Costs((row,) * 2, latency=0.25), Costs((row | {"A.sent": 0.5},) * 2, latency=0.25)
    # F@0 0-1, F@1 1.25-2.25, B1@1 -3.25, B1@0 3.5-4.5, A@0 4.5-6 (sent at 5), A@1 from 5.25 (else 6.25) to 6.75,
    # B@1 -7.75, B@0 from 8 (its own A ended at 6, A@1's message at 6) to 9
    result = check(gpipe(2, 1), 2, 1, sweeps, costs=early)
    assert result["start"][Action(1, "A", 0)] == pytest.approx(5.25)
    assert result["start"][Action(0, "B", 0)] == pytest.approx(8.0) and result["time"] == pytest.approx(9.0)
    assert check(gpipe(2, 1), 2, 1, sweeps, costs=at_end)["time"] == pytest.approx(10.0)
    assert Costs(({"A": 1.5, "A.sent": 2.0},)).sent(Action(0, "A", 0), sweeps) == 1.5  # capped
    parts = Costs(({"A.in": 1.0, "A.in.sent": 0.5, "WA": 1.0, "A.sent": 0.1},))  # a whole A from its parts
    assert parts.sent(Action(0, "A", 0), sweeps) == 2.0 and parts.sent(Action(0, "A", 0), split(sweeps)) == 0.5
    for S, M in [(2, 8), (3, 4)]:
        costs = Costs(tuple(dict(r, **{"A.sent": 0.3 * r["A"]}) for r in _random_costs(S, S * M).seconds), 0.01)
        name, schedule, result = auto(S, M, sweeps, costs)
        assert result["time"] <= check(one_f_one_b(S, M), S, M, costs=costs)["time"] + 1e-12
        for priority in PRIORITIES:  # a fixed order only gains from earlier messages
            lists = list_schedule(S, M, sweeps, costs, S, priority)
            assert check(lists, S, M, sweeps, costs=costs)["time"] <= \
                check(lists, S, M, sweeps, costs=Costs(costs.seconds, 0.01))["time"] + 1e-12


def test_merged_a_costs_and_memory():
    """With A's parameter part merged into B (stages time no WA), auto leaves A split out and considers plain
    and B-split sweeps; the memory model holds B1's graph until B (or WB, B split) and A's captured gradients
    from A to B."""
    sweeps = SWEEPS["forces"]
    merged = Costs(({"F": 1.0, "B1": 1.0, "A": 0.5, "B": 2.5, "B.in": 0.5, "WB": 2.0},) * 2,
                   memory=({"F": 1.0, "B1": 10.0, "A": 100.0, "WB": 1000.0, "merged": 1.0},) * 2)
    assert merged.times(sweeps) and merged.times(split(sweeps, ("B",))) and not merged.times(split(sweeps))
    name, schedule, _ = auto(2, 8, sweeps, merged)
    assert "split A+B" not in name and sweeps_of(schedule) != split(sweeps)
    one = [[Action(0, sw, 0) for sw in ("F", "B1", "A", "B")]]
    assert check(one, 1, 1, sweeps, costs=merged)["peak_memory"] == [111.0]  # F + B1 + A's, all until B
    unmerged = Costs(merged.seconds, memory=({"F": 1.0, "B1": 10.0, "A": 100.0, "WB": 1000.0, "merged": 0.0},))
    plain = Costs(merged.seconds, memory=({"F": 1.0, "B1": 10.0, "WB": 1000.0},))
    assert check(one, 1, 1, sweeps, costs=plain)["peak_memory"] == [11.0]  # B1's graph goes with A
    # two micro-batches, A of the second before B of the first: both hold F, B1 (unless freed by A) and A's
    two = [[Action(0, sw, m) for sw, m in (("F", 0), ("F", 1), ("B1", 0), ("B1", 1), ("A", 0), ("A", 1), ("B", 0),
                                             ("B", 1))]]
    assert check(two, 1, 2, sweeps, costs=merged)["peak_memory"] == [222.0]
    assert check(two, 1, 2, sweeps, costs=unmerged)["peak_memory"] == [212.0]
    assert check(two, 1, 2, sweeps, costs=plain)["peak_memory"] == [22.0]
    b_split = [[Action(0, sw, 0) for sw in ("F", "B1", "A", "B", "WB")]]
    assert check(b_split, 1, 1, split(sweeps, ("B",)), costs=merged)["peak_memory"] == [1111.0]


def test_b_split_for_the_last_micro_batches_only():
    """``defer_tail``: an A or B is split exactly where the schedule holds its W. B split for the last ``count``
    micro-batches on every stage but the first, their WB last: complete and deadlock free, those B cost B.in and
    the others the whole B, only they hold WB's bytes; where the split costs extra work, the drain gains, and
    auto chooses it with costs as measured for SchNet on 2 stages."""
    for kind in ("forces", "energy"):
        sweeps, only_b = SWEEPS[kind], split(SWEEPS[kind], ("B",))
        for S, M in GRID[::3]:
            plain = one_f_one_b(S, M, sweeps)
            costs = _random_costs(S, 3 * S + M)
            for count in range(min(S, M) + 1):
                tail = defer_tail(plain, count)
                assert tail[0] == plain[0]
                for s in range(1, S):
                    deferred = [Action(s, "WB", a.microbatch) for a in plain[s] if a.sweep == "B"][M - count:]
                    assert tail[s] == plain[s] + deferred
                r = check(tail, S, M, only_b, costs=costs)
                split_b = {(a.stage, a.microbatch) for acts in tail for a in acts if a.sweep == "WB"}
                row = costs.seconds

                def cost(a):
                    if a.sweep == "B":
                        return row[a.stage]["B.in"] if (a.stage, a.microbatch) in split_b else row[a.stage]["B"]
                    return row[a.stage][a.sweep]
                assert r["busy"] == pytest.approx(sum(cost(a) for acts in tail for a in acts)), (kind, S, M, count)
                for a, t in r["start"].items():
                    for d in dependencies(a, S, only_b):
                        assert r["end"][d] + (costs.latency if d.stage != a.stage else 0) <= t + 1e-12
    # one micro-batch, 2 stages: F F B1 B1 A A (1 each), then stage 1's B: whole 4, or B.in 2 and WB 2.5 after it;
    # stage 0's B (1) waits for stage 1's B: 6 + 4 + 1 = 11 plain, 6 + 2 + max(1, 2.5) = 10.5 split
    row = {"F": 1.0, "B1": 1.0, "A": 1.0, "B": 4.0, "B.in": 2.0, "WB": 2.5}
    costs = Costs((dict(row, B=1.0, **{"B.in": 0.0, "WB": 1.0}), row))
    assert check(gpipe(2, 1), 2, 1, costs=costs)["time"] == pytest.approx(11.0)
    assert check(defer_tail(gpipe(2, 1), 1), 2, 1, split(SWEEPS["forces"], ("B",)), costs=costs)["time"] == 10.5
    # memory: only the split micro-batch holds WB's bytes (stage 1 merged: B1's graph held until B, or WB)
    held = Costs(costs.seconds, memory=({"F": 1.0, "B1": 10.0, "A": 100.0, "WB": 1000.0, "merged": 1.0},) * 2)
    only_b = split(SWEEPS["forces"], ("B",))
    assert check(gpipe(2, 2), 2, 2, costs=held)["peak_memory"][1] == 222.0
    assert check(defer_tail(gpipe(2, 2), 1), 2, 2, only_b, costs=held)["peak_memory"][1] == 1111.0
    assert check(gpipe(2, 2, only_b), 2, 2, only_b, costs=held)["peak_memory"][1] == 2122.0
    # costs measured for SchNet (8 blocks, 2 stages, ms): stage 1 runs A in B; its split B costs 4 ms more
    ms = 1e-3
    measured = Costs(({"F": 19 * ms, "F.sent": 19 * ms, "B1": 20 * ms, "A": 45 * ms, "A.sent": 19 * ms, "B": 23 * ms,
                       "B.in": 1 * ms, "WB": 23 * ms},
                      {"F": 20 * ms, "B1": 22 * ms, "A": 0.0, "B": 64 * ms, "B.in": 25 * ms, "WB": 43 * ms}),
                     latency=0.1 * ms, memory=({"F": 48.0, "B1": 56.0, "A": 24.0, "WB": 24.0},
                                               {"F": 48.0, "B1": 58.0, "WB": 38.0, "merged": 1.0}))
    plain = check(one_f_one_b(2, 8), 2, 8, costs=measured)
    whole = check(one_f_one_b(2, 8, only_b), 2, 8, only_b, costs=measured)
    name, schedule, result = auto(2, 8, SWEEPS["forces"], measured)
    assert "split last" in name and result["time"] < 0.985 * min(plain["time"], whole["time"]), name
    assert result["peak_memory"] == plain["peak_memory"]


def test_auto_beats_1f1b_within_the_memory_bound():
    """auto's choice is never predicted slower than 1F1B, holds at most 1.2 x 1F1B's in flight (or, with measured
    memory, 1.2 x its modelled peak per stage), and splits the sweeps whose deferred part is dear."""
    for S, M in [(2, 8), (3, 4), (4, 8)]:
        for memory in (False, True):
            costs = _random_costs(S, S * M, memory)
            name, schedule, result = auto(S, M, SWEEPS["forces"], costs)
            reference = check(one_f_one_b(S, M), S, M, costs=costs)
            assert result["time"] <= reference["time"] + 1e-12, (S, M, name)
            if memory:
                assert len(result["peak_memory"]) == len(reference["peak_memory"]) == S
                assert all(p <= 1.2 * q * (1 + 1e-9) for p, q in zip(result["peak_memory"], reference["peak_memory"]))
            else:
                assert max(result["max_in_flight"]) <= in_flight_bound(S, M) == int(1.2 * S + 1e-9)
    dear_w = Costs(({"F": 1.0, "B1": 1.0, "A": 3.0, "A.in": 1.0, "WA": 2.0, "B.in": 0.25, "WB": 2.5},) * 2, latency=0.05)
    name, schedule, result = auto(2, 8, SWEEPS["forces"], dear_w)
    assert "split A+B" in name and sweeps_of(schedule) == split(SWEEPS["forces"])
    assert result["time"] < check(one_f_one_b(2, 8), 2, 8, costs=dear_w)["time"]
    name, schedule, result = auto(3, 4)  # no costs: the unit-time model
    assert result["steps"] <= check(one_f_one_b(3, 4), 3, 4)["steps"]
    with pytest.raises(ScheduleError, match="unknown priority 'fastest'"):
        list_schedule(2, 2, priority="fastest")


def test_render_with_measured_durations():
    costs = Costs(({"F": 0.01, "B1": 0.02, "A": 0.03, "A.in": 0.01, "WA": 0.025, "B.in": 0.001, "WB": 0.02},) * 2,
                  latency=0.001)
    name, schedule, result = auto(2, 2, SWEEPS["forces"], costs)
    lines = render(result).splitlines()
    assert lines[0].split() == ["ms", "s0", "s1"]
    assert lines[1].split() == ["0", "F0", "10", "."]
    assert lines[-1].startswith(f"predicted step {1e3 * result['time']:.0f} ms, bubble ")
    assert "|" in render(result)


def test_warm_up_costs_are_medians_at_a_common_machine_speed():
    """pipeline.combine_steps: each step is scaled to the median speed of the sweeps every step times (F, B1,
    A), so a split step that ran on a machine 25 % slower does not make the split sweeps look dear; per key
    the median over the steps that timed it, the cold first step only where nothing later timed the key."""
    from mlip_parallel.train.pipeline import combine_steps

    plain = {"F": 2.0, "B1": 2.0, "A": 4.0, "A.sent": 1.0, "B": 6.0}
    split_b = {"F": 2.0, "B1": 2.0, "A": 4.0, "A.sent": 1.0, "B.in": 2.0, "WB": 4.5}
    memory = {"F": 10.0, "B1": 20.0}
    slow = {k: 1.25 * v for k, v in split_b.items()} | {"A.sent": 1.0}  # a step on a busy machine
    # (the send offsets do not enter the machine speed: A.sent, not slowed, would rescale the slow step)
    cold = {k: 3.0 * v for k, v in plain.items()} | {"only_cold": 7.0}
    steps = [(cold, memory), (slow, memory | {"WB": 5.0}), (plain, memory), (split_b, memory | {"WB": 5.0}),
             (dict(plain, B=6.6), memory)]
    seconds, held = combine_steps(steps)
    # the slow step rescaled: B.in + WB 6.5 s, cheaper than B (unscaled, their mean would be 7.3 s, dearer)
    assert seconds["B.in"] == pytest.approx(2.0) and seconds["WB"] == pytest.approx(4.5)
    assert seconds["B"] == pytest.approx(6.3)  # median of the two warm plain steps, the cold one left out
    assert seconds["F"] == pytest.approx(2.0) and seconds["A"] == pytest.approx(4.0)
    assert seconds["A.sent"] == pytest.approx(1.0)
    assert seconds["only_cold"] == pytest.approx(7.0 * 8.0 / 24.0)  # nothing later timed it: the cold step's, rescaled
    assert held == {"F": 10.0, "B1": 20.0, "WB": 5.0}

