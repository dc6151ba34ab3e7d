"""The command line folds every flag with a config twin into the Config once (cli.load_cfg)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nccltune.cli import build_parser, load_cfg
from nccltune.config import Config
from nccltune.errors import InputError


def _cfg(tmp_path: Path, text: str, *flags: str, command: str = "sweep") -> Config:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    args = build_parser().parse_args([command, "--config", str(config), "--state-dir", str(tmp_path), *flags])
    return load_cfg(args)


def test_sweep_flags_become_their_settings(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "sweep:\n  unpin: [NCCL_BUFFSIZE]\n", "--profile", "large", "--exhaustive", "--force",
               "--python", "/opt/env/bin/python", "--unpin", "NCCL_ALGO", "--unpin", "NCCL_ALGO",
               "--unpin", "NCCL_BUFFSIZE")
    s = cfg.sweep
    assert (s.profile, s.strategy, s.force) == ("large", "exhaustive", True)
    assert s.unpin == ["NCCL_BUFFSIZE", "NCCL_ALGO"]
    assert cfg.bench.python == "/opt/env/bin/python"


def test_without_flags_the_file_decides(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "sweep:\n  profile: small\n  strategy: staged\n")
    s = cfg.sweep
    assert (s.profile, s.strategy, s.force, s.unpin) == ("small", "staged", False, [])
    assert cfg.bench.python is None


def test_unpin_frees_a_variable_the_config_pins(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "sweep:\n  pin:\n    NCCL_ALGO: Ring\n    NCCL_PROTO: LL\n", "--unpin", "NCCL_ALGO")
    s = cfg.sweep
    assert s.pin == {"NCCL_PROTO": "LL"} and s.unpin == ["NCCL_ALGO"]


def test_verify_force_is_not_the_sweep_setting(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "", "--force", "--python", "/opt/env/bin/python", command="verify")
    assert cfg.sweep.force is False
    assert cfg.bench.python == "/opt/env/bin/python"


def test_a_flag_the_config_would_refuse_names_the_command_line(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="command line"):
        _cfg(tmp_path, "", "--unpin", "not-a-variable")


# -- `--demo [SNAPSHOT]` before an action or a positional -------------------------------------------


@pytest.mark.parametrize(("argv", "action", "field", "value"), [
    (["topo", "--demo", "record", "out.json"], "record", "out", "out.json"),
    (["topo", "--demo", "check", "t.xml"], "check", "xml", "t.xml"),
    (["topo", "--demo", "diff", "a.json", "b.json"], "diff", "b", "b.json"),
])
def test_topo_demo_before_an_action_is_the_bundled_node(argv: list[str], action: str, field: str,
                                                        value: str) -> None:
    args = build_parser().parse_args(argv)
    assert (args.demo, args.topo_command, getattr(args, field)) == (True, action, value)


def test_topo_demo_still_takes_a_snapshot() -> None:
    assert build_parser().parse_args(["topo", "--demo", "node.json"]).demo == "node.json"
    assert build_parser().parse_args(["topo", "--demo", "node.json", "record", "o.json"]).demo == "node.json"
    assert build_parser().parse_args(["topo", "--demo"]).demo is True


def test_topo_demo_diff_runs_the_action(capsys: pytest.CaptureFixture[str]) -> None:
    from nccltune.cli import main

    assert main(["topo", "--demo", "diff", "h200x2-nvswitch-vm", "h200x2-nvswitch-vm", "--json"]) == 0
    assert '"kind"' in capsys.readouterr().out


@pytest.mark.parametrize("command", ["sweep", "daemon", "doctor", "verify", "export"])
def test_demo_of_a_command_without_positionals_takes_the_snapshot(command: str) -> None:
    """Nothing positional follows these commands' --demo: the word after it is the snapshot."""
    parser = build_parser()
    assert parser.parse_args([command, "--demo", "node.json"]).demo == "node.json"
    assert parser.parse_args([command, "--demo"]).demo is True


def test_apply_demo_then_the_profile_is_the_profile() -> None:
    from nccltune.cli.publish_cmds import profile_and_demo

    assert profile_and_demo(build_parser().parse_args(["apply", "--demo", "class.json"])) == (Path("class.json"), True)
    assert profile_and_demo(build_parser().parse_args(["apply", "class.json", "--demo", "node.json"])) == \
        (Path("class.json"), "node.json")
