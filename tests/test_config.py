"""The config file: defaults, the documented example, and a file:line for every kind of fault."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import textwrap
from pathlib import Path

import pytest
from conftest import EXAMPLES

from nccltune.config import (
    MAX_MESSAGE_BYTES,
    OVERRIDE_SOURCE,
    Config,
    DaemonConfig,
    config_from_dict,
    config_to_dict,
    format_size,
    load_config,
    parse_config,
    parse_size,
    parse_window,
    profile_collectives,
    setting_names,
    with_overrides,
)
from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.pipeline.planning import settings as search_settings

EXAMPLE = EXAMPLES / "config.yaml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def fault(tmp_path: Path, text: str) -> InputError:
    p = write(tmp_path, text)
    with pytest.raises(InputError) as info:
        load_config(p, required=True)
    err = info.value
    assert err.exit_code == EXIT_CONFIG == 78
    assert err.path == str(p)
    return err


# ---------------------------------------------------------------------------------------------
# Defaults and the example file


def test_defaults() -> None:
    cfg = Config()
    assert cfg.state_dir == "/var/lib/nccltune"
    assert cfg.publish_dir == Path("/var/lib/nccltune")
    assert cfg.topology_file == Path("/var/lib/nccltune/ncclTopology.xml")
    assert cfg.nccl_conf is None and cfg.metrics_dir is None
    assert cfg.state_path("history.db") == Path("/var/lib/nccltune/history.db")
    b = cfg.bench
    assert (b.python, b.backend, b.engine, b.nccl_tests_dir) == (None, "auto", "torch", None)
    assert (b.min_bytes, b.max_bytes, b.factor) == (65536, 2**30, 4)
    assert (b.warmup_iters, b.iters, b.trial_timeout_s, b.nranks, b.gpus) == (5, 20, 180, None, None)
    s = cfg.sweep
    assert (s.profile, s.profiles, s.strategy) == ("balanced", {}, "staged")
    assert (s.baseline_repeats, s.finalist_repeats, s.max_finalists) == (3, 3, 3)
    assert (s.pin, s.unpin, s.variables, s.exclude) == ({}, [], {}, [])
    assert (s.min_gain_pct, s.max_regression_pct, s.async_error_handling, s.force) == (1.0, 2.0, 3, False)
    d = cfg.daemon
    assert (d.poll_interval_s, d.quiet_period_s, d.maintenance_window) == (60, 300, None)
    assert (d.verify_interval_s, d.drift_threshold_pct, d.sweep_on_start) == (86400, 5.0, True)
    assert (cfg.topology.snapshot, cfg.topology.with_nics) == (None, True)
    assert cfg.path is None and cfg.lines == {}


def test_none_and_missing_default_file_give_defaults(tmp_path: Path) -> None:
    assert load_config(None) == Config()
    assert load_config(tmp_path / "absent.yaml") == Config()
    assert load_config(tmp_path / "absent.yaml").path is None


def test_missing_file_given_explicitly_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InputError) as info:
        load_config(tmp_path / "absent.yaml", required=True)
    assert info.value.exit_code == 78
    assert "absent.yaml" in str(info.value) and "not found" in str(info.value)


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n", "~\n"])
def test_empty_file_is_the_defaults(tmp_path: Path, text: str) -> None:
    p = tmp_path / "config.yaml"
    p.write_text(text)
    cfg = load_config(p, required=True)
    assert cfg == Config()
    assert cfg.path == str(p)


def test_empty_section_is_its_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "bench:\n  # iters: 3\nsweep:\n  pin:\n"))
    assert cfg == Config()


def test_example_file_equals_the_defaults() -> None:
    cfg = load_config(EXAMPLE, required=True)
    assert cfg == Config()
    assert config_to_dict(cfg) == config_to_dict(Config())


def test_example_file_documents_every_setting() -> None:
    cfg = load_config(EXAMPLE, required=True)
    assert set(setting_names()) <= set(cfg.lines)
    lines = EXAMPLE.read_text().splitlines()
    for name in setting_names():
        # The line above each key is its one-line description.
        above = lines[cfg.lines[name] - 2].strip()
        assert above.startswith("#") and len(above) > 10, name


# ---------------------------------------------------------------------------------------------
# A full file


FULL = """\
state_dir: /srv/nccltune
publish:
  dir: out
  nccl_conf: /etc/nccl.conf
  metrics_dir: /var/lib/node_exporter
  topology_file: /etc/nccltune/topo.xml
