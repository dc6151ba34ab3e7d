"""One trial's environment, from the plan to the rank processes and to the published files.

nccltune's topology file travels as a marker (publish.OWN_TOPOLOGY): the runner resolves it to the
run's copy for the ranks and the history, the publisher to the generation's own copy. The last
test follows it through a real CPU-demo sweep whose ranks (torch gloo) record what they got.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from demo_state import SHORT_CONFIG, SNAPSHOT, clean_env

from nccltune.config import load_config, with_overrides
from nccltune.errors import InputError
from nccltune.pipeline import SweepPipeline, stages
from nccltune.publish import OWN_TOPOLOGY, Provenance, Setting, publish_setting, read_set, validate_env
from nccltune.store import Store
from nccltune.trials.trialenv import RankSide, TrialEnv, fixed_part

TOPO = "NCCL_TOPO_FILE"


def side(tmp_path: Path, topology_file: Path | None, **kw: Any) -> RankSide:
    return RankSide(topology_file, tmp_path / "trial-001", tmp_path / "trial-001" / "rank", tmp_path / "cache", **kw)


def test_the_ranks_get_the_fixed_part_under_the_candidate_with_the_marker_as_this_nodes_copy(tmp_path: Path) -> None:
    trial = TrialEnv({"NCCL_ALGO": "Tree", "PYTHONPATH": "/elsewhere", "OMP_NUM_THREADS": "4", "KEPT": "1"},
                     {"NCCL_ALGO": "Ring", TOPO: OWN_TOPOLOGY, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    run_copy = tmp_path / "runs" / "00001" / "ncclTopology.xml"
    env = trial.for_ranks(side(tmp_path, run_copy, nccl_log=True, gpus=(0, 1)))
    assert env[TOPO] == str(run_copy)
    assert env["NCCL_ALGO"] == "Ring" and env["KEPT"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "PYTHONPATH" not in env and env["PYTHONUNBUFFERED"] == "1" and env["OMP_NUM_THREADS"] == "4"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_FILE"].startswith(str(tmp_path / "trial-001"))
    # Another node resolves the same trial to its own copy; the trial itself is unchanged.
    other = tmp_path / "joiner" / "trial-001" / "ncclTopology.xml"
    assert trial.for_ranks(side(tmp_path, other))[TOPO] == str(other)
    assert trial.candidate[TOPO] == OWN_TOPOLOGY and trial.own_topology
    assert trial.recorded(run_copy) == {**trial.candidate, TOPO: str(run_copy)}
    # NCCL is never handed the marker as a file name.
    with pytest.raises(ValueError, match="own topology file"):
        trial.for_ranks(side(tmp_path, None))
    # A candidate without the marker needs no topology file, and a real path in it stays as it is.
    assert TOPO not in TrialEnv({}, {"NCCL_ALGO": "Ring"}).for_ranks(side(tmp_path, None))
    assert TrialEnv({}, {TOPO: "/site/topo.xml"}).recorded(None) == {TOPO: "/site/topo.xml"}


def test_ranks_of_the_rank_user_get_the_allow_list_and_still_fork_from_one_server(tmp_path: Path) -> None:
    """Run as bench.user, a rank gets what the allow-list names (trials.credentials.rank_may_get),
    whatever root's other variables are called; two trials that differ in their candidate alone
    still start alike (rankserver.same_start), so their ranks fork from one server."""
    from nccltune.trials.credentials import RankUser
    from nccltune.trials.rankserver import same_start

    user = RankUser("ranks", 999, 999, (999,))
    fixed = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/nccl/lib", "NCCL_IB_HCA": "mlx5_0", "HOME": "/root",
             "DATABASE_URL": "postgres://admin:pw@db/x", "http_proxy": "http://u:pw@proxy:3128",
             "PYTHONPATH": "/root/lib"}
    ring = TrialEnv(fixed, {"NCCL_ALGO": "Ring", TOPO: OWN_TOPOLOGY}).for_ranks(
        side(tmp_path, tmp_path / "topo.xml", user=user, nccl_log=True, gpus=(0, 1)))
    tree = TrialEnv(fixed, {"NCCL_ALGO": "Tree"}).for_ranks(side(tmp_path, None, user=user, nccl_log=True, gpus=(0, 1)))
    for env in (ring, tree):
        assert not {"DATABASE_URL", "http_proxy", "PYTHONPATH"} & set(env)
        assert env["LD_LIBRARY_PATH"] == "/opt/nccl/lib" and env["NCCL_IB_HCA"] == "mlx5_0"
        assert env["HOME"] == str(tmp_path / "trial-001" / "rank") and env["USER"] == "ranks"
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["PYTHONUNBUFFERED"] == "1" and env["NCCL_DEBUG"] == "INFO"
    assert ring["NCCL_ALGO"] == "Ring" and ring[TOPO] == str(tmp_path / "topo.xml") and TOPO not in tree
    assert same_start(ring, tree)


def test_the_marker_passes_the_value_rules_the_control_channel_applies() -> None:
    assert validate_env({TOPO: OWN_TOPOLOGY}, source="trial candidate") == {TOPO: OWN_TOPOLOGY}


def test_the_fixed_part_keeps_no_earlier_publish_of_nccltune_but_a_sites_tuner() -> None:
    calling = {"PATH": "/usr/bin", TOPO: "/var/lib/nccltune/generations/3/ncclTopology.xml",
               "NCCL_TUNER_PLUGIN": "/var/lib/nccltune/generations/3/libnccl-tuner-nccltune-ab.so",
               "NCCLTUNE_TUNER_TABLE": "/x", "NCCLTUNE_TUNER_FINGERPRINT": "ab", "NCCL_PROTO": "LL",
               "NCCL_IB_HCA": "mlx5_0"}
    got = fixed_part(calling, {"NCCL_SOCKET_IFNAME": "eth0"}, ["NCCL_PROTO"])
    assert got == {"PATH": "/usr/bin", "NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "eth0"}
    site = fixed_part({"NCCL_TUNER_PLUGIN": "libnccl-tuner-site.so"}, {}, [])
    assert site == {"NCCL_TUNER_PLUGIN": "libnccl-tuner-site.so"}


def test_a_setting_naming_the_marker_without_a_topology_to_publish_is_refused(tmp_path: Path) -> None:
    cfg = with_overrides(load_config(None), state_dir=str(tmp_path / "state"))
    prov = Provenance(nccltune_version="0", created_at="2000-01-01T00:00:00+00:00", topology_fingerprint="f",
                      nccl_version=None, backend="gloo", demo=True, profile=None)
    with pytest.raises(InputError, match="NCCL_TOPO_FILE: names nccltune's own topology file"):
        publish_setting(cfg, Setting({TOPO: OWN_TOPOLOGY}, prov))
    assert read_set(cfg.publish_dir) is None  # nothing was written
    published = publish_setting(cfg, Setting({TOPO: OWN_TOPOLOGY}, prov, topology_xml="<system/>\n"))
    assert published.env[TOPO] == str(Path(cfg.publish_dir) / "generations" / str(published.generation)
                                       / "ncclTopology.xml")


@pytest.fixture
def recording_python(tmp_path: Path) -> Path:
    """bench.python: records, for every process it starts, its trial directory, rank, the
    NCCL_TOPO_FILE it got and whether that file exists, then runs this Python."""
    seen = shlex.quote(str(tmp_path / "seen.txt"))
    path = tmp_path / "recording-python"
    path.write_text("\n".join([
        "#!/bin/sh",
        'if [ -n "${NCCL_TOPO_FILE+x}" ]; then '
        'if [ -f "$NCCL_TOPO_FILE" ]; then there=file; else there=missing; fi; else there=unset; fi',
        f'printf "%s %s %s %s\\n" "$(dirname "$PWD")" "${{RANK-none}}" "${{NCCL_TOPO_FILE-unset}}" "$there" >> {seen}',
        f'exec {shlex.quote(sys.executable)} "$@"',
    ]) + "\n")
    path.chmod(0o755)
    return path


def test_one_trials_topology_file_is_the_runs_copy_for_its_ranks_and_the_generations_once_published(
        tmp_path: Path, recording_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(SHORT_CONFIG, sort_keys=False))
    # Ranks by exec, so that the recording interpreter sees each (a forked rank's environment is
    # the same request: test_forked_ranks.py).
    cfg = with_overrides(load_config(config), state_dir=str(tmp_path / "state"),
                         **{"bench.python": str(recording_python), "bench.fork_ranks": False})

    # gloo's noise decides nothing here: the choice is the topology file alone, so that it is published.
    real_choose = stages.choose

    def topology_file_alone(result: Any, *args: Any, **kw: Any) -> Any:
        assert result.topo_only is not None
        return real_choose(dataclasses.replace(result, chosen=result.topo_only), *args, **kw)

    monkeypatch.setattr(stages, "choose", topology_file_alone)
    report = SweepPipeline(cfg, demo=str(SNAPSHOT), env=clean_env()).run()
    assert report.run_id is not None and report.published is not None

    run_copy = Path(cfg.state_dir) / "runs" / f"{report.run_id:05d}" / "ncclTopology.xml"
    with Store(Path(cfg.state_dir) / "history.db") as store:
        trials = store.trials(report.run_id)
    # What each rank process saw, by trial: two ranks each; the topology file the run's copy, where
    # the candidate carries it, and a file there; NCCL's defaults without one.
    seen: dict[str, set[tuple[str, str, str]]] = {}
    for line in (tmp_path / "seen.txt").read_text().splitlines():
        trial_dir, rank, topo, there = line.split(" ")
        seen.setdefault(Path(trial_dir).name, set()).add((rank, topo, there))
    assert len(trials) == len(seen) >= 4
    for t in trials:
        ranks = seen[f"trial-{t.seq:03d}"]
        if t.phase == "baseline":
            assert t.env == {} and ranks == {("0", "unset", "unset"), ("1", "unset", "unset")}
        else:
            # The history stores the candidate as the ranks got it: the run's own copy.
            assert t.env[TOPO] == str(run_copy), t.label
            assert ranks == {("0", str(run_copy), "file"), ("1", str(run_copy), "file")}, t.label

    # Published: the generation's own copy, with the text the ranks read.
    generation = Path(cfg.publish_dir) / "generations" / str(report.published.generation)
    current = read_set(cfg.publish_dir)
    assert current is not None
    assert current.env[TOPO] == report.every_job_env[TOPO] == str(generation / "ncclTopology.xml")
    assert (generation / "ncclTopology.xml").read_text() == run_copy.read_text()
    assert TOPO not in current.single_node_env
    env_file = (generation / "nccl.env").read_text()
    assert f"{TOPO}={generation / 'ncclTopology.xml'}\n" in env_file and OWN_TOPOLOGY not in env_file
    # The run's record names the stable copy, as it always has.
    assert report.chosen_env[TOPO] == str(cfg.topology_file)
    assert Path(cfg.topology_file).read_text() == run_copy.read_text()
