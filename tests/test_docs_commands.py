"""Every command in the docs is checked: each `sh` block of README.md and docs/*.md (pages added
later included) is read as the shell would split it; every `nccltune ...` command line must parse
with nccltune's own parser, every script of this repository it names must exist, and the lines
that can run on a CPU machine run, in order per page, against a copy of the shared CPU-demo state.

A line is only parsed when running it here would need what a test box lacks; `_why_not_run` says
which and why for each: GPUs or NCCL (a real sweep, verify, `topo check`, `topo record`), root and
systemd (install, uninstall, daemon), several nodes (`--nodes`, `--join`, srun), a real node's
files (absolute paths such as /var/lib/nccltune or /shared/...), or runs of a node's own history
(`--run ID`, `compare A B`), or files only such a line writes. A line whose comment says it exits
N (`# exit 1, ...`, `# exits 69: ...`) must exit N; any other must exit 0, or 1 for a check that
found something. Lines without an nccltune command (bash bringup.sh, scontrol, pip) are not
nccltune's to run: their script paths are checked. Every link between the pages must resolve, to a
heading where it names one, and the index and the guide link every page.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO
from demo_state import DemoSweep, clean_env

from nccltune.cli.parser import build_parser
from nccltune.errors import UsageError

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\s*$")
SHELL_LANGS = {"sh", "bash", "shell"}
OPERATORS = set("();<>|&\n")  # a newline ends a command as ; does
# Directories of this repository a command may name a script or file in.
REPO_DIRS = ("bench/", "tests/", "launchers/", ".ci/", "monitoring/", "deploy/", "systemd/", "examples/",
             "schemas/", "topologies/", "docs/")
# Commands whose exit 1 is a finding, not a failure (docs: commands.md, exit codes).
CHECKS = {("doctor", None), ("compare", None), ("verify", None), ("topo", "diff")}
# A line's own word on how it exits, in its comment: `# exit 1, they differ`, `# exits 69: ...`.
SAYS_EXIT = re.compile(r"#.*?\bexits? (\d+)\b")
# The runs a page's commands may name: the demo's sweep, and the import a page's earlier line stores.
DEMO_RUNS = {1, 2}


@dataclass(frozen=True)
class Line:
    page: Path
    lineno: int
    text: str

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.lineno}: {self.text}"


def shell_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number of the block's first line, the block's text dedented) of each sh/bash fence."""
    blocks: list[tuple[int, str]] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.relative_to(REPO)}:{i + 1}: a code block that is never closed"
        if m["lang"] in SHELL_LANGS:
            blocks.append((i + 2, textwrap.dedent("\n".join(lines[i + 1:end]))))
        i = end + 1
    return blocks


def logical_lines(page: Path) -> list[Line]:
    """The shell's command lines of a page: continued lines joined, a quote left open carried on."""
    out: list[Line] = []
    for first, block in shell_blocks(page):
        pending, start = "", first
        for offset, raw in enumerate(block.splitlines()):
            if not pending:
                start = first + offset
            pending = f"{pending}\n{raw}" if pending else raw
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            try:
                words(pending)
            except ValueError:  # an open quote: the command goes on on the next line
                continue
            if pending.strip():
                out.append(Line(page, start, pending))
            pending = ""
        assert not pending, f"{page.relative_to(REPO)}:{start}: a quote never closed: {pending!r}"
    return out