bench:
  python: /opt/venv/bin/python
  backend: nccl
  engine: nccl-tests
  nccl_tests_dir: /opt/nccl-tests/build
  min_bytes: 8KiB
  max_bytes: 4GiB
  factor: 2
  warmup_iters: 0
  iters: 50
  trial_timeout_s: 90.5
  nranks: 4
  gpus: [0, 1, 2, 3, 4, 5, 6, 7]
sweep:
  profile: inference
  profiles:
    inference:
      64KiB: 4
      "1MiB": 2.5
      4194304: 0
  strategy: exhaustive
  baseline_repeats: 5
  finalist_repeats: 1
  max_finalists: 2
  max_final_trials: 15
  pin:
    NCCL_IB_HCA: "mlx5_0:1"
    NCCL_MIN_NCHANNELS: 16
  unpin: [TORCH_NCCL_ASYNC_ERROR_HANDLING]
  variables:
    NCCL_ALGO: [Ring, Tree]
    NCCL_NTHREADS: [256, 512]
  exclude:
    - NCCL_PROTO
  min_gain_pct: 2
  max_regression_pct: 0.5
  async_error_handling: 1
  force: true
daemon:
  poll_interval_s: 30
  quiet_period_s: 0
  maintenance_window: "22:00-04:00"
  verify_interval_s: 3600
  drift_threshold_pct: 10
  sweep_on_start: false
topology:
  snapshot: tests/fixtures/snap.json
  with_nics: false
"""


def line_in(text: str, needle: str) -> int:
    """1-based line of the first line of text that contains needle."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_full_file(tmp_path: Path) -> None:
    p = write(tmp_path, FULL)
    cfg = load_config(p, required=True)
    assert cfg.path == str(p)
    assert cfg.state_dir == "/srv/nccltune"
    assert cfg.publish_dir == Path("/srv/nccltune/out")
    assert cfg.topology_file == Path("/etc/nccltune/topo.xml")
    assert cfg.nccl_conf == Path("/etc/nccl.conf")
    assert cfg.metrics_dir == Path("/var/lib/node_exporter")
    b = cfg.bench
    assert (b.python, b.backend, b.engine) == ("/opt/venv/bin/python", "nccl", "nccl-tests")
    assert (b.min_bytes, b.max_bytes, b.factor, b.warmup_iters, b.iters) == (8192, 4 * 2**30, 2, 0, 50)
    assert (b.trial_timeout_s, b.nranks, b.gpus) == (90.5, 4, list(range(8)))
    s = cfg.sweep
    assert s.profile == "inference"
    assert s.profiles == {"inference": {65536: 4.0, 2**20: 2.5, 4194304: 0.0}}
    assert (s.strategy, s.baseline_repeats, s.finalist_repeats, s.max_finalists) == ("exhaustive", 5, 1, 2)
    # The search's final check keeps to it (sweep.strategy.final_check's max_trials).
    assert s.max_final_trials == 15 and search_settings(cfg).max_final_trials == 15
    assert s.pin == {"NCCL_IB_HCA": "mlx5_0:1", "NCCL_MIN_NCHANNELS": "16"}
    assert s.unpin == ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert s.variables == {"NCCL_ALGO": ["Ring", "Tree"], "NCCL_NTHREADS": ["256", "512"]}
    assert s.exclude == ["NCCL_PROTO"]
    assert (s.min_gain_pct, s.max_regression_pct, s.async_error_handling, s.force) == (2.0, 0.5, 1, True)
    d = cfg.daemon
    assert (d.poll_interval_s, d.quiet_period_s, d.maintenance_window) == (30, 0, "22:00-04:00")
    assert (d.verify_interval_s, d.drift_threshold_pct, d.sweep_on_start) == (3600, 10, False)
    assert cfg.topology.snapshot == "tests/fixtures/snap.json" and cfg.topology.with_nics is False
    # Lines of the entries that other checks (the sweep catalogue) report against.
    assert cfg.lines["bench.iters"] == line_in(FULL, "iters: 50")
    assert cfg.lines["sweep.pin.NCCL_IB_HCA"] == line_in(FULL, "NCCL_IB_HCA")
    assert cfg.lines["sweep.variables.NCCL_ALGO"] == line_in(FULL, "NCCL_ALGO: [Ring")
    assert cfg.lines["sweep.variables.NCCL_NTHREADS[1]"] == line_in(FULL, "NCCL_NTHREADS")
    assert cfg.lines["sweep.unpin.TORCH_NCCL_ASYNC_ERROR_HANDLING"] == line_in(FULL, "unpin:")
    assert (
        cfg.lines["sweep.exclude.NCCL_PROTO"]
        == cfg.lines["sweep.exclude[0]"]
        == line_in(FULL, "- NCCL_PROTO")
    )
    assert cfg.lines["sweep.profiles.inference.65536"] == line_in(FULL, "64KiB: 4")


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().state_dir = "/x"  # type: ignore[misc]


