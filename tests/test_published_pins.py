"""What nccltune published is never a pin: the marker NCCLTUNE_APPLIED (publish/applied.py) a launch
form leaves, and what a sweep makes of it (delivery.jobenv.from_published), its plan and the fixed
part of its trials. A marker only ever removes pins, and only where the job's value is the value
the state directory's own published set holds; every other marker is ignored with a log line.
(Each launch form against a sweep's plan: tests/test_job_precedence.py.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from publishing import publish_set

from nccltune.config import Config, SweepConfig
from nccltune.delivery.jobenv import from_published
from nccltune.pipeline import SweepPipeline
from nccltune.publish import Provenance, read_set
from nccltune.publish.applied import APPLIED_VAR, Applied, merged
from nccltune.report.sweep import plan_text
from nccltune.topology.source import bundled_topologies_dir
from nccltune.trials.trialenv import fixed_part

EVERY = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_IB_HCA": "^mlx5_2", "NCCL_NVLS_ENABLE": "0"}
SINGLE = {"NCCL_MIN_NCHANNELS": "32", "NCCL_ALGO": "Ring"}
DIGEST = "0123456789abcdef"
SNAPSHOT = bundled_topologies_dir() / "h200x2-nvswitch-vm.json"


def prov() -> Provenance:
    return Provenance(nccltune_version="0", created_at="now", topology_fingerprint="f", nccl_version=None,
                      backend="nccl", demo=False, profile=None)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    d = tmp_path / "state"
    publish_set(d, EVERY, prov(), topology_xml="<system version=\"1\"/>\n", single_node_env=SINGLE)
    return d


def set_id(state: Path) -> str:
    got = read_set(state)
    assert got is not None
    return got.set_id


# -- the marker's spelling ----------------------------------------------------------------------


def test_a_marker_names_a_set_and_the_variables_in_the_order_they_were_set() -> None:
    got = Applied.parse(f"12:{DIGEST}:NCCL_B,NCCL_A,TORCH_NCCL_X,NCCLTUNE_TUNER_TABLE")
    assert got == Applied(12, DIGEST, ("NCCL_B", "NCCL_A", "TORCH_NCCL_X", "NCCLTUNE_TUNER_TABLE"))
    assert got.set_id == f"12:{DIGEST}" and Applied.parse(got.value) == got
    assert Applied.parse(f"0:{DIGEST}:") == Applied(0, DIGEST, ())


@pytest.mark.parametrize("text", [
    f"012:{DIGEST}:NCCL_A",  # a number as no publisher writes it
    f"1:{DIGEST.upper()}:NCCL_A",
    "1:0123:NCCL_A",
    f"1:{DIGEST}:nccl_a",
    f"1:{DIGEST}:HOME",
    f"1:{DIGEST}:NCCL_A,",
    f"1:{DIGEST}:NCCL_A,,NCCL_B",
    f"1:{DIGEST}:NCCL_A\n",
    f"1:{DIGEST}:NCCL_A\nexport LD_PRELOAD=/x",
    f"1:{DIGEST}",
    f"1:{DIGEST}:" + ",".join(f"NCCL_{i}" for i in range(200000)),  # longer than any set can name
    "",
])
def test_anything_else_is_no_marker(text: str) -> None:
    assert Applied.parse(text) is None


def test_a_launch_that_applied_nothing_leaves_the_marker_alone() -> None:
    assert merged(f"1:{DIGEST}:NCCL_A", f"1:{DIGEST}", []) is None
    assert merged(None, f"1:{DIGEST}", []) is None


def test_a_launch_adds_its_names_to_a_marker_of_the_same_set_and_replaces_any_other() -> None:
    same = f"1:{DIGEST}"
    assert merged(None, same, ["NCCL_A"]) == f"{same}:NCCL_A"
    assert merged(f"{same}:NCCL_B,NCCL_A", same, ["NCCL_A", "NCCL_C"]) == f"{same}:NCCL_B,NCCL_A,NCCL_C"
    assert merged(f"{same}:", same, ["NCCL_A"]) == f"{same}:NCCL_A"
    assert merged(f"2:{DIGEST}:NCCL_B", same, ["NCCL_A"]) == f"{same}:NCCL_A"
    assert merged("1:fedcba9876543210:NCCL_B", same, ["NCCL_A"]) == f"{same}:NCCL_A"
    assert merged(f"{same}:NCCL_B\nexport X=1", same, ["NCCL_A"]) == f"{same}:NCCL_A"


# -- what a sweep makes of it -------------------------------------------------------------------


def test_no_marker_takes_nothing_and_reads_nothing(tmp_path: Path) -> None:
    got = from_published({"NCCL_ALGO": "Ring"}, tmp_path / "missing")
    assert got.values == {} and got.notes == () and got.generation is None
    assert got.own({"NCCL_ALGO": "Ring"}) == {"NCCL_ALGO": "Ring"}


def test_the_named_variables_with_their_published_values_are_not_the_jobs(state: Path) -> None:
    env = {**EVERY, **SINGLE, "HOME": "/root", APPLIED_VAR: f"{set_id(state)}:{','.join([*EVERY, *SINGLE])}"}
    got = from_published(env, state)
    assert got.values == {**EVERY, **SINGLE} and got.generation == 1 and got.notes == ()
    assert got.own(env) == {"HOME": "/root"}


def test_a_value_the_job_set_after_the_launch_stays_its_own(state: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The launch applied NCCL_ALGO=Ring; the job then set NCCL_ALGO=Tree: a pin. One it unset is
    simply not there."""
    env = {"NCCL_ALGO": "Tree", "NCCL_IB_HCA": "^mlx5_2",
           APPLIED_VAR: f"{set_id(state)}:NCCL_ALGO,NCCL_IB_HCA,NCCL_NVLS_ENABLE"}
    with caplog.at_level(logging.INFO, logger="nccltune.delivery.jobenv"):
        got = from_published(env, state)
    assert got.values == {"NCCL_IB_HCA": "^mlx5_2"}
    assert got.own(env) == {"NCCL_ALGO": "Tree"}
    assert "NCCL_ALGO: set by the job to another value than published" in caplog.text


