"""The NFD feature file: label values checked before anything is written, the expiry directive,
an atomic replace (nccltune.delivery.nodefeatures)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from nccltune.delivery.nodefeatures import node_labels, render, write_feature_file
from nccltune.errors import EXIT_CONFIG, InputError

NOW = dt.datetime(2026, 12, 7, 23, 30, 15, 123456, tzinfo=dt.timezone.utc)


def test_labels_of_each_verdict() -> None:
    assert node_labels(node_class="0123456789abcdef", published_state="tuned", decision="class",
                       outlier=True) == {"nccltune-class": "0123456789abcdef", "nccltune-state": "tuned",
                                         "nccltune-decision": "class", "nccltune-outlier": "true"}
    nothing = node_labels(node_class="c0ffee", published_state=None, decision=None, outlier=None)
    assert (nothing["nccltune-state"], nothing["nccltune-decision"], nothing["nccltune-outlier"]) == (
        "none", "none", "unknown")
    assert node_labels(node_class="c", published_state="safe", decision="node", outlier=False)[
        "nccltune-outlier"] == "false"


def test_the_file_expires_an_hour_on_in_utc() -> None:
    text = render({"nccltune-b": "2", "nccltune-a": "1"}, NOW.astimezone(dt.timezone(dt.timedelta(hours=-5))))
    lines = text.splitlines()
    assert "# +expiry-time=2026-12-08T00:30:15Z" in lines
    assert lines[-2:] == ["nccltune-a=1", "nccltune-b=2"]


@pytest.mark.parametrize("value", ["-lead", "trail.", "a" * 64, "sp ace", "x=y", "new\nline"])
def test_a_value_that_is_no_label_value_writes_nothing(tmp_path: Path, value: str) -> None:
    target = tmp_path / "features.d" / "nccltune"
    target.parent.mkdir()
    target.write_text("old\n")
    with pytest.raises(InputError, match="nccltune-class") as refused:
        write_feature_file(target, {"nccltune-class": value}, NOW)
    assert refused.value.exit_code == EXIT_CONFIG
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["nccltune"]


def test_a_name_that_is_no_label_name_is_refused() -> None:
    with pytest.raises(InputError, match="not a valid label name"):
        render({"Nccltune/Class": "x"}, NOW)


def test_written_through_a_trusted_directory_only(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could plant a link there
    with pytest.raises(InputError, match="writable"):
        write_feature_file(shared / "features.d" / "nccltune", {"nccltune-class": "c0ffee"}, NOW)
    good = write_feature_file(tmp_path / "features.d" / "nccltune", {"nccltune-class": "c0ffee"}, NOW)
    assert good.read_text().endswith("nccltune-class=c0ffee\n")