def test_to_dict_is_json_and_round_trips(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL))
    doc = json.loads(json.dumps(config_to_dict(cfg)))
    assert doc == config_to_dict(cfg)
    assert doc["sweep"]["profiles"]["inference"]["65536"] == 4.0
    assert config_from_dict(doc) == cfg


# ---------------------------------------------------------------------------------------------
# Faults, each with its file and line


def test_unknown_key_with_did_you_mean(tmp_path: Path) -> None:
    err = fault(tmp_path, "bench:\n  iters: 3\n  warmup_itres: 2\n")
    assert err.line == 3
    assert str(err).startswith(f"{err.path}:3: unknown key bench.warmup_itres")
    assert err.hint == "did you mean bench.warmup_iters?"


def test_unknown_key_in_the_wrong_section_points_to_the_right_one(tmp_path: Path) -> None:
    err = fault(tmp_path, "state_dir: /x\niters: 3\n")
    assert err.line == 2 and "unknown key iters" in str(err)
    assert err.hint == "did you mean bench.iters?"


def test_unknown_section(tmp_path: Path) -> None:
    err = fault(tmp_path, "\nbenhc:\n  iters: 3\n")
    assert err.line == 2 and err.hint == "did you mean bench?"


def test_duplicate_key_with_its_line(tmp_path: Path) -> None:
    err = fault(
        tmp_path,
        """\
        sweep:
          pin:
            NCCL_PROTO: Simple
            NCCL_ALGO: Ring
            NCCL_PROTO: LL
        """,
    )
    assert err.line == 5
    assert f"{err.path}:5: duplicate key sweep.pin.NCCL_PROTO (first at line 3)" in str(err)


def test_duplicate_section(tmp_path: Path) -> None:
    err = fault(tmp_path, "bench:\n  iters: 3\nbench:\n  factor: 2\n")
    assert err.line == 3 and "duplicate key bench" in str(err)


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("bench:\n  iters: many\n", 2, 'bench.iters: expected an integer, got a string ("many")'),
        ("bench:\n  iters: 2.5\n", 2, "bench.iters: expected an integer, got a number (2.5)"),
        ("bench:\n  iters: true\n", 2, "bench.iters: expected an integer, got a boolean (true)"),
        ("bench:\n  iters:\n", 2, "bench.iters: needs a value"),
        ("daemon:\n  sweep_on_start: 1\n", 2, "daemon.sweep_on_start: expected true or false"),
        ("\ndaemon:\n  poll_interval_s: soon\n", 3, "daemon.poll_interval_s: expected a number"),
        ("state_dir: [a, b]\n", 1, "state_dir: expected a string, got a list"),
        ("state_dir: ''\n", 1, "state_dir: must not be empty"),
        ("bench: 3\n", 1, "bench: expected a mapping of settings"),
        ("bench:\n  backend: ncl\n", 2, "bench.backend: expected one of auto, nccl, gloo"),
        ("sweep:\n  unpin: NCCL_ALGO\n", 2, "sweep.unpin: expected a list of variable names"),
        ("topology:\n  snapshot: yes\n", 2, "topology.snapshot: expected a string, got a boolean (yes)"),
    ],
)
def test_wrong_type(tmp_path: Path, text: str, line: int, message: str) -> None:
    err = fault(tmp_path, text)
    assert err.line == line
    assert f"{err.path}:{line}: {message}" in str(err)


def test_profile_path(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "profile:\n  path: /etc/nccltune/profile/profile.json\n"))
    assert cfg.profile.path == "/etc/nccltune/profile/profile.json"
    assert cfg.profile_path == Path("/etc/nccltune/profile/profile.json")
    assert Config().profile_path is None
    err = fault(tmp_path, "state_dir: /srv\nprofile:\n  path: profiles/a.json\n")
    assert err.line == 3 and "profile.path: must be an absolute path, got 'profiles/a.json'" in str(err)
    err = fault(tmp_path, "profile:\n  path: 7\n")
    assert err.line == 2 and "profile.path: expected a string, got an integer (7)" in str(err)
    # `profile: large` is the sweep objective written in the wrong place.
    err = fault(tmp_path, "profile: large\n")
    assert err.line == 1 and "profile: expected a mapping of settings (path)" in str(err)
    assert err.hint is not None and "sweep.profile" in err.hint
    err = fault(tmp_path, "profile:\n  pth: /x\n")
    assert "unknown key profile.pth" in str(err) and err.hint == "did you mean profile.path?"
    with pytest.raises(InputError, match="must be an absolute path"):
        with_overrides(Config(), **{"profile.path": "relative.json"})