def test_a_value_the_job_set_itself_is_a_pin_even_when_it_equals_the_published_one(state: Path) -> None:
    """The launch kept the job's own NCCL_IB_HCA (equal to the published value), so its marker does
    not name it: a pin."""
    env = {"NCCL_IB_HCA": "^mlx5_2", "NCCL_NVLS_ENABLE": "0", APPLIED_VAR: f"{set_id(state)}:NCCL_NVLS_ENABLE"}
    got = from_published(env, state)
    assert got.own(env) == {"NCCL_IB_HCA": "^mlx5_2"}


@pytest.mark.parametrize(("marker", "said"), [
    ("1:0123456789abcdef:NCCL_IB_HCA", "but the set published in"),  # a digest of no set here
    ("7:{digest}:NCCL_IB_HCA", "but the set published in"),  # another generation
    ("garbage\n{id}:NCCL_IB_HCA", "is not a marker nccltune writes"),
])
def test_a_marker_of_another_set_or_none_at_all_is_ignored_with_a_log_line(
        state: Path, caplog: pytest.LogCaptureFixture, marker: str, said: str) -> None:
    got_set = read_set(state)
    assert got_set is not None
    text = marker.format(digest=got_set.digest, id=got_set.set_id)
    env = {"NCCL_IB_HCA": "^mlx5_2", APPLIED_VAR: text}
    with caplog.at_level(logging.WARNING, logger="nccltune.delivery.jobenv"):
        got = from_published(env, state)
    assert got.values == {} and got.own(env) == {"NCCL_IB_HCA": "^mlx5_2"}
    assert said in caplog.text and "ignored" in caplog.text
    assert "\n" not in caplog.records[0].getMessage()  # the job's text is escaped


