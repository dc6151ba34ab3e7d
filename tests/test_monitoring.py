"""The Prometheus rules and the Grafana dashboard: promtool checks and unit-tests the rules, and every
metric they (and the dashboard) read is one that nccltune's textfile really has."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from publishing import publish_set

from nccltune import __version__
from nccltune.metrics import DAEMON_FILENAME, LiveState, write_metrics_from_store
from nccltune.publish import Provenance
from nccltune.records import Measurement, ReportRow
from nccltune.store import Store

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "monitoring" / "prometheus" / "nccltune.rules.yml"
RULE_TESTS = sorted((REPO / "monitoring" / "prometheus" / "tests").glob("*.yml"))
DASHBOARD = REPO / "monitoring" / "grafana" / "nccltune.json"
SERIES = re.compile(r"\bnccltune_[a-z0-9_]+")
RECORDED = re.compile(r"\bnccltune:[a-z0-9_:]+")


@pytest.fixture(scope="module")
def promtool() -> Path:
    """promtool from Debian's prometheus package, unpacked by .ci/install-promtool (cached under .cache/)."""
    if shutil.which("apt-get") is None and not (REPO / ".cache" / "promtool").exists():
        pytest.skip("no apt-get here to fetch Debian's prometheus package")
    got = subprocess.run(["bash", str(REPO / ".ci" / "install-promtool")], capture_output=True, text=True,
                         timeout=600, stdin=subprocess.DEVNULL)
    assert got.returncode == 0, got.stderr
    path = Path(got.stdout.strip().splitlines()[-1])
    assert path.name == "promtool" and path.is_file()
    return path


def run(promtool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool), *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                          stdin=subprocess.DEVNULL)


def test_promtool_checks_the_rules(promtool: Path) -> None:
    got = run(promtool, "check", "rules", str(RULES.relative_to(REPO)))
    assert got.returncode == 0, got.stdout + got.stderr
    assert "SUCCESS" in got.stdout


def test_promtool_unit_tests_of_the_rules_pass(promtool: Path) -> None:
    assert RULE_TESTS
    got = run(promtool, "test", "rules", *(str(p.relative_to(REPO)) for p in RULE_TESTS))
    out = got.stdout + got.stderr
    assert got.returncode == 0, out
    assert out.count("SUCCESS") == len(RULE_TESTS) and "FAILED" not in out, out


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def rule_tests() -> Iterator[dict[str, Any]]:
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../nccltune.rules.yml"], path
        yield from doc["tests"]


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert len(alerts) >= 14
    firing: set[str] = set()
    silent: set[str] = set()
    for test in rule_tests():
        for case in test.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    assert alerts - firing == set(), "alerts never tested firing"
    assert alerts - silent == set(), "alerts never tested silent"
    assert firing | silent <= alerts, "tests of alerts that do not exist"


def test_every_alert_says_how_bad_and_what() -> None:
    for rule in rules():
        if "alert" in rule:
            assert rule["alert"].startswith("Nccltune"), rule["alert"]
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]


# -- every name the rules and the dashboard read is written ---------------------------------------


def written_names(tmp_path: Path) -> set[str]:
    """Sample names of a real textfile: a history with an ok sweep and a verify against the class,
    a published environment, a node class and a daemon's live values (a refused class profile)."""
    with Store(tmp_path / "history.db") as store:
        meta: dict[str, Any] = dict(fingerprint="fp", backend="gloo", demo=True, profile=None, nccl_version=None,
                                    driver_version=None, torch_version=None, nccltune_version=__version__,
                                    hostname="demo", config={})
        # A sweep under an older NCCL measured the defaults faster: the next one is an upgrade regression.
        run_id = store.start_run(kind="sweep", topology={"gpus": 2}, **{**meta, "nccl_version": "2.20.5"})
        store.add_trial(run_id, seq=1, phase="baseline", label="defaults", env={}, status="ok",
                        measurements=[Measurement(4096, 5.0, 0.8, 0.8)])
        store.finish_run(run_id, status="ok", chosen_env={}, published_generation=None, summary={})
        run_id = store.start_run(kind="sweep", topology={"gpus": 2}, **{**meta, "nccl_version": "2.21.5"})
        store.add_trial(run_id, seq=1, phase="baseline", label="defaults", env={}, status="ok",
                        measurements=[Measurement(4096, 10.0, 0.4, 0.4)])
        row = {"size_bytes": 4096, "default_busbw_gbps": 0.4, "default_noise_pct": 3.0, "tuned_busbw_gbps": 0.4,
               "ratio": 1.0}
        store.finish_run(run_id, status="ok", chosen_env={}, published_generation=1, summary={},
                         rows=[ReportRow.from_dict(row)])
        # A verify against the class profile in force: the class series come with it.
        run_id = store.start_run(kind="verify", topology={}, **meta)
        store.finish_run(run_id, status="ok", summary={"reference": "class", "code": "passed", "rows": [
            {"size_bytes": 4096, "allowed_pct": 10.0, "drift_pct": -2.0, "measured_gbps": 0.392,
             "expected_gbps": 0.4}]})
        publish_set(tmp_path / "published", {"NCCL_TOPO_FILE": "/x.xml"},
                Provenance(nccltune_version=__version__, created_at="2026-11-30T00:00:00+00:00",
                           topology_fingerprint="fp", nccl_version=None, backend="gloo", demo=True, profile=None))
        live = LiveState(state="idle", busy_processes=0, heartbeat_ts=1.0, doctor={}, topology_changes_total=0,
                         profile_state="refused", profile_refused="stale", upgrade_role="member")
        path = write_metrics_from_store(tmp_path / "metrics", store, fingerprint="fp", node_class="cls", live=live,
                                        publish_dir=tmp_path / "published")
    text = path.read_text() + (path.parent / DAEMON_FILENAME).read_text()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    return exprs


def test_the_rules_and_the_dashboard_read_only_series_nccltune_writes(tmp_path: Path) -> None:
    written = written_names(tmp_path)
    exprs = [r["expr"] for r in rules()]
    input_series = [s["series"] for t in rule_tests() for s in t.get("input_series", [])]
    used = {n for text in (*exprs, *input_series, *dashboard_queries()) for n in SERIES.findall(text)}
    assert len(used) >= 12  # the pattern finds them: an empty set would pass vacuously
    assert used - written == set()
    recorded = {r["record"] for r in rules() if "record" in r}
    used_recorded = {n for text in (*exprs, *dashboard_queries()) for n in RECORDED.findall(text)}
    assert used_recorded and used_recorded - recorded == set()


def test_the_dashboard_shows_what_an_sre_looks_at() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "nccltune"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in doc["panels"]:
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
    text = " ".join(dashboard_queries())
    for needed in ("nccltune_busbw_bytes_per_second", "nccltune_last_successful_sweep_timestamp_seconds",
                   "nccltune_upgrade_regression", "nccltune_doctor_findings",
                   "nccltune_verify_drift_ratio", "nccltune_degraded", "nccltune_published_generation",
                   "nccltune:busbw_default_over_class_median:ratio"):
        assert needed in text, needed
    assert {v["name"] for v in doc["templating"]["list"]} >= {"datasource", "class", "instance"}