def test_wrong_choice_suggests(tmp_path: Path) -> None:
    err = fault(tmp_path, "bench:\n  backend: ncl\n")
    assert err.hint == 'did you mean "nccl"?'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bench:\n  iters: 0\n", "bench.iters: must be at least 1, got 0"),
        ("bench:\n  factor: 1\n", "bench.factor: must be at least 2, got 1"),
        ("bench:\n  warmup_iters: -1\n", "bench.warmup_iters: must be at least 0"),
        ("bench:\n  trial_timeout_s: 0\n", "bench.trial_timeout_s: must be greater than 0"),
        ("bench:\n  trial_timeout_s: .inf\n", "bench.trial_timeout_s: must be a finite number"),
        ("bench:\n  nranks: 0\n", "bench.nranks: must be at least 1"),
        ("bench:\n  max_bytes: 32GiB\n", "bench.max_bytes: must be at most 16GiB, got 32GiB"),
        ("bench:\n  min_bytes: 0\n", "bench.min_bytes: must be at least 1"),
        ("bench:\n  gpus: [0, -1]\n", "bench.gpus[1]: must be at least 0"),
        ("sweep:\n  baseline_repeats: 1\n", "sweep.baseline_repeats: must be at least 2"),
        ("sweep:\n  async_error_handling: 4\n", "sweep.async_error_handling: must be at most 3"),
        ("daemon:\n  poll_interval_s: 0.5\n", "daemon.poll_interval_s: must be at least 1, got 0.5"),
    ],
)
def test_out_of_range(tmp_path: Path, text: str, message: str) -> None:
    err = fault(tmp_path, text)
    assert err.line == 2
    assert f"{err.path}:2: {message}" in str(err)


def test_range_error_says_why(tmp_path: Path) -> None:
    err = fault(tmp_path, "sweep:\n  baseline_repeats: 1\n")
    assert err.hint is not None and "noise" in err.hint


def test_min_bytes_above_max_bytes(tmp_path: Path) -> None:
    err = fault(tmp_path, "bench:\n  min_bytes: 1GiB\n  max_bytes: 1MiB\n")
    assert err.line == 2 and "bench.min_bytes (1GiB) is larger than bench.max_bytes (1MiB)" in str(err)


def test_nranks_above_the_gpus_listed(tmp_path: Path) -> None:
    err = fault(tmp_path, "bench:\n  gpus: [0, 1]\n  nranks: 4\n")
    assert err.line == 3


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("bench:\n  max_bytes: 1 gigabyte\n", 2),
        ("bench:\n  max_bytes: 1GB\n", 2),
        ("sweep:\n  profiles:\n    p:\n      64kb: 1\n", 4),
        ("sweep:\n  profiles:\n    p:\n      1.5B: 1\n", 4),
    ],
)
def test_bad_size_string(tmp_path: Path, text: str, line: int) -> None:
    err = fault(tmp_path, text)
    assert err.line == line and f"{err.path}:{line}:" in str(err)
    assert err.hint is not None and "64KiB" in err.hint


def test_profile_faults(tmp_path: Path) -> None:
    err = fault(tmp_path, "sweep:\n  profiles:\n    p:\n      64KiB: 1\n      65536: 2\n")
    assert err.line == 5 and "same size" in str(err) and "line 4" in str(err)
    err = fault(tmp_path, "sweep:\n  profiles:\n    p:\n      64KiB: -1\n")
    assert err.line == 4 and "sweep.profiles.p.65536: must be at least 0" in str(err)
    err = fault(tmp_path, "sweep:\n  profiles:\n    p:\n      64KiB: 0\n")
    assert "every weight is zero" in str(err)
    err = fault(tmp_path, "sweep:\n  profiles:\n    p: {}\n")
    assert err.line == 3


PER_COLLECTIVE = """\
sweep:
  profile: train
  profiles:
    train:
      all_gather: {16MiB: 2, 64MiB: 1}
      reduce_scatter:
        16MiB: 2
    inference: {64KiB: 4}
"""


