"""When the daemon sweeps and verifies: a pure decision from what it knows and the time.

`decide(state, policy, now)` answers sweep now, verify now, or wait so many seconds, each with
the reason. The state is an immutable record; the service loop replaces it through the
transition functions below as polls, sweeps and verifications happen. Nothing here reads a
clock, a file or the GPUs, so every rule can be checked by a table of (state, time) -> decision.

Rules, in order:
- On a node with one GPU nothing is ever swept or verified (there is no collective between GPUs
  to measure): the daemon only waits, watches and serves its metrics.
- While a class profile is in force (profile.path) nothing is swept: the profile is the class's
  decision, and a node's own sweep could not replace it. No sweep is even scheduled; the
  verification still runs (against the class's numbers). When the profile leaves (refused after
  an NCCL or topology change, or removed), the service schedules what the published files need.
- While a profile's safe part is served after an upgrade (docs/upgrades.md), nothing is verified
  (the class's numbers were measured under the old versions), and the only sweep is the canary's
  re-measurement, which the service schedules on the class's canary alone.
- Before the first poll: with daemon.sweep_on_start and a sweep pending, poll at once
  (the first poll still looks at the GPUs); otherwise wait one poll interval.
- A pending sweep starts unless the node is degraded, the GPUs are in use, they were in use
  within the quiet period, or the time is outside the maintenance window.
- Verification is due after each sweep and every verify interval; it waits for the same
  conditions and never runs while a sweep is pending.
- At most one sweep and one verification per poll: a sweep that could not run (stopped by a
  job, lock held elsewhere) is tried again after the next poll, not in a loop.
"""

from __future__ import annotations

import datetime as _dt
import enum
from dataclasses import dataclass, replace

_DAY_S = 86400.0
ONE_GPU_WAIT = "one GPU: no collective between GPUs to measure; nothing to sweep or verify"
SAFE_PART_WAIT = ("safe part of the class profile after an upgrade: nothing to verify against until the class "
                  "has a profile for these versions")


class Action(enum.Enum):
    SWEEP = "sweep"
    VERIFY = "verify"
    WAIT = "wait"


@dataclass(frozen=True)
class Decision:
    """What to do now and why. `wait_s` is the pause before the next poll (WAIT only)."""

    action: Action
    reason: str
    wait_s: float = 0.0
    # WAIT while a sweep is pending and untried this poll: why that sweep is pending.
    sweep_pending: str | None = None


@dataclass(frozen=True)
class Policy:
    """The scheduling settings (daemon.* in the configuration, the poll interval possibly from the CLI)."""

    poll_interval_s: float
    quiet_period_s: float
    verify_interval_s: float
    sweep_on_start: bool
    # (start, end) local time; may wrap midnight. None: sweeps may run at any time.
    window: tuple[_dt.time, _dt.time] | None = None
    window_text: str | None = None


@dataclass(frozen=True)
class Now:
    """One reading of the clocks: monotonic seconds for intervals, local time of day for the window."""

    monotonic_s: float
    local_time: _dt.time


@dataclass(frozen=True)
class State:
    """What the scheduler knows. Times are monotonic seconds."""

    last_verify_s: float
    sweep_pending: str | None = None  # why a sweep is needed; None: the published tuning is current
    degraded: bool = False
    busy: bool = False  # the GPUs as last seen (poll or busy check during a trial)
    last_busy_s: float | None = None
    verify_due: bool = False  # set by a finished sweep
    polls: int = 0
    swept_this_poll: bool = False
    verified_this_poll: bool = False
    one_gpu: bool = False  # the node's sweep would have one rank: nothing to measure
    profile: str | None = None  # the class profile in force (its file name); None: the node decides
    safe_part: bool = False  # with `profile`: only its safe part is served, after an upgrade


# -- the decision ---------------------------------------------------------------------------------


def in_window(t: _dt.time, window: tuple[_dt.time, _dt.time] | None) -> bool:
    """Whether local time t is inside the window [start, end), which may wrap midnight."""
    if window is None:
        return True
    start, end = window
    t = t.replace(tzinfo=None)  # the window is naive local time
    if start < end:
        return start <= t < end
    return t >= start or t < end


def _seconds_of_day(t: _dt.time) -> float:
    return t.hour * 3600.0 + t.minute * 60.0 + t.second + t.microsecond / 1e6


def _until_window_opens_s(t: _dt.time, start: _dt.time) -> float:
    return (_seconds_of_day(start) - _seconds_of_day(t)) % _DAY_S


