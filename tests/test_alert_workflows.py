"""Each documented workflow as promtool plays it: the series are what nccltune's own metric writers
wrote over simulated time (tests/alert_workflows.py), and at each checked time every shipped alert
is either the one expected or silent."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from alert_workflows import DAY, REPO, SimClock, SimNode, alert_names, only, play, promtool_test

HOUR = 3600.0
MIN = 60.0


@pytest.fixture(scope="module")
def promtool() -> Path:
    """promtool from Debian's prometheus package, unpacked by .ci/install-promtool (cached under .cache/)."""
    if shutil.which("apt-get") is None and not (REPO / ".cache" / "promtool").exists():
        pytest.skip("no apt-get here to fetch Debian's prometheus package")
    got = subprocess.run(["bash", str(REPO / ".ci" / "install-promtool")], capture_output=True, text=True,
                         timeout=600, stdin=subprocess.DEVNULL)
    assert got.returncode == 0, got.stderr
    return Path(got.stdout.strip().splitlines()[-1])


def passes(promtool: Path, tmp: Path, series: list[dict[str, str]], interval_s: float,
           expectations: list[dict[str, Any]]) -> None:
    got = promtool_test(promtool, tmp, series, interval_s, expectations)
    out = got.stdout + got.stderr
    assert got.returncode == 0 and "SUCCESS" in out, out


def labels(node: SimNode, **extra: str) -> dict[str, str]:
    return {"severity": "warning", "instance": node.instance, "job": "node", "class": node.node_class, **extra}


def test_the_expectations_cover_every_shipped_alert() -> None:
    assert len(alert_names()) >= 14
    assert {e["alertname"] for e in only(0)} == set(alert_names())


def test_a_stable_single_node_for_90_days_never_alerts(promtool: Path, tmp_path: Path) -> None:
    """The daemon sweeps once, never again (nothing changes), and its daily verify passes."""
    clock = SimClock()
    node = SimNode("s", tmp_path / "s", clock, daemon="running")
    events = [(0.0, node.sweep)] + [(d * DAY + HOUR, lambda: node.verify(passed=True)) for d in range(90)]
    series = play(clock, [node], events, end_s=90 * DAY, interval_s=HOUR)
    passes(promtool, tmp_path, series, HOUR, [e for d in (1, 8, 30, 89) for e in only(d * DAY)])


def test_a_node_that_nothing_confirms_for_a_week_is_stale(promtool: Path, tmp_path: Path) -> None:
    """The same node without a verify: after 7 days nothing shows its tuning current."""
    clock = SimClock()
    node = SimNode("s", tmp_path / "s", clock)
    series = play(clock, [node], [(0.0, node.sweep)], end_s=8 * DAY, interval_s=HOUR)
    stale = {"summary": "nccltune on s:9100: no sweep published and no verify passed for 7d 12h 0m 0s"}
    passes(promtool, tmp_path, series, HOUR,
           only(6 * DAY) + only(7.5 * DAY, {"NccltuneSweepStale": [{"exp_labels": labels(node),
                                                                     "exp_annotations": stale}]}))