def test_a_profile_may_weigh_sizes_per_collective(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, PER_COLLECTIVE), required=True)
    assert cfg.sweep.profiles == {"train": {"all_gather": {16 * 2**20: 2.0, 64 * 2**20: 1.0},
                                            "reduce_scatter": {16 * 2**20: 2.0}},
                                  "inference": {65536: 4.0}}
    assert cfg.lines["sweep.profiles.train.reduce_scatter.16777216"] == 7
    assert cfg.lines["sweep.profiles.train.all_gather"] == 5
    doc = config_to_dict(cfg)
    assert doc["sweep"]["profiles"]["train"]["all_gather"]["16777216"] == 2.0
    assert config_from_dict(doc).sweep.profiles == cfg.sweep.profiles
    assert profile_collectives(cfg.sweep.profiles["inference"]) == {"all_reduce": {65536: 4.0}}
    assert profile_collectives(cfg.sweep.profiles["train"])["reduce_scatter"] == {16 * 2**20: 2.0}


def test_per_collective_profile_faults(tmp_path: Path) -> None:
    err = fault(tmp_path, "sweep:\n  profiles:\n    p:\n      all_gathr: {1MiB: 1}\n      reduce: {1MiB: 1}\n")
    assert err.line == 4 and "sweep.profiles.p.all_gathr: 'all_gathr' is not a collective" in str(err)
    assert err.hint == 'did you mean "all_gather"?'
    err = fault(tmp_path, "sweep:\n  profiles:\n    p:\n      all_gather: {1MiB: 1}\n      64KiB: 1\n")
    assert err.line == 5 and err.hint is not None and "not both" in err.hint
    err = fault(tmp_path, "sweep:\n  profiles:\n    p:\n      all_gather: 3\n")
    assert err.line == 4 and "expected a mapping of message size: weight" in str(err)
    err = fault(tmp_path, "sweep:\n  profiles:\n    p:\n      all_gather: {1MiB: 0}\n      reduce: {2MiB: 0}\n")
    assert "every weight is zero" in str(err)
    err = fault(tmp_path, "sweep:\n  profiles:\n    p:\n      all_gather:\n        1MiB: 1\n        1mb: 2\n")
    assert err.line == 6 and "sweep.profiles.p.all_gather: '1mb' is ambiguous" in str(err)
    err = fault(tmp_path, "sweep:\n  profiles:\n    p:\n      broadcast: {1MiB: -1}\n")
    assert "sweep.profiles.p.broadcast.1048576: must be at least 0" in str(err)


@pytest.mark.parametrize(
    ("window", "message"),
    [
        ('"25:00-04:00"', "not a time of day"),
        ('"22:00-04:60"', "not a time of day"),
        ('"22:00"', "not of the form"),
        ('"10pm-4am"', "not of the form"),
        ('"04:00-04:00"', "starts and ends at the same time"),
        ("22:00", "expected a time range, got an integer (22:00)"),
    ],
)
def test_bad_window(tmp_path: Path, window: str, message: str) -> None:
    err = fault(tmp_path, f"daemon:\n  maintenance_window: {window}\n")
    assert err.line == 2 and message in str(err)
    assert err.hint is not None and "HH:MM-HH:MM" in err.hint


def test_yaml_syntax_error_line(tmp_path: Path) -> None:
    err = fault(tmp_path, "bench:\n  iters: 3\n  gpus: [0, 1\n  factor: 2\n")
    assert err.line == 4
    assert str(err).startswith(f"{err.path}:4: not valid YAML")


def test_yaml_tab_indent_error_line(tmp_path: Path) -> None:
    err = fault(tmp_path, "bench:\n  iters: 3\n\tfactor: 2\n")
    assert err.line == 3 and "not valid YAML" in str(err)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_not_a_mapping(tmp_path: Path, text: str) -> None:
    err = fault(tmp_path, text)
    assert err.line == 1 and "the top level: expected a mapping" in str(err)


@pytest.mark.parametrize(
    ("text", "line", "hint"),
    [
        ("sweep:\n  pin:\n    nccl_algo: Ring\n", 3, "did you mean NCCL_ALGO?"),
        ("sweep:\n  variables:\n    CUDA_VISIBLE_DEVICES: [0]\n", 3, None),
        ("sweep:\n  exclude: [NCCL_ALGO, NCCL-PROTO]\n", 2, None),
        ("sweep:\n  unpin:\n    - NCCL_ALGO\n    - TORCH_ALGO\n", 4, None),
    ],
)
def test_bad_variable_name(tmp_path: Path, text: str, line: int, hint: str | None) -> None:
    err = fault(tmp_path, text)
    assert err.line == line and "is not an NCCL variable name" in str(err)
    if hint:
        assert err.hint == hint


