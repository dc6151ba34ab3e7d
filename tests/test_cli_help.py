"""Every subcommand explains itself: a description, an example, help for every option; typos get a hint."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from nccltune.cli import build_parser, main


def walk(parser: argparse.ArgumentParser, path: str = "nccltune") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += walk(child, f"{path} {name}")
    return found


PARSERS = walk(build_parser())


def test_the_walk_sees_every_command() -> None:
    names = {path for path, _ in PARSERS}
    assert {"nccltune topo diff", "nccltune install", "nccltune fleet decide", "nccltune history"} <= names


@pytest.mark.parametrize(("path", "parser"), PARSERS[1:], ids=[p for p, _ in PARSERS[1:]])
def test_every_subcommand_has_a_description_and_an_example(path: str, parser: argparse.ArgumentParser) -> None:
    assert parser.description, f"{path} has no description"
    assert parser.epilog and f"\n  {path} " in parser.epilog + " ", f"{path} --help shows no example of itself"


@pytest.mark.parametrize(("path", "parser"), PARSERS, ids=[p for p, _ in PARSERS])
def test_every_option_has_help(path: str, parser: argparse.ArgumentParser) -> None:
    missing = [a.option_strings or a.dest for a in parser._actions
               if not isinstance(a, argparse._SubParsersAction) and not a.help]
    assert not missing, f"{path}: options without help text: {missing}"


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_a_mistyped_subcommand_gets_one_suggestion_and_exit_2() -> None:
    rc, _out, err = run("histroy")
    assert rc == 2
    assert err.count("did you mean") == 1 and "did you mean `nccltune history`?" in err
    rc, _out, err = run("topo", "dif", "a", "b")
    assert rc == 2 and "did you mean `nccltune topo diff`?" in err
    rc, _out, err = run("zzzzzz")
    assert rc == 2 and "did you mean" not in err


def test_quiet_is_accepted_before_and_after_the_command(tmp_path: object) -> None:
    parser = build_parser()
    assert parser.parse_args(["--quiet", "history"]).quiet is True
    assert parser.parse_args(["history", "-q"]).quiet is True
    assert parser.parse_args(["history"]).quiet is False


def test_help_shows_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["install", "--help"])
    assert exc.value.code == 0
    assert "example:\n  nccltune install --dry-run" in capsys.readouterr().out
