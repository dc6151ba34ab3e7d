"""Every input kind, fed malformed, binary, huge, deep, recursive and special files.

For each case, through the real command line in its own process (forked from one interpreter
that has imported nccltune, tests/cliforks.py): the documented exit code, a message that names the
file (and line or element where there is one), no traceback, no hang (every run has a timeout) and
nothing written (the state directory is not created or changed, the working directory stays empty).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from publishing import publish_set

from nccltune.errors import EXIT_CONFIG, EXIT_USAGE
from nccltune.publish import Provenance
from nccltune.topology.source import bundled_topologies_dir
from tests.cliforks import CliForks

REPO = Path(__file__).resolve().parents[1]
SNAPSHOT = json.loads((bundled_topologies_dir() / "h200x2-nvswitch-vm.json").read_text())


def _bomb() -> str:
    lines = [f"l0: &l0 [{', '.join(['x'] * 9)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


def _snapshot(edit: Callable[[dict[str, object]], None]) -> str:
    doc = json.loads(json.dumps(SNAPSHOT))
    edit(doc)
    return json.dumps(doc)


def _dup_bus(doc: dict[str, object]) -> None:
    gpus = doc["nvml"]["gpus"]  # type: ignore[index]
    gpus[1]["bus_id"] = gpus[0]["bus_id"]


def _many_gpus(doc: dict[str, object]) -> None:
    gpus = doc["nvml"]["gpus"]  # type: ignore[index]
    doc["nvml"]["gpus"] = [dict(gpus[0], index=i, bus_id=f"0000:{i // 32 + 1:02x}:{i % 32:02x}.0")  # type: ignore[index]
                           for i in range(400)]


LAUGHS = ('<?xml version="1.0"?>\n<!DOCTYPE system [<!ENTITY a "aaaaaaaaaa">'
          + "".join(f'<!ENTITY {chr(98 + i)} "{("&" + chr(97 + i) + ";") * 10}">' for i in range(8))
          + ']>\n<system version="1">&i;</system>\n')

# What a file holds: text, bytes, or a special file ("fifo", "dir", "/dev/zero").
Content = str | bytes

CONFIG_CASES: dict[str, Content] = {
    "binary": b"\xff\xfe\x00bin\x00ary\x80",
    "huge": "# " + "x" * (2 << 20) + "\n",
    "deep": "sweep: " + "[" * 20000 + "]" * 20000 + "\n",
    "recursive": "sweep: &a [*a]\n",
    "alias-bomb": _bomb(),
    "malformed": "sweep:\n  pin: [unclosed\n",
    "fifo": "fifo",
    "dir": "dir",
    "/dev/zero": "/dev/zero",
}
SNAPSHOT_CASES: dict[str, Content] = {
    "binary": b"{\xff\xfe\x00\x80}",
    "deep": "[" * 100000 + "]" * 100000,
    "deep-object": '{"kind": "nccltune-snapshot", "a": ' + '{"a": ' * 100000 + "1" + "}" * 100001,
    "malformed": '{"kind": "nccltune-snapshot",\n "nvml": }',
    "duplicate-bus-id": _snapshot(_dup_bus),
    "400-gpus": _snapshot(_many_gpus),
    "fifo": "fifo",
    "dir": "dir",
    "/dev/zero": "/dev/zero",
}
XML_CASES: dict[str, Content] = {
    "binary": b"<system \xff\xfe\x00\x80>",
    "huge": "<system>" + "<!-- " + "x" * (5 << 20) + " -->" + "</system>\n",
    "deep": "<system>" + "<cpu>" * 5000 + "</cpu>" * 5000 + "</system>\n",
    "entity-expansion": LAUGHS,
    "malformed": '<system version="1">\n  <cpu numaid="0">\n</system>\n',
}


def _make(path: Path, content: Content) -> Path:
    if content == "fifo":
        os.mkfifo(path)
    elif content == "dir":
        path.mkdir()
    elif content == "/dev/zero":
        return Path("/dev/zero")
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


@dataclass
class Run:
    rc: int
    out: str
    err: str


_FORKS: list[CliForks] = []  # the module's one fork server, while its tests run
# What the commands here import as they run (the sweep's plan, the store, the topology readers,
# the published files' readers), imported once by the server.
PRELOAD = ("nccltune.pipeline", "nccltune.store", "nccltune.report.sweep", "nccltune.report.nccltests_json",
           "nccltune.topology.diff", "nccltune.topology.ncclxml", "nccltune.delivery.jobenv", "nccltune.afterrun",
           "nccltune.trials.runner", "lxml.etree")


@pytest.fixture(scope="module", autouse=True)
def cli_forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliForks]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}
    env["PYTHONPATH"] = str(REPO)
    forks = CliForks(env, tmp_path_factory.mktemp("cliforks"), preload=PRELOAD)
    _FORKS.append(forks)
    try:
        yield forks
    finally:
        _FORKS.remove(forks)
        forks.close()


def nccltune(cwd: Path, *args: str | Path) -> Run:
    (forks,) = _FORKS
    return Run(*forks.run(cwd, [str(a) for a in args], timeout_s=120))


def assert_refused(run: Run, rc: int, names: str | Path) -> None:
    assert run.rc == rc, run.err
    assert str(names) in run.err, run.err
    # Log lines may come first (a WARNING that the ranks would run as root on a node without the
    # rank user); the error is the first line that is not one.
    said = [line for line in run.err.splitlines() if " WARNING " not in line and " INFO " not in line]
    assert "Traceback" not in run.err and said and said[0].startswith("nccltune: error: "), run.err


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "in").mkdir()
    (tmp_path / "cwd").mkdir()
    return tmp_path


def assert_nothing_written(work: Path) -> None:
    assert not (work / "state").exists()
    assert list((work / "cwd").iterdir()) == []


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config(work: Path, case: str) -> None:
    path = _make(work / "in" / "config.yaml", CONFIG_CASES[case])
    run = nccltune(work / "cwd", "sweep", "--plan", "--demo", "--config", path, "--state-dir", work / "state")
    assert_refused(run, EXIT_CONFIG, path)
    if case in ("malformed", "recursive", "alias-bomb", "binary"):
        assert f"{path}:" in run.err  # with a line
    assert_nothing_written(work)


@pytest.mark.parametrize("case", list(SNAPSHOT_CASES))
@pytest.mark.parametrize("command", ["topo", "diff", "plan"])
def test_snapshot(work: Path, case: str, command: str) -> None:
    path = _make(work / "in" / "snap.json", SNAPSHOT_CASES[case])
    args: tuple[str | Path, ...] = {
        "topo": ("topo", "--input", path),
        "diff": ("topo", "diff", bundled_topologies_dir() / "h200x2-nvswitch-vm.json", path),
        "plan": ("sweep", "--plan", "--demo", path, "--state-dir", work / "state"),
    }[command]
    run = nccltune(work / "cwd", *args)
    assert_refused(run, EXIT_CONFIG, path)
    if case == "malformed":
        assert f"{path}:2:" in run.err
    if case == "duplicate-bus-id":
        assert "nvml.gpus[1].bus_id" in run.err
    assert_nothing_written(work)


@pytest.mark.parametrize("case", list(XML_CASES))
def test_nccl_xml(work: Path, case: str) -> None:
    path = _make(work / "in" / "topo.xml", XML_CASES[case])
    for args in (("topo", "--input", path), ("topo", "diff", path, path)):
        run = nccltune(work / "cwd", *args)
        assert_refused(run, EXIT_CONFIG, path)
    assert_nothing_written(work)


# The nccl-tests document `nccltune import` reads: the JSON cases of the snapshot, as that file.
NCCL_TESTS_CASES = {k: v for k, v in SNAPSHOT_CASES.items() if k not in ("duplicate-bus-id", "400-gpus")}


@pytest.mark.parametrize("case", list(NCCL_TESTS_CASES))
def test_nccl_tests_document(work: Path, case: str) -> None:
    path = _make(work / "in" / "all_reduce_perf.json", NCCL_TESTS_CASES[case])
    run = nccltune(work / "cwd", "import", path, "--state-dir", work / "state")
    assert_refused(run, EXIT_CONFIG, path)
    if case == "malformed":
        assert f"{path}:2:" in run.err
    assert_nothing_written(work)


def _prov() -> Provenance:
    return Provenance("0", "now", "f", None, "gloo", True, None)


PUBLISHED_CASES: dict[str, tuple[str, Content]] = {
    "sh-appended-command": ("nccl.sh", "APPEND:touch /tmp/x\n"),
    "sh-binary": ("nccl.sh", b"\xff\xfe\x00"),
    "env-forged-line": ("nccl.env", "APPEND:NCCL_ALGO=$(id)\n"),
    "json-binary": ("nccl.json", b"\xff\xfe\x00"),
    "json-deep": ("nccl.json", "[" * 100000 + "]" * 100000),
    "json-huge": ("nccl.json", " " * (2 << 20)),
    "json-fifo": ("nccl.json", "fifo"),
    "json-dir": ("nccl.json", "dir"),
    "json-symlink": ("nccl.json", "symlink"),
}


@pytest.mark.parametrize("case", list(PUBLISHED_CASES))
def test_published_files(work: Path, case: str) -> None:
    state = work / "pub"
    publish_set(state, {"NCCL_ALGO": "Ring"}, _prov())
    name, content = PUBLISHED_CASES[case]
    target = state / "generations" / "1" / name
    if isinstance(content, str) and content.startswith("APPEND:"):
        with open(target, "a") as fh:
            fh.write(content[len("APPEND:"):])
    else:
        target.unlink()
        if content == "symlink":
            target.symlink_to("/etc/hostname")
        else:
            _make(target, content)
    before = sorted(str(p) for p in state.rglob("*"))
    for args in (("env", "--state-dir", state), ("env", "--format", "json", "--state-dir", state),
                 ("exec", "--state-dir", state, "--", "true")):
        run = nccltune(work / "cwd", *args)
        # The failure policy (docs/launch-failures.md): exec runs the command untuned, with its status.
        assert run.rc == (0 if args[0] == "exec" else EXIT_CONFIG), (args, run.err)
        assert str(state / "generations" / "1") in run.err and "Traceback" not in run.err
        if args[0] == "exec":
            assert "runs untuned" in run.err and run.out == "", run.err
        elif args[:2] == ("env", "--state-dir"):
            # What a job would eval (docs/launch-failures.md): a comment and the untuned marker only.
            *comments, last = run.out.splitlines()
            assert last == "export NCCLTUNE_APPLIED='untuned:refused'" and comments, run.out
            assert all(line.startswith("#") for line in comments) and "NCCL_ALGO" not in run.out, run.out
        else:
            assert run.out == ""
    assert sorted(str(p) for p in state.rglob("*")) == before
    assert list((work / "cwd").iterdir()) == []


CLI_CASES: list[tuple[tuple[str, ...], int, str]] = [
    (("history", "--limit", "-5"), EXIT_USAGE, "--limit"),
    (("history", "--limit", "ten"), EXIT_USAGE, "--limit"),
    (("report", "--run", "x"), EXIT_USAGE, "--run"),
    (("sweep", "--plan", "--demo", "--unpin", "NCCL_ALGOO"), EXIT_USAGE, "NCCL_ALGOO"),
    (("sweep", "--plan", "--demo", "--unpin", "$(id)\n"), EXIT_USAGE, "--unpin $(id)\\n"),
    (("sweep", "--demo", "--python", "/"), EXIT_CONFIG, "/ is a directory"),
    (("sweep", "--demo", "--python", "NOEXEC"), EXIT_CONFIG, "is not executable"),
    (("sweep", "--plan", "--demo", "no-such-snapshot.json"), EXIT_CONFIG, "no-such-snapshot.json"),
    (("topo", "--input", "/dev/null/x"), EXIT_CONFIG, "/dev/null/x"),
    (("exec", "--", "/no/such/command"), 127, "/no/such/command"),
]


@pytest.mark.parametrize(("args", "rc", "named"), CLI_CASES)
def test_cli_values(work: Path, args: tuple[str, ...], rc: int, named: str) -> None:
    noexec = work / "in" / "noexec.py"
    noexec.write_text("print('ran')\n")
    noexec.chmod(0o644)
    args = tuple(str(noexec) if a == "NOEXEC" else a for a in args)
    run = nccltune(work / "cwd", *args, *(("--state-dir", work / "state") if args[0] != "topo" else ()))
    assert run.rc == rc, run.err
    assert named in run.err and "Traceback" not in run.err
    assert_nothing_written(work)


def test_sweep_exclude_typo_names_its_line(work: Path) -> None:
    path = work / "in" / "config.yaml"
    path.write_text("sweep:\n  exclude:\n    - NCCL_PROTO\n    - NCCL_PROTOO\n")
    run = nccltune(work / "cwd", "sweep", "--plan", "--demo", "--config", path, "--state-dir", work / "state")
    assert_refused(run, EXIT_CONFIG, f"{path}:4")
    assert "did you mean NCCL_PROTO?" in run.err
    assert_nothing_written(work)


def test_python_that_cannot_be_executed_is_exit_78(work: Path) -> None:
    bogus = work / "in" / "bogus"
    bogus.write_bytes(b"\x00\x01not an executable\n")
    bogus.chmod(0o755)
    run = nccltune(work / "cwd", "sweep", "--demo", "--python", bogus, "--state-dir", work / "state")
    assert_refused(run, EXIT_CONFIG, bogus)
    assert "cannot be run: Exec format error" in run.err