@pytest.mark.parametrize(("section", "name"), [("pin", "NCCL_COMM_ID"), ("pin", "NCCL_HOSTID"),
                                             ("variables", "NCCL_RAS_ADDR"), ("variables", "NCCL_MNNVL_UUID")])
def test_an_identity_variable_is_never_pinned_or_swept(tmp_path: Path, section: str, name: str) -> None:
    """A pin or a winning value is published: one of NCCL's identity variables never may be
    (names.unpublishable), so the config naming one is refused as it is read, with its line."""
    value = '"10.0.0.1:5000"' if section == "pin" else '["10.0.0.1:5000"]'
    err = fault(tmp_path, f"sweep:\n  {section}:\n    NCCL_ALGO: {'Ring' if section == 'pin' else '[Ring]'}\n"
                          f"    {name}: {value}\n")
    assert err.line == 4 and f"sweep.{section}.{name}: " in str(err) and "never pinned, swept or published" in str(err)
    # Unpinning one (from the calling environment) publishes nothing: that stays allowed.
    assert load_config(write(tmp_path, f"sweep:\n  unpin: [{name}]\n")).sweep.unpin == [name]


@pytest.mark.parametrize(
    ("value", "got"),
    [("1.5", "a number (1.5)"), ("true", "a boolean (true)"), ("off", "a boolean (off)"), ("null", "null")],
)
def test_pin_value_not_a_string(tmp_path: Path, value: str, got: str) -> None:
    err = fault(tmp_path, f"sweep:\n  pin:\n    NCCL_ALGO: Ring\n    NCCL_NET_GDR_LEVEL: {value}\n")
    assert err.line == 4
    assert f"sweep.pin.NCCL_NET_GDR_LEVEL: expected a string, got {got}" in str(err)


def test_float_variable_value(tmp_path: Path) -> None:
    err = fault(tmp_path, "sweep:\n  variables:\n    NCCL_ALGO:\n      - Ring\n      - 0.5\n")
    assert err.line == 5 and "sweep.variables.NCCL_ALGO[1]: expected a string" in str(err)


def test_int_pin_values_keep_their_spelling(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, "sweep:\n  pin:\n    NCCL_MIN_NCHANNELS: 08\n    NCCL_BUFFSIZE: '0x10'\n")
    )
    assert cfg.sweep.pin == {"NCCL_MIN_NCHANNELS": "08", "NCCL_BUFFSIZE": "0x10"}
    # YAML 1.1 reads an unquoted 0x10 as 16; the user meant the text, so the quotes are required.
    err = fault(tmp_path, "sweep:\n  pin:\n    NCCL_BUFFSIZE: 0x10\n")
    assert err.line == 3 and err.hint == 'put the value in quotes: "0x10"'


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("sweep:\n  pin: {NCCL_ALGO: Ring}\n  unpin: [NCCL_ALGO]\n", 3),
        ("sweep:\n  pin: {NCCL_ALGO: Ring}\n  variables: {NCCL_ALGO: [Tree]}\n", 3),
        ("sweep:\n  exclude: [NCCL_ALGO]\n  variables:\n    NCCL_ALGO: [Tree]\n", 4),
        ("sweep:\n  exclude: [NCCL_ALGO, NCCL_ALGO]\n", 2),
        ("sweep:\n  variables:\n    NCCL_ALGO: []\n", 3),
        ("sweep:\n  variables:\n    NCCL_ALGO: [Ring, Ring]\n", 3),
        ("bench:\n  gpus: [0, 0]\n", 2),
        ("bench:\n  gpus: [0]\n", 2),
    ],
)
def test_contradictions_and_repeats(tmp_path: Path, text: str, line: int) -> None:
    assert fault(tmp_path, text).line == line


def test_yaml_tricks_are_refused(tmp_path: Path) -> None:
    err = fault(tmp_path, "bench:\n  <<: {iters: 3}\n")
    assert err.line == 2 and "merge keys" in str(err)
    err = fault(tmp_path, "x: &a [*a]\n")
    assert err.line == 1 and "refers to itself" in str(err)
    err = fault(tmp_path, "bench:\n  python: !!python/name:os.system\n")
    assert err.line == 2