def test_fleet_nodes_on_one_class_profile_at_different_generations_agree(promtool: Path, tmp_path: Path) -> None:
    """Node a swept and published twice before the profile came, node b not: the same profile is
    generation 3 on a and 1 on b, its topology copy under each generation's own directory."""
    clock = SimClock()
    a, b = (SimNode(n, tmp_path / n, clock, daemon="running") for n in ("a", "b"))
    env = {"NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "8"}
    events = [(0.0, a.sweep), (HOUR, lambda: a.sweep(env={"NCCL_ALGO": "Tree"})),
              (2 * HOUR, lambda: a.apply_profile("c0ffee" * 10, env)),
              (2 * HOUR, lambda: b.apply_profile("c0ffee" * 10, env))]
    events += [(d * DAY + 3 * HOUR, lambda n=n: n.verify(passed=True, reference="class"))
               for d in range(3) for n in (a, b)]
    series = play(clock, [a, b], events, end_s=3 * DAY, interval_s=10 * MIN)
    generations = {s["series"].split("{")[1].split(",")[1]: s["values"] for s in series
                   if s["series"].startswith("nccltune_published_generation")}
    assert {v.split()[-1].split("x")[0] for v in generations.values()} == {"1", "3"}, generations
    passes(promtool, tmp_path, series, 10 * MIN, only(1 * DAY) + only(2.9 * DAY))


def prolog(tmp_path: Path, outcomes: str) -> tuple[SimNode, list[dict[str, str]]]:
    """A Slurm prolog verifying every 10 minutes, no daemon: each verify rewrites nccltune.prom.
    `outcomes`: one letter per verify, p passed, f failed (not drift: what NCCL ran)."""
    clock = SimClock()
    node = SimNode("p", tmp_path / "p", clock)
    events = [(0.0, node.sweep)] + [
        ((i + 1) * 10 * MIN, lambda ok=(c == "p"): node.verify(passed=ok, drift=-0.01, code=None if ok else "nccl_ran"))
        for i, c in enumerate(outcomes)]
    return node, play(clock, [node], events, end_s=(len(outcomes) + 2) * 10 * MIN, interval_s=MIN)


def test_a_prolog_verify_every_10_minutes_with_one_transient_failure_does_not_page(
        promtool: Path, tmp_path: Path) -> None:
    _, series = prolog(tmp_path, "ppfpppppp")
    passes(promtool, tmp_path, series, MIN, [e for m in (25, 35, 45, 80) for e in only(m * MIN)])


def test_a_prolog_verify_every_10_minutes_failing_again_and_again_pages(promtool: Path, tmp_path: Path) -> None:
    node, series = prolog(tmp_path, "ppffffff")
    page = {"NccltuneVerifyFailed": [{"exp_labels": labels(node),
                                      "exp_annotations": {"summary": "nccltune on p:9100: verify fails"}}]}
    # The second failure is written at 40m: the 5m `for` holds from 45m.
    passes(promtool, tmp_path, series, MIN,
           only(35 * MIN) + only(42 * MIN) + only(46 * MIN, page) + only(80 * MIN, page))


def test_a_daily_verify_daemon_with_one_transient_failure_does_not_page(promtool: Path, tmp_path: Path) -> None:
    clock = SimClock()
    node = SimNode("d", tmp_path / "d", clock, daemon="running")
    events = [(0.0, node.sweep)] + [(d * DAY + HOUR, lambda ok=(d != 3): node.verify(passed=ok, code=None if ok
                                                                                      else "nccl_ran"))
                                    for d in range(8)]
    series = play(clock, [node], events, end_s=8 * DAY, interval_s=10 * MIN)
    passes(promtool, tmp_path, series, 10 * MIN, [e for h in (3 * 24 + 2, 3 * 24 + 20, 4 * 24 + 2, 7 * 24 + 20)
                                                  for e in only(h * HOUR)])


def test_a_daily_verify_daemon_failing_two_days_in_a_row_pages(promtool: Path, tmp_path: Path) -> None:
    clock = SimClock()
    node = SimNode("d", tmp_path / "d", clock, daemon="running")
    events = [(0.0, node.sweep)] + [(d * DAY + HOUR, lambda ok=(d < 3): node.verify(passed=ok, code=None if ok
                                                                                     else "nccl_ran"))
                                    for d in range(6)]
    series = play(clock, [node], events, end_s=6 * DAY, interval_s=10 * MIN)
    page = {"NccltuneVerifyFailed": [{"exp_labels": labels(node),
                                      "exp_annotations": {"summary": "nccltune on d:9100: verify fails"}}]}
    passes(promtool, tmp_path, series, 10 * MIN, only((3 * 24 + 20) * HOUR) + only((4 * 24 + 2) * HOUR, page))


def test_a_planned_stop_does_not_page_and_a_hung_daemon_does(promtool: Path, tmp_path: Path) -> None:
    clock = SimClock()
    stopped, hung = (SimNode(n, tmp_path / n, clock, daemon="running") for n in ("stop", "hang"))

    def hang() -> None:
        hung.daemon = "hung"  # no write from now on: neither file changes

    # Both last write at 59m (the event at 1h comes before that scrape's poll).
    events = [(0.0, stopped.sweep), (0.0, hung.sweep), (HOUR, stopped.stop), (HOUR, hang)]
    series = play(clock, [stopped, hung], events, end_s=4 * HOUR, interval_s=MIN)
    stalled = {"NccltuneDaemonStalled": [{"exp_labels": labels(hung), "exp_annotations": {
        "summary": "nccltune daemon on hang:9100 last wrote its metrics 1h 1m 0s ago"}}]}
    passes(promtool, tmp_path, series, MIN, only(HOUR + 15 * MIN) + only(2 * HOUR, stalled) + only(4 * HOUR, {
        "NccltuneDaemonStalled": [{"exp_labels": labels(hung), "exp_annotations": {
            "summary": "nccltune daemon on hang:9100 last wrote its metrics 3h 1m 0s ago"}}]}))


def test_an_upgrade_restarts_the_daemon_and_pages_its_regression_once(promtool: Path, tmp_path: Path) -> None:
    """An NCCL upgrade: the package restarts the daemon (a planned stop, then a start), which sweeps
    under the new NCCL; that sweep is slower than the last one of the previous NCCL, beyond noise."""
    clock = SimClock()
    node = SimNode("u", tmp_path / "u", clock, daemon="running")

    def start() -> None:
        node.daemon = "running"

    events = [(0.0, lambda: node.sweep(busbw_gbps=0.8, nccl_version="2.20.5")),
              (HOUR, lambda: node.verify(passed=True)), (DAY, node.stop), (DAY + 2 * MIN, start),
              (DAY + 3 * MIN, lambda: node.sweep(busbw_gbps=0.4, nccl_version="2.21.5")),
              (DAY + HOUR, lambda: node.verify(passed=True))]
    series = play(clock, [node], events, end_s=2 * DAY, interval_s=MIN)
    regression = {"NccltuneUpgradeRegression": [{
        "exp_labels": labels(node, collective="all_reduce", size_bytes="4096", setting=setting),
        "exp_annotations": {"summary": f"nccltune on u:9100: all_reduce at 4096 bytes ({setting}) is -50% "
                                       "against the previous versions"}} for setting in ("default", "published")]}
    passes(promtool, tmp_path, series, MIN, only(DAY - MIN) + only(DAY + MIN) + only(DAY + 30 * MIN, regression))


def test_a_real_outlier_on_a_class_profile_pages_once(promtool: Path, tmp_path: Path) -> None:
    """Node o's verifies against its class profile find it 30% below the class median every day:
    below the class, drift beyond what verify allowed, failing in a row. One page: below its class."""
    clock = SimClock()
    good, bad = (SimNode(n, tmp_path / n, clock, daemon="running") for n in ("g", "o"))
    env = {"NCCL_ALGO": "Ring"}
    events = [(0.0, lambda n=n: n.apply_profile("ab" * 32, env)) for n in (good, bad)]
    events += [(d * DAY + HOUR, lambda: good.verify(passed=True, reference="class")) for d in range(4)]
    events += [(d * DAY + HOUR, lambda: bad.verify(passed=False, drift=-0.3, reference="class", code="below_class"))
               for d in range(4)]
    series = play(clock, [good, bad], events, end_s=4 * DAY, interval_s=10 * MIN)
    page = {"NccltuneNodeBelowClassProfile": [{"exp_labels": labels(bad), "exp_annotations": {
        "summary": "o:9100 is below its class k (latest verify against the class profile)"}}]}
    passes(promtool, tmp_path, series, 10 * MIN, only(HOUR + 20 * MIN) + only(2 * HOUR, page) + only(3.5 * DAY, page))