def test_a_forged_marker_removes_no_more_than_the_published_values(state: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A job's environment that names the right set with names of its own choosing gets nothing
    trusted: a name the set does not hold is ignored, a value other than the published one stays a
    pin, and nothing is ever added."""
    env = {"NCCL_ALGO": "Tree", "NCCL_SOCKET_IFNAME": "eth9", "NCCL_IB_HCA": "^mlx5_2",
           APPLIED_VAR: f"{set_id(state)}:NCCL_ALGO,NCCL_SOCKET_IFNAME,NCCL_IB_HCA,NCCL_PROTO"}
    with caplog.at_level(logging.INFO, logger="nccltune.delivery.jobenv"):
        got = from_published(env, state)
    assert got.values == {"NCCL_IB_HCA": "^mlx5_2"}
    assert got.own(env) == {"NCCL_ALGO": "Tree", "NCCL_SOCKET_IFNAME": "eth9"}
    assert "names NCCL_SOCKET_IFNAME, NCCL_PROTO, which the published set of generation 1 does not hold" in caplog.text


def test_a_set_that_cannot_be_read_takes_nothing(state: Path, caplog: pytest.LogCaptureFixture) -> None:
    marker = f"{set_id(state)}:NCCL_IB_HCA"
    sh = state / "generations" / "1" / "nccl.sh"
    sh.write_text(sh.read_text() + "touch /tmp/x\n")
    with caplog.at_level(logging.WARNING, logger="nccltune.delivery.jobenv"):
        got = from_published({"NCCL_IB_HCA": "^mlx5_2", APPLIED_VAR: marker}, state)
    assert got.values == {} and "cannot be read" in caplog.text
    empty = state.parent / "empty"
    got = from_published({"NCCL_IB_HCA": "^mlx5_2", APPLIED_VAR: marker}, empty)
    assert got.values == {} and "nothing is published" in got.notes[0]


# -- the sweep: its plan and its trials' fixed part ---------------------------------------------


def pipeline(state: Path, env: dict[str, str], **sweep: object) -> SweepPipeline:
    cfg = Config(state_dir=str(state), sweep=SweepConfig(**sweep))  # type: ignore[arg-type]
    return SweepPipeline(cfg, demo=str(SNAPSHOT), env=env)


def test_a_sweep_from_a_job_that_got_the_set_plans_and_starts_its_trials_as_if_it_had_not(state: Path) -> None:
    got = read_set(state)
    assert got is not None
    launched = {**got.env, **got.single_node_env, "HOME": "/root",
                APPLIED_VAR: f"{got.set_id}:{','.join([*got.env, *got.single_node_env])}"}
    pipe = pipeline(state, launched)
    plan, _search = pipe.plan()
    assert plan.pinned == {}
    assert plan.from_published == {**EVERY, **SINGLE} and plan.published_generation == 1
    assert "NCCL_NVLS_ENABLE" in plan.variables or any(p.name == "NCCL_NVLS_ENABLE" for p in plan.pruned)
    fixed = fixed_part(pipe.own_env(), {}, ())
    assert fixed == {"HOME": "/root"}
    text = plan_text(plan, pipe.node(), 1, 1.0, pipe.profile)
    said = text.split("Not pinned: ", 1)[1].split("\n\n", 1)[0].splitlines()
    assert said[0].startswith("set in the environment from nccltune's published set (generation 1)")
    assert sorted(said[1:]) == sorted(f"  {name}={value}" for name, value in {**EVERY, **SINGLE}.items())
    assert "Pinned (" not in text


def test_a_config_pin_and_the_jobs_own_value_stay_pins(state: Path) -> None:
    got = read_set(state)
    assert got is not None
    launched = {**got.env, "NCCL_ALGO": "Tree",
                APPLIED_VAR: f"{got.set_id}:NCCL_IB_HCA,NCCL_NVLS_ENABLE,TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    plan, _search = pipeline(state, launched, pin={"NCCL_NVLS_ENABLE": "0"}).plan()
    assert {n: (p.value, p.source) for n, p in plan.pinned.items()} == {
        "NCCL_ALGO": ("Tree", "environment"), "NCCL_NVLS_ENABLE": ("0", "config")}
    assert plan.from_published == {"NCCL_IB_HCA": "^mlx5_2", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def test_without_a_marker_the_published_values_are_pins_as_before(state: Path) -> None:
    got = read_set(state)
    assert got is not None
    plan, _search = pipeline(state, dict(got.env)).plan()
    assert set(plan.pinned) == set(EVERY) and plan.from_published == {} and plan.published_generation is None


def test_a_joining_node_starts_its_trials_from_its_own_environment_as_the_job_set_it(
        state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that joins a sweep from a job that got its own published set leaves that set out of
    its trials' fixed part too, or its defaults would not be the coordinator's."""
    from nccltune.cli import main
    from nccltune.trials.launch import torchrun

    got = read_set(state)
    assert got is not None
    seen: dict[str, str] = {}

    def join(endpoint: object, *, base_env: dict[str, str], **kw: object) -> int:
        seen.update(base_env)
        return 0

    monkeypatch.setattr(torchrun, "join", join)
    for name, value in {**got.env, "NCCL_ALGO": "Tree", APPLIED_VAR: f"{got.set_id}:{','.join(got.env)}"}.items():
        monkeypatch.setenv(name, value)
    assert main(["sweep", "--join", "127.0.0.1:29400", "--demo", "--state-dir", str(state)]) == 0
    assert {k: v for k, v in seen.items() if k.startswith(("NCCL", "TORCH_NCCL"))} == {"NCCL_ALGO": "Tree"}