def test_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "config.yaml"
    p.write_bytes(b"state_dir: /x\nbench:\n  python: \xff\n")
    with pytest.raises(InputError) as info:
        load_config(p)
    assert info.value.line == 3 and info.value.exit_code == 78


def test_a_lone_surrogate_escape_is_refused_with_its_line(tmp_path: Path) -> None:
    """YAML's \\ud800 escape makes a str no UTF-8 writer can encode: refused where it is written."""
    err = fault(tmp_path, 'state_dir: /x\nbench:\n  user: "ranks\\ud800"\n')
    assert err.line == 3 and "bench.user: a lone surrogate escape" in str(err)
    err = fault(tmp_path, 'sweep:\n  pin:\n    "NCCL_ALGO\\udc00": Ring\n')
    assert err.line == 3 and "sweep.pin: the key 'NCCL_ALGO\\udc00'" in str(err)
    str(err).encode("utf-8")  # the message itself is text every stream can carry
    assert load_config(write(tmp_path, 'bench:\n  user: "r\\U0001F600"\n')).bench.user == "r\U0001F600"


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(InputError) as info:
        load_config(tmp_path)
    assert info.value.exit_code == 78


# ---------------------------------------------------------------------------------------------
# Sizes and windows


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64KiB", 65536),
        ("1GiB", 2**30),
        ("4194304", 4194304),
        ("16MiB", 16 * 2**20),
        ("16M", 16 * 2**20),
        ("1 kib", 1024),
        ("1.5KiB", 1536),
        ("1TiB", 2**40),
        ("0", 0),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "KiB", "-1", "1GB", "1.3B", "1 PiB", "0x10", "1e6"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_size_refuses_bool_and_negative() -> None:
    with pytest.raises(ValueError):
        parse_size(True)
    with pytest.raises(ValueError):
        parse_size(-1)


@pytest.mark.parametrize("size", [1, 1000, 1024, 65536, 3 * 2**20, 2**30, MAX_MESSAGE_BYTES])
def test_format_size_round_trips(size: int) -> None:
    assert parse_size(format_size(size)) == size
    assert format_size(65536) == "64KiB"


def test_window_without_wrap() -> None:
    d = DaemonConfig(maintenance_window="01:00-05:00")
    assert d.window == (dt.time(1), dt.time(5))
    assert d.in_window(dt.time(1, 0))
    assert d.in_window(dt.time(4, 59, 59))
    assert not d.in_window(dt.time(5, 0))
    assert not d.in_window(dt.time(0, 59))
    assert not d.in_window(dt.time(23, 0))


def test_window_wraps_midnight() -> None:
    d = DaemonConfig(maintenance_window="22:00-04:00")
    assert d.in_window(dt.time(22, 0))
    assert d.in_window(dt.time(23, 59))
    assert d.in_window(dt.time(0, 0))
    assert d.in_window(dt.time(3, 59))
    assert not d.in_window(dt.time(4, 0))
    assert not d.in_window(dt.time(12, 0))
    assert not d.in_window(dt.time(21, 59))
    assert d.in_window(dt.time(23, 0, tzinfo=dt.timezone.utc))


def test_window_until_midnight() -> None:
    d = DaemonConfig(maintenance_window="22:00-00:00")
    assert d.in_window(dt.time(23, 59)) and not d.in_window(dt.time(0, 0))


def test_no_window_is_always() -> None:
    assert DaemonConfig().in_window(dt.time(13, 37))


def test_window_is_normalized(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "daemon:\n  maintenance_window: ' 2:00 - 6:30 '\n"))
    assert cfg.daemon.maintenance_window == "02:00-06:30"
    assert parse_window("2:00-6:30") == (dt.time(2), dt.time(6, 30))


# ---------------------------------------------------------------------------------------------
# Command-line overrides


def test_overrides() -> None:
    cfg = with_overrides(Config(), **{"state_dir": "/tmp/x", "sweep.profile": "large"})
    assert cfg.state_dir == "/tmp/x" and cfg.sweep.profile == "large"
    assert cfg.topology_file == Path("/tmp/x/ncclTopology.xml")
    assert cfg.bench == Config().bench


def test_overrides_leave_the_original_alone() -> None:
    base = Config()
    with_overrides(base, **{"sweep.pin.NCCL_ALGO": "Ring"})
    assert base.sweep.pin == {}


