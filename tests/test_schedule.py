"""Pipeline schedules (mlip_parallel.train.schedule): validity, memory bound, bubble, and the checker's errors."""
from collections import Counter
from fractions import Fraction

import pytest

from mlip_parallel.train.schedule import (SCHEDULES, SWEEPS, Action, ScheduleError, check, dependencies, gpipe,
                                    one_f_one_b, render, theoretical_bubble)

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
