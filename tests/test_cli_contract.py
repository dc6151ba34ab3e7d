"""Command-line contract details: `--demo [SNAPSHOT]` does not take a command's positional argument,
and an error is said once, prefixed once."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from unittest import mock

from demo_state import clean_env

from nccltune.cli import main
from nccltune.errors import EXIT_CONFIG, EXIT_USAGE


def cli(*args: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, clean_env(), clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def test_apply_demo_then_the_profile_reads_the_profile(tmp_path: Path) -> None:
    profile = tmp_path / "class.json"
    profile.write_text("{not json\n")
    rc, _out, err = cli("apply", "--demo", profile, "--state-dir", tmp_path / "state")
    # The file is read as the class profile (and refused as one), not taken for --demo's snapshot.
    assert rc == EXIT_CONFIG, err
    assert str(profile) in err and "PROFILE" not in err
    rc, _out, err = cli("apply", "--demo", "--state-dir", tmp_path / "state")
    assert rc == EXIT_USAGE and "PROFILE" in err


def test_a_usage_error_is_prefixed_once(tmp_path: Path) -> None:
    rc, _out, err = cli("sweep", "--bogus", "--state-dir", tmp_path / "state")
    assert rc == EXIT_USAGE
    assert err.startswith("nccltune: error: ") and err.count("nccltune:") == 1, err
    assert "unrecognized arguments: --bogus" in err
    rc, _out, err = cli("compare", "1", "--state-dir", tmp_path / "state")
    assert rc == EXIT_USAGE and err.count("nccltune:") == 1 and "compare: " in err, err