def test_overrides_reach_into_mappings_and_accept_paths(tmp_path: Path) -> None:
    cfg = with_overrides(
        Config(),
        **{"sweep.pin.NCCL_ALGO": "Ring", "sweep.pin.NCCL_MIN_NCHANNELS": 4, "state_dir": tmp_path},
    )
    assert cfg.sweep.pin == {"NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "4"}
    assert cfg.state_dir == str(tmp_path)
    cfg = with_overrides(cfg, **{"bench.max_bytes": "256MiB", "daemon.maintenance_window": "1:00-2:00"})
    assert cfg.bench.max_bytes == 256 * 2**20 and cfg.daemon.maintenance_window == "01:00-02:00"
    assert with_overrides(cfg, **{"daemon.maintenance_window": None}).daemon.maintenance_window is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"bench.iter": 3}, "unknown setting bench.iter"),
        ({"bench.iters.x": 3}, "unknown setting bench.iters.x"),
        ({"bench.iters": 0}, "bench.iters: must be at least 1"),
        ({"bench.iters": "3"}, "bench.iters: expected an integer"),
        ({"bench.backend": "mpi"}, "bench.backend: expected one of"),
        ({"sweep.pin.NCCL_ALGO": 1.5}, "sweep.pin.NCCL_ALGO: expected a string"),
        ({"sweep.pin.nccl_algo": "Ring"}, "is not an NCCL variable name"),
        ({"daemon.maintenance_window": "late"}, "daemon.maintenance_window"),
        ({"bench.min_bytes": "2GiB"}, "is larger than bench.max_bytes"),
    ],
)
def test_overrides_are_validated(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(InputError) as info:
        with_overrides(Config(), **overrides)
    assert info.value.exit_code == 78
    assert info.value.path == OVERRIDE_SOURCE and info.value.line is None
    assert message in str(info.value)


def test_override_unknown_setting_suggests() -> None:
    with pytest.raises(InputError) as info:
        with_overrides(Config(), **{"sweep.backend": "nccl"})
    assert info.value.hint == "did you mean bench.backend?"


def test_overrides_keep_the_file_lines(tmp_path: Path) -> None:
    p = write(tmp_path, FULL)
    cfg = load_config(p)
    new = with_overrides(cfg, **{"bench.iters": 7, "sweep.pin": {"NCCL_BUFFSIZE": "4194304"}})
    assert new.path == str(p)
    assert new.bench.iters == 7 and new.sweep.pin == {"NCCL_BUFFSIZE": "4194304"}
    assert "bench.iters" not in new.lines and "sweep.pin.NCCL_IB_HCA" not in new.lines
    assert new.lines["bench.factor"] == cfg.lines["bench.factor"]
    algo_line = line_in(FULL, "NCCL_ALGO: [Ring")
    assert new.lines["sweep.variables.NCCL_ALGO"] == algo_line
    # A fault the override reveals in a setting from the file still names the file and line.
    with pytest.raises(InputError) as info:
        with_overrides(cfg, **{"sweep.exclude": ["NCCL_ALGO"]})
    assert info.value.path == str(p) and info.value.line == algo_line
    assert "NCCL_ALGO is in both sweep.exclude and sweep.variables" in str(info.value)


def test_parse_config_names_its_source() -> None:
    with pytest.raises(InputError) as info:
        parse_config("bench:\n  iters: 0\n", "inline.yaml")
    assert str(info.value).startswith("inline.yaml:2: bench.iters")


# -- bounded loading ------------------------------------------------------------------------------


def _bomb(levels: int = 9) -> str:
    lines = [f"l0: &l0 [{', '.join(['x'] * 9)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb())
    assert path.stat().st_size < 600
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    got = subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--plan", "--demo", "--config", str(path),
                          "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=60,
                         env=env, check=False)
    assert got.returncode == 78
    assert f"{path}:" in got.stderr and "YAML aliases are expanded" in got.stderr
    assert "Traceback" not in got.stderr


def test_deeply_nested_yaml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("sweep: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(InputError, match=str(path)):
        load_config(path, required=True)
    path.write_text("sweep:\n  pin: " + "{a: " * 100 + "x" + "}" * 100 + "\n")
    with pytest.raises(InputError, match="nested deeper than 64 levels"):
        load_config(path, required=True)


def test_a_huge_config_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text("# " + "x" * (2 << 20) + "\n")
    with pytest.raises(InputError, match="larger than 1048576 bytes"):
        load_config(path, required=True)


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_special_file_as_config_is_refused_without_hanging(tmp_path: Path, special: str) -> None:
    path = Path(special) if special.startswith("/") else tmp_path / special
    if special == "fifo":
        os.mkfifo(path)
    with pytest.raises(InputError, match="not a regular file"):
        load_config(path, required=True)