def blocked(state: State, policy: Policy, now: Now) -> tuple[str, float | None] | None:
    """Why no sweep or verification may start now, with the seconds until time alone lifts it
    (None when only an event can: the GPUs freed, the node readable again); None when one may."""
    if state.degraded:
        return "degraded", None
    if state.busy:
        return "GPUs in use", None
    if state.last_busy_s is not None:
        quiet_left_s = policy.quiet_period_s - (now.monotonic_s - state.last_busy_s)
        if quiet_left_s > 0:
            return f"GPUs busy within the last {policy.quiet_period_s:g} s", quiet_left_s
    if policy.window is not None and not in_window(now.local_time, policy.window):
        return (f"outside the maintenance window {policy.window_text}",
                _until_window_opens_s(now.local_time, policy.window[0]))
    return None


def first_wait(state: State, policy: Policy) -> Decision:
    """The pause before the first poll."""
    if state.one_gpu:
        return Decision(Action.WAIT, ONE_GPU_WAIT, policy.poll_interval_s)
    if policy.sweep_on_start and state.sweep_pending is not None:
        return Decision(Action.WAIT, f"sweep_on_start: {state.sweep_pending}", 0.0)
    return Decision(Action.WAIT, "poll interval", policy.poll_interval_s)


def decide(state: State, policy: Policy, now: Now) -> Decision:
    """What to do after a poll (and after each sweep or verification of that poll)."""
    if state.one_gpu:
        return Decision(Action.WAIT, ONE_GPU_WAIT, policy.poll_interval_s)
    block = blocked(state, policy, now)
    wait_s = policy.poll_interval_s
    if block is not None and block[1] is not None:
        wait_s = min(wait_s, block[1])
    if state.sweep_pending is not None and (state.profile is None or state.safe_part):
        if state.swept_this_poll:
            return Decision(Action.WAIT, f"sweep pending ({state.sweep_pending}), tried this poll", wait_s)
        if block is not None:
            return Decision(Action.WAIT, block[0], wait_s, sweep_pending=state.sweep_pending)
        return Decision(Action.SWEEP, state.sweep_pending)
    if state.safe_part:
        return Decision(Action.WAIT, SAFE_PART_WAIT, wait_s)
    if state.verified_this_poll:
        return Decision(Action.WAIT, "verified this poll", wait_s)
    since_verify_s = now.monotonic_s - state.last_verify_s
    due = "after the sweep" if state.verify_due else (
        "verify interval" if since_verify_s >= policy.verify_interval_s else None)
    if due is None:
        return Decision(Action.WAIT, "nothing due", min(wait_s, policy.verify_interval_s - since_verify_s))
    if block is not None:
        return Decision(Action.WAIT, f"verify due ({due}) but {block[0]}", wait_s)
    return Decision(Action.VERIFY, due)


# -- transitions ----------------------------------------------------------------------------------


def polled(state: State) -> State:
    """A poll began: a sweep and a verification may be tried again."""
    return replace(state, polls=state.polls + 1, swept_this_poll=False, verified_this_poll=False)


def gpus_seen(state: State, busy: bool, now_s: float) -> State:
    """The GPUs were looked at: busy (a compute process other than the daemon's own) or not."""
    return replace(state, busy=busy, last_busy_s=now_s if busy else state.last_busy_s)


def ranks_counted(state: State, nranks: int) -> State:
    """The node was (re)loaded: with fewer than two ranks there is nothing to sweep or verify."""
    return replace(state, one_gpu=nranks < 2)


def node_readable(state: State, readable: bool) -> State:
    return replace(state, degraded=not readable)


def sweep_needed(state: State, why: str) -> State:
    """A sweep is due, unless a class profile is in force: then nothing is (see the module's rules)."""
    if state.profile is not None:
        return state
    return replace(state, sweep_pending=why)


def profile_in_force(state: State, name: str | None) -> State:
    """A class profile is in force (name) or none is (None). Entering force drops a pending sweep."""
    if name is None:
        return replace(state, profile=None, safe_part=False)
    return replace(state, profile=name, sweep_pending=None, safe_part=False)


def safe_part_in_force(state: State, name: str, canary_sweep: str | None) -> State:
    """The safe part of class profile `name` is served after an upgrade; `canary_sweep`: why the
    canary re-measures (on the class's canary, until it has), else None: no sweep at all."""
    return replace(state, profile=name, safe_part=True, sweep_pending=canary_sweep)


def sweep_kept_pending(state: State) -> State:
    """The sweep did not run to the end (a job started, the lock was held): try after the next poll."""
    return replace(state, swept_this_poll=True)


def sweep_done(state: State) -> State:
    """Published: verify next."""
    return replace(state, sweep_pending=None, swept_this_poll=True, verify_due=True)


def sweep_failed(state: State) -> State:
    """Failed: retried after the next change or verify failure, not in a loop."""
    return replace(state, sweep_pending=None, swept_this_poll=True)


def verify_started(state: State, now_s: float) -> State:
    return replace(state, verify_due=False, last_verify_s=now_s, verified_this_poll=True)
