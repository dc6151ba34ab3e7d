"""What a published set says it holds (Provenance.state): "tuned", "defaults" or "safe", the same
word in every file's header, in nccl.json and in the metrics; the daemon keeps "tuned" and
"defaults" as decisions and sweeps for "safe"; sets published before "defaults" existed still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nccltune.daemon.actions import PublishedState, read_published_state
from nccltune.errors import InputError
from nccltune.metrics import snapshot_from_store
from nccltune.publish import Provenance, Setting, publish_setting, read_set, render_json, render_sh
from nccltune.publish.setting import check_provenance
from nccltune.store import Store


def prov(state: str) -> Provenance:
    return Provenance(nccltune_version="0", created_at="2030-01-01T00:00:00+00:00", topology_fingerprint="0" * 16,
                      nccl_version=None, backend="gloo", demo=True, profile=None, state=state)


@pytest.mark.parametrize("state", ["tuned", "defaults", "safe"])
def test_the_state_is_the_same_word_in_the_header_and_in_nccl_json(state: str) -> None:
    assert f"# state: {state}\n" in render_sh({"NCCL_ALGO": "Ring"}, prov(state), generation=1)
    assert json.loads(render_json({}, prov(state), generation=1))["provenance"]["state"] == state


def test_a_state_that_says_nothing_known_is_refused() -> None:
    with pytest.raises(InputError, match=r"provenance\.state"):
        check_provenance(prov("tuneed"))


def test_the_daemon_keeps_tuned_and_defaults_and_sweeps_for_safe(tmp_path: Path) -> None:
    from nccltune.config import Config

    cfg = Config(state_dir=str(tmp_path))
    for state, decided in (("defaults", True), ("safe", False), ("tuned", True)):
        publish_setting(cfg, Setting({"NCCL_ALGO": "Ring"}, prov(state), where="test"))
        got = read_published_state(tmp_path)
        assert (got.state, got.decided) == (state, decided)
    # A set of an older nccltune, with "tuned" whatever it published, reads as a decision.
    assert PublishedState(exists=True, state="tuned").decided and not PublishedState(exists=True, state=None).decided


def test_the_metric_carries_the_published_state(tmp_path: Path) -> None:
    from nccltune.config import Config

    publish_setting(Config(state_dir=str(tmp_path)), Setting({"NCCL_ALGO": "Ring"}, prov("defaults"), where="test"))
    assert read_set(tmp_path) is not None
    with Store(tmp_path / "history.db") as store:
        snap = snapshot_from_store(store, fingerprint="0" * 16, publish_dir=tmp_path)
    assert snap.published is not None and snap.published.state == "defaults"


def _sweep_run(store: Store, chosen: str) -> None:
    run = store.start_run(kind="sweep", fingerprint="fp", backend="gloo", demo=True, profile=None,
                          nccl_version=None, driver_version=None, torch_version=None, nccltune_version="0",
                          hostname="h", topology={}, config={})
    store.finish_run(run, status="ok", summary={"chosen": chosen}, chosen_env={}, published_generation=1)


@pytest.mark.parametrize(("chosen", "state"), [("NCCL defaults", "defaults"), ("NCCL_ALGO=Ring", "tuned")])
def test_without_a_readable_set_the_metric_takes_the_state_from_the_sweeps_record(tmp_path: Path, chosen: str,
                                                                                 state: str) -> None:
    with Store(tmp_path / "history.db") as store:
        _sweep_run(store, chosen)
        snap = snapshot_from_store(store, fingerprint="fp", publish_dir=None)
    assert snap.published is not None and snap.published.state == state
