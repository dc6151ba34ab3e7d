"""The daemon's scheduler: tables of (state, time) -> decision, no process, no clock, no I/O."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest

from nccltune.daemon import scheduler
from nccltune.daemon.scheduler import Action, Decision, Now, Policy, State

POLICY = Policy(poll_interval_s=60.0, quiet_period_s=0.0, verify_interval_s=86400.0, sweep_on_start=True)
NIGHTLY = replace(POLICY, window=(dt.time(22, 0), dt.time(4, 0)), window_text="22:00-04:00")
QUIET = replace(POLICY, quiet_period_s=300.0)
NOON = dt.time(12, 0)
T0 = 1000.0
# A sweep is pending and a poll has happened: what the loop sees after most polls.
PENDING = State(last_verify_s=T0, sweep_pending="nothing is published yet", polls=1)
SETTLED = State(last_verify_s=T0, polls=1)


def at(seconds_after_t0: float, local: dt.time = NOON) -> Now:
    return Now(T0 + seconds_after_t0, local)


@pytest.mark.parametrize(("state", "policy", "now", "expected"), [
    # a pending sweep starts when nothing stands in the way
    (PENDING, POLICY, at(0), Decision(Action.SWEEP, "nothing is published yet")),
    # degraded, busy: only an event ends the wait, so the next poll is one interval away
    (replace(PENDING, degraded=True), POLICY, at(0),
     Decision(Action.WAIT, "degraded", 60.0, sweep_pending="nothing is published yet")),
    (replace(PENDING, busy=True, last_busy_s=T0), POLICY, at(0),
     Decision(Action.WAIT, "GPUs in use", 60.0, sweep_pending="nothing is published yet")),
    # busy GPUs refuse a sweep without a quiet period too
    (replace(PENDING, busy=True, last_busy_s=T0), POLICY, at(1000),
     Decision(Action.WAIT, "GPUs in use", 60.0, sweep_pending="nothing is published yet")),
    # the quiet period after the GPUs were busy: the wait ends when it does
    (replace(PENDING, last_busy_s=T0), QUIET, at(10),
     Decision(Action.WAIT, "GPUs busy within the last 300 s", 60.0, sweep_pending="nothing is published yet")),
    (replace(PENDING, last_busy_s=T0), QUIET, at(280),
     Decision(Action.WAIT, "GPUs busy within the last 300 s", 20.0, sweep_pending="nothing is published yet")),
    (replace(PENDING, last_busy_s=T0), QUIET, at(300), Decision(Action.SWEEP, "nothing is published yet")),
    # the maintenance window wraps midnight; its end is outside it
    (PENDING, NIGHTLY, at(0, NOON),
     Decision(Action.WAIT, "outside the maintenance window 22:00-04:00", 60.0,
              sweep_pending="nothing is published yet")),
    (PENDING, NIGHTLY, at(0, dt.time(21, 59, 30)),
     Decision(Action.WAIT, "outside the maintenance window 22:00-04:00", 30.0,
              sweep_pending="nothing is published yet")),
    (PENDING, NIGHTLY, at(0, dt.time(23, 30)), Decision(Action.SWEEP, "nothing is published yet")),
    (PENDING, NIGHTLY, at(0, dt.time(3, 59)), Decision(Action.SWEEP, "nothing is published yet")),
    (PENDING, NIGHTLY, at(0, dt.time(4, 0)),
     Decision(Action.WAIT, "outside the maintenance window 22:00-04:00", 60.0,
              sweep_pending="nothing is published yet")),
    # a sweep tried this poll (stopped by a job, lock held elsewhere) waits for the next poll
    (replace(PENDING, swept_this_poll=True), POLICY, at(0),
     Decision(Action.WAIT, "sweep pending (nothing is published yet), tried this poll", 60.0)),
    # verification: after a sweep, and every verify interval, under the same conditions
    (replace(SETTLED, verify_due=True), POLICY, at(5), Decision(Action.VERIFY, "after the sweep")),
    (SETTLED, POLICY, at(86400), Decision(Action.VERIFY, "verify interval")),
    (SETTLED, POLICY, at(86390), Decision(Action.WAIT, "nothing due", 10.0)),
    (SETTLED, POLICY, at(10), Decision(Action.WAIT, "nothing due", 60.0)),
    (replace(SETTLED, verify_due=True, busy=True, last_busy_s=T0), POLICY, at(5),
     Decision(Action.WAIT, "verify due (after the sweep) but GPUs in use", 60.0)),
    (replace(SETTLED, verify_due=True), NIGHTLY, at(0, NOON),
     Decision(Action.WAIT, "verify due (after the sweep) but outside the maintenance window 22:00-04:00", 60.0)),
    (replace(SETTLED, verify_due=True, verified_this_poll=True), POLICY, at(5),
     Decision(Action.WAIT, "verified this poll", 60.0)),
    # never a verification while a sweep is pending, even when it is due
    (replace(PENDING, verify_due=True, swept_this_poll=True), POLICY, at(86400),
     Decision(Action.WAIT, "sweep pending (nothing is published yet), tried this poll", 60.0)),
])
def test_decide(state: State, policy: Policy, now: Now, expected: Decision) -> None:
    assert scheduler.decide(state, policy, now) == expected


@pytest.mark.parametrize(("sweep_on_start", "pending", "expected"), [
    # daemon.sweep_on_start: the first poll (which still looks at the GPUs) comes at once
    (True, "nothing is published yet", Decision(Action.WAIT, "sweep_on_start: nothing is published yet", 0.0)),
    (False, "nothing is published yet", Decision(Action.WAIT, "poll interval", 60.0)),
    (True, None, Decision(Action.WAIT, "poll interval", 60.0)),
])
def test_first_wait(sweep_on_start: bool, pending: str | None, expected: Decision) -> None:
    state = State(last_verify_s=T0, sweep_pending=pending)
    assert scheduler.first_wait(state, replace(POLICY, sweep_on_start=sweep_on_start)) == expected


def test_a_sweep_that_did_not_run_is_tried_again_after_each_poll() -> None:
    state = scheduler.polled(State(last_verify_s=T0, sweep_pending="nothing is published yet"))
    assert scheduler.decide(state, POLICY, at(0)).action is Action.SWEEP
    state = scheduler.sweep_kept_pending(state)
    assert scheduler.decide(state, POLICY, at(1)).action is Action.WAIT
    state = scheduler.polled(state)
    assert scheduler.decide(state, POLICY, at(61)) == Decision(Action.SWEEP, "nothing is published yet")
    assert state.polls == 2


def test_a_finished_sweep_is_verified_in_the_same_poll_and_drift_schedules_another() -> None:
    state = scheduler.sweep_done(scheduler.polled(State(last_verify_s=T0, sweep_pending="topology changed")))
    assert (state.sweep_pending, state.verify_due) == (None, True)
    assert scheduler.decide(state, POLICY, at(100)) == Decision(Action.VERIFY, "after the sweep")
    state = scheduler.verify_started(state, T0 + 100)
    assert (state.verify_due, state.last_verify_s) == (False, T0 + 100)
    assert scheduler.decide(state, POLICY, at(101)).action is Action.WAIT
    state = scheduler.sweep_needed(state, "verify found drift")
    # tried again only after the next poll: one sweep per poll
    assert scheduler.decide(state, POLICY, at(101)).action is Action.WAIT
    assert scheduler.decide(scheduler.polled(state), POLICY, at(161)) == Decision(Action.SWEEP, "verify found drift")


def test_a_failed_sweep_is_not_retried_in_a_loop() -> None:
    state = scheduler.sweep_failed(scheduler.polled(State(last_verify_s=T0, sweep_pending="topology changed")))
    assert state.sweep_pending is None and not state.verify_due
    for polls in range(1, 4):
        state = scheduler.polled(state)
        assert scheduler.decide(state, POLICY, at(60.0 * polls)).action is Action.WAIT


def test_the_quiet_period_counts_from_the_last_time_the_gpus_were_seen_busy() -> None:
    state = scheduler.gpus_seen(PENDING, True, T0)
    assert scheduler.blocked(state, QUIET, at(0)) == ("GPUs in use", None)
    state = scheduler.gpus_seen(state, False, T0 + 10)
    assert state.last_busy_s == T0  # idle readings do not move it
    assert scheduler.blocked(state, QUIET, at(10)) == ("GPUs busy within the last 300 s", 290.0)
    assert scheduler.blocked(state, QUIET, at(299)) == ("GPUs busy within the last 300 s", 1.0)
    assert scheduler.blocked(state, QUIET, at(300)) is None


def test_degraded_comes_and_goes_with_the_node() -> None:
    state = scheduler.node_readable(PENDING, False)
    assert scheduler.blocked(state, POLICY, at(0)) == ("degraded", None)
    assert scheduler.blocked(scheduler.node_readable(state, True), POLICY, at(0)) is None


@pytest.mark.parametrize(("t", "inside"), [
    (dt.time(22, 0), True), (dt.time(0, 0), True), (dt.time(3, 59, 59), True), (dt.time(4, 0), False),
    (dt.time(21, 59, 59), False), (dt.time(23, 0, tzinfo=dt.timezone.utc), True),
])
def test_in_window_wraps_midnight(t: dt.time, inside: bool) -> None:
    assert scheduler.in_window(t, (dt.time(22, 0), dt.time(4, 0))) is inside
    assert scheduler.in_window(t, None)


def test_in_window_without_wrapping() -> None:
    window = (dt.time(1, 0), dt.time(2, 0))
    assert [scheduler.in_window(dt.time(h, m), window) for h, m in ((0, 59), (1, 0), (1, 59), (2, 0))] == [
        False, True, True, False]


def test_a_class_profile_in_force_means_no_sweep_but_verifies() -> None:
    in_force = scheduler.profile_in_force(PENDING, "c0ffee.json")
    assert in_force.profile == "c0ffee.json" and in_force.sweep_pending is None  # entering force drops it
    assert scheduler.sweep_needed(in_force, "topology changed") == in_force  # nothing asks for one
    assert scheduler.decide(in_force, POLICY, at(0)) == Decision(Action.WAIT, "nothing due", 60.0)
    assert scheduler.decide(replace(in_force, verify_due=True), POLICY, at(0)) == Decision(Action.VERIFY,
                                                                                          "after the sweep")
    assert scheduler.decide(in_force, POLICY, at(86400)) == Decision(Action.VERIFY, "verify interval")
    # Even a pending sweep set behind the rule's back does not start while the profile is in force.
    assert scheduler.decide(replace(in_force, sweep_pending="x"), POLICY, at(0)).action is Action.WAIT
    left = scheduler.profile_in_force(in_force, None)
    assert left.profile is None and scheduler.sweep_needed(left, "NCCL changed").sweep_pending == "NCCL changed"


def test_the_safe_part_after_an_upgrade_means_no_verify_and_only_the_canarys_sweep() -> None:
    member = scheduler.safe_part_in_force(PENDING, "c0ffee.json", None)
    assert member.profile == "c0ffee.json" and member.safe_part and member.sweep_pending is None
    assert scheduler.sweep_needed(member, "NCCL changed") == member  # never a re-tune of its own
    for state, now in ((member, at(0)), (replace(member, verify_due=True), at(0)), (member, at(86400))):
        assert scheduler.decide(state, POLICY, now) == Decision(Action.WAIT, scheduler.SAFE_PART_WAIT, 60.0)
    canary = scheduler.safe_part_in_force(SETTLED, "c0ffee.json", "canary: re-measure")
    assert scheduler.decide(canary, POLICY, at(0)) == Decision(Action.SWEEP, "canary: re-measure")
    assert scheduler.decide(canary, NIGHTLY, at(0, NOON)).sweep_pending == "canary: re-measure"  # its window holds
    done = scheduler.sweep_done(canary)
    assert scheduler.decide(done, POLICY, at(0)) == Decision(Action.WAIT, scheduler.SAFE_PART_WAIT, 60.0)
    # The profile of the node's versions in force: every part, verified again.
    whole = scheduler.profile_in_force(done, "c0ffee.json")
    assert not whole.safe_part and scheduler.decide(whole, POLICY, at(0)).action is Action.VERIFY