def words(text: str) -> list[str]:
    # shlex takes a comment's newline with it: doubled, one is left to end the command.
    lexer = shlex.shlex(text.replace("\n", "\n\n"), posix=True, punctuation_chars="();<>|&\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def simple_commands(text: str) -> list[list[str]]:
    """The simple commands of a command line (split at ; && | ( ) and redirections, assignments
    before a command dropped), and those of every command substitution or script argument in it."""
    commands: list[list[str]] = [[]]
    assigned: list[list[str]] = []  # what an assignment's $(...) runs
    skip_next = False
    for token in words(text):
        if skip_next:
            skip_next = False
            continue
        if set(token) <= OPERATORS:
            skip_next = token.startswith((">", "<")) and token not in ("<(", ">(")
            commands.append([])
            continue
        if not commands[-1] and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", token):
            value = token.split("=", 1)[1]
            if "$(" in value:
                assigned.extend(simple_commands(value.replace("$(", "(")))
            continue
        commands[-1].append(token)
    nested = [cmd for command in commands for token in command[1:]
              if "$(" in token or ("nccltune " in token and "\n" in token)
              for cmd in simple_commands(token.replace("$(", "("))]
    # A command another one starts (pdsh -w NODES nccltune ..., sudo nccltune ...).
    started = [command[command.index("nccltune"):] for command in commands if "nccltune" in command[1:]]
    return [c for c in commands if c] + started + assigned + nested


def is_nccltune(argv: list[str]) -> bool:
    return argv[0] == "nccltune" or argv[0].endswith("/bin/nccltune")


def repo_paths(argv: list[str]) -> list[str]:
    """The files of this repository a command names (scripts, rules, launchers)."""
    named = [t for t in argv if t.startswith(REPO_DIRS) or t.startswith(tuple("./" + d for d in REPO_DIRS))]
    script = re.compile(r"[\w./-]+\.(sh|py)|[\w./-]+/run")
    if argv[0] in ("bash", "sh", "python", "python3") and len(argv) > 1 and script.fullmatch(argv[1]):
        named.append(argv[1])
    return sorted(set(named))


def parse(argv: list[str], line: Line) -> argparse.Namespace:
    try:
        return build_parser().parse_args(argv[1:])
    except UsageError as e:
        pytest.fail(f"{line.where()}\n  nccltune's parser refuses {shlex.join(argv)}: {e}")
    except SystemExit as e:  # --help, --version
        pytest.fail(f"{line.where()}\n  {shlex.join(argv)} exits {e.code} instead of running")


def _why_not_run(argv: list[str], ns: argparse.Namespace) -> str | None:
    """Why a parsed nccltune command line is not run here, or None where it runs on the CPU demo."""
    command = ns.command
    if command == "daemon":
        return "the systemd service: runs until stopped"
    if command in ("install", "uninstall"):
        return "writes /etc and the units, runs systemctl (root, systemd)"
    if command == "verify":
        return "times collectives with the published setting on the node's GPUs"
    if command == "sweep":
        if ns.nodes > 1 or ns.join or ns.launcher == "srun":
            return "several nodes (torchrun rendezvous, --join, or an srun allocation)"
        if ns.loopback:
            return "RDMA NICs"
        if not ns.plan:
            return "measures on the node's GPUs (the demo sweep this test's state comes from is one)"
        if not ns.demo:
            return "plans for the node's GPUs (NVML)"
    if command == "topo" and ns.topo_command == "check":
        return "runs NCCL on the node's GPUs"
    if command == "topo" and ns.topo_command == "record":
        return "reads the node's NVML"
    if command == "topo" and ns.topo_command is None and ns.demo is None and ns.input is None:
        return "reads the node's NVML (without it, shows the demo's recording and exits 69)"
    if command in ("export", "apply") and ns.demo is None:
        return "reads the node's NVML for its class (--demo takes the demo's recorded node)"
    if command == "doctor" and not (ns.demo or ns.input):
        return "reads the node's NVML (doctor --demo reads the demo's recorded node)"
    if command == "keygen" and not ns.path:
        return "writes root's /etc/nccltune/multinode.key"
    if command == "exec":
        started = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
        if not started or shutil.which(started[0]) is None:
            return f"starts {shlex.join(started)}, which is not installed here"
    runs = {getattr(ns, name, None) for name in ("run", "baseline")} - {None}
    if command == "compare":
        runs |= {ns.a, ns.b}
    if not runs <= DEMO_RUNS:
        return "names runs of a node's own history"
    for word in argv[1:]:
        if word.startswith("/") and not word.startswith("/tmp/"):
            return f"names a real node's files ({word})"
        if "*" in word or "$" in word:
            return f"names files of a real fleet ({word})"
    return None


def nccltune_lines(page: Path) -> list[tuple[Line, list[list[str]]]]:
    return [(line, [c for c in simple_commands(line.text) if is_nccltune(c)]) for line in logical_lines(page)]


def written(ns: argparse.Namespace) -> set[str]:
    """What a command line writes that a later line of its page may read: its `--out` file, and the
    directory that file is in."""
    out = getattr(ns, "out", None)
    if not out:
        return set()
    parent = os.path.dirname(out)
    return {out, parent, parent + "/"} - {"", "/"}


def allowed_exits(line: Line, parsed: list[argparse.Namespace]) -> set[int]:
    """The exit statuses a line may end with: the one its comment says, else 0 (and 1 for a check)."""
    said = SAYS_EXIT.search(line.text)
    if said:
        return {int(said[1])}
    return {0, 1} if {(ns.command, getattr(ns, "topo_command", None)) for ns in parsed} & CHECKS else {0}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_command_parses_and_every_script_exists(page: Path) -> None:
    for line in logical_lines(page):
        for argv in simple_commands(line.text):
            for path in repo_paths(argv):
                assert list(REPO.glob(path.removeprefix("./"))), f"{line.where()}\n  {path} is not in the repository"
            if is_nccltune(argv):
                parse(argv, line)


def test_the_parser_refuses_what_the_check_must_catch() -> None:
    # The check above means something only if the parser refuses a command line the docs could get wrong.
    line = Line(REPO / "README.md", 1, "nccltune sweep --plann")
    with pytest.raises(pytest.fail.Exception, match="refuses"):
        parse(["nccltune", "sweep", "--plann"], line)
    found = simple_commands('eval "$(nccltune env)" && x=$(nccltune history) ; nccltune report > a.json')
    assert sorted(c for c in found if is_nccltune(c)) == [
        ["nccltune", "env"], ["nccltune", "history"], ["nccltune", "report"]]


def _wrapper(bin_dir: Path, demo: DemoSweep, state: Path) -> None:
    """A `nccltune` on PATH that runs this checkout's with the copied demo state and config, given
    right after the command's own words (a command's options come after its name); `topo` gets
    the config only, and finds the demo's recorded node from ./nccltune-demo as after bringup.sh."""
    two_level = {"topo": {"record", "check", "diff"}, "fleet": {"decide", "status"}}
    script = bin_dir / "nccltune"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        from nccltune.cli import main
        args = sys.argv[1:]
        at = 1 if args and args[0] != "-q" else 2
        if len(args) > at and args[at - 1] in {two_level!r} and args[at] in {two_level!r}[args[at - 1]]:
            at += 1
        given = ["--config", {str(demo.config)!r}]
        if args[at - 1:at] != ["topo"]:
            given += ["--state-dir", {str(state)!r}]
        sys.argv[1:] = [*args[:at], *given, *args[at:]]
        sys.exit(main(sys.argv[1:]))
        """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_commands_that_can_run_on_a_cpu_run(page: Path, demo_sweep: DemoSweep, tmp_path: Path) -> None:
    # The state where bringup.sh's demo leaves it: `nccltune topo` without NVML shows the node
    # that ./nccltune-demo was measured on.
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    state = work / "nccltune-demo"
    shutil.copytree(demo_sweep.state, state, symlinks=True)
    _wrapper(bin_dir, demo_sweep, state)
    for name in REPO_DIRS:  # a page names the repository's files as from its root
        if (REPO / name).is_dir():
            (work / name.rstrip("/")).symlink_to(REPO / name)
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    ran: list[str] = []
    not_here: set[str] = set()  # what the lines not run would have written
    for line, commands in nccltune_lines(page):
        if not commands or any(not is_nccltune(c) for c in simple_commands(line.text)):
            continue  # not nccltune's alone: parsed and path-checked above
        parsed = [parse(argv, line) for argv in commands]
        reads_not_here = any(word in not_here for argv in commands for word in argv[1:])
        if reads_not_here or any(_why_not_run(argv, ns) for argv, ns in zip(commands, parsed, strict=True)):
            not_here.update(*(written(ns) for ns in parsed))
            continue
        text = line.text.replace(" /tmp/", f" {work}/")
        before = set(work.iterdir())
        got = subprocess.run(["bash", "-c", text], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        allowed = allowed_exits(line, parsed)
        assert got.returncode in allowed and "Traceback" not in got.stderr, (
            f"{line.where()}\n  exit {got.returncode}\n{got.stderr[-3000:]}")
        wrote = [p for p in set(work.iterdir()) - before if p.stat().st_size]
        assert got.stdout.strip() or got.stderr.strip() or wrote, f"{line.where()}\n  printed and wrote nothing"
        ran.append(line.text)
    if page.name == "README.md" and page.parent == REPO:
        assert len(ran) >= 5, ran  # the quick start runs, not only parses


def test_what_is_not_run_says_why() -> None:
    reasons = {}
    for page in PAGES:
        for line, commands in nccltune_lines(page):
            for argv in commands:
                reasons[shlex.join(argv)] = _why_not_run(argv, parse(argv, line))
    assert reasons.get("nccltune sweep", "").startswith("measures on the node's GPUs"), reasons
    assert reasons.get("nccltune install") and reasons.get("nccltune history") is None, reasons
    assert "exits 69" in reasons.get("nccltune topo", "") and reasons.get("nccltune topo --demo") is None, reasons


def test_a_line_says_how_it_exits() -> None:
    ns = [build_parser().parse_args(["doctor", "--demo"])]
    assert allowed_exits(Line(REPO / "README.md", 1, "nccltune doctor --demo"), ns) == {0, 1}
    assert allowed_exits(Line(REPO / "README.md", 1, "nccltune env --format env   # exits 1: nothing"), ns) == {1}
    assert written(build_parser().parse_args(["export", "--out", "profiles/x.json"])) == {
        "profiles/x.json", "profiles", "profiles/"}


SLUG_DROP = re.compile(r"[^\w\- ]")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    heads = [m[1] for m in re.finditer(r"^#+\s+(.*)$", page.read_text(), re.M)]
    return {SLUG_DROP.sub("", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_link_between_pages_resolves(page: Path) -> None:
    for m in re.finditer(r"\]\(([^)\s]+)\)", page.read_text()):
        target = m[1]
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.relative_to(REPO)}: {target}"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{page.relative_to(REPO)}: no heading for #{anchor} in {file or page.name}"


def test_the_index_and_the_guide_link_every_page() -> None:
    index = (REPO / "docs" / "README.md").read_text()
    guide = (REPO / "README.md").read_text()
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert {p for p in pages if f"]({p})" not in index} == set()
    assert {p for p in pages if f"](docs/{p}" not in guide} == set()


def test_the_runbook_has_every_alert() -> None:
    rules = (REPO / "monitoring" / "prometheus" / "nccltune.rules.yml").read_text()
    alerts = set(re.findall(r"^\s*- alert: (\w+)", rules, re.M))
    runbook = (REPO / "docs" / "runbook.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", runbook, re.M))
    assert len(alerts) >= 16 and rows == alerts, (alerts - rows, rows - alerts)
