"""The published set as readers see it: never mixed, never edited, never from an untrusted file.

Real publishes, real processes killed with SIGKILL and SIGTERM in the middle of a publish, the
real CLI (`nccltune env`, `exec`, `doctor`) and the real launchers reading the result.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from publishing import publish_set

from nccltune.errors import EXIT_CONFIG, InputError, NccltuneError
from nccltune.publish import Provenance, read_published, read_set
from nccltune.publish.applied import set_digest

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534


def prov(**kw: object) -> Provenance:
    fields: dict[str, object] = dict(nccltune_version="0", created_at="2026-01-01T00:00:00+00:00",
                                     topology_fingerprint="f", nccl_version=None, backend="gloo", demo=True,
                                     profile=None)
    fields.update(kw)
    return Provenance(**fields)  # type: ignore[arg-type]


def cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "nccltune", *args[:1], "--state-dir", str(state), *args[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)


def two_generations(state: Path) -> None:
    publish_set(state, {"NCCL_ALGO": "Ring"}, prov())
    publish_set(state, {"NCCL_ALGO": "Tree"}, prov())


# -- one unit --------------------------------------------------------------------------------------


def test_mixed_set_is_refused_by_env_exec_and_doctor(tmp_path: Path) -> None:
    state = tmp_path / "state"
    two_generations(state)
    # What the old per-file renames left after a kill: nccl.env of another generation.
    shutil.copy(state / "generations" / "1" / "nccl.env", state / "generations" / "2" / "nccl.env")
    # Nothing of a mixed set reaches a job (docs/launch-failures.md): env prints only the untuned
    # marker and exits 78; exec runs the command untuned.
    for args, code in ((("env", "--format", "env"), EXIT_CONFIG), (("env", "--format", "sh"), EXIT_CONFIG),
                       (("exec", "--", "true"), 0)):
        got = cli(state, *args)
        assert got.returncode == code, (args, got.stderr)
        assert "mixed" in got.stderr and "nccl.env" in got.stderr and "runs untuned" in got.stderr
        assert "NCCL_" not in got.stdout and "Traceback" not in got.stderr
    got = cli(state, "doctor", "--demo", "--json")
    doc = json.loads(got.stdout)
    assert "published-mixed" in {f["code"] for f in doc["findings"]}


def test_an_appended_command_never_comes_out_of_env(tmp_path: Path) -> None:
    state = tmp_path / "state"
    publish_set(state, {"NCCL_ALGO": "Ring"}, prov())
    sh = state / "generations" / "1" / "nccl.sh"
    with open(sh, "a") as fh:
        fh.write("touch /tmp/nccltune-owned\n")
    got = cli(state, "env")
    assert got.returncode == EXIT_CONFIG
    assert f"{sh}:" in got.stderr and "not a line nccltune writes" in got.stderr
    assert "touch" not in got.stdout


def test_every_file_ends_with_the_marker_of_the_set_and_what_it_sets(tmp_path: Path) -> None:
    state = tmp_path / "state"
    files = publish_set(state, {"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, prov(),
                    single_node_env={"NCCL_MIN_NCHANNELS": "32"})
    got = read_set(state)
    assert got is not None and got.set_id == files.set_id
    assert got.set_id == f"1:{set_digest((state / 'nccl.json').read_bytes())}"
    every = f"{got.set_id}:NCCL_ALGO,TORCH_NCCL_ASYNC_ERROR_HANDLING"
    assert (state / "nccl.sh").read_text().splitlines()[-1] == f"export NCCLTUNE_APPLIED='{every}'"
    assert (state / "nccl.env").read_text().splitlines()[-1] == f"NCCLTUNE_APPLIED={every}"
    # The single-node files are loaded after the every-job ones: their marker names both parts.
    assert (state / "nccl-single-node.env").read_text().splitlines()[-1] == \
        f"NCCLTUNE_APPLIED={every},NCCL_MIN_NCHANNELS"
    assert "NCCLTUNE_APPLIED" not in got.env and "NCCLTUNE_APPLIED" not in got.single_node_env
    assert "NCCLTUNE_APPLIED" not in json.loads((state / "nccl.json").read_text())["env"]


@pytest.mark.parametrize("edit", [
    ("NCCL_ALGO'", "NCCL_ALGO,NCCL_PROTO'"),  # names a variable the file does not set
    ("'1:", "'2:"),  # names another generation
])
def test_a_marker_that_is_not_the_sets_own_is_an_edited_set(tmp_path: Path, edit: tuple[str, str]) -> None:
    state = tmp_path / "state"
    publish_set(state, {"NCCL_ALGO": "Ring"}, prov())
    sh = state / "generations" / "1" / "nccl.sh"
    sh.write_text(sh.read_text().replace(*edit))
    with pytest.raises(InputError, match="NCCLTUNE_APPLIED is not the marker of this set"):
        read_set(state)


@pytest.mark.parametrize("char", ["\t", "\x1b", "\x7f", "\u200b", "\u202e", "\ue000"])
def test_a_comment_with_a_control_or_format_character_is_an_edited_set(tmp_path: Path, char: str) -> None:
    state = tmp_path / "state"
    publish_set(state, {"NCCL_ALGO": "Ring"}, prov())
    sh = state / "generations" / "1" / "nccl.sh"
    sh.write_text(f"# réglé\u00a0à la main{char}\n" + sh.read_text())
    with pytest.raises(InputError, match="a comment holds a control character"):
        read_set(state)


def test_a_comment_of_printable_characters_and_spaces_of_any_script_is_read(tmp_path: Path) -> None:
    state = tmp_path / "state"
    publish_set(state, {"NCCL_ALGO": "Ring"}, prov())
    sh = state / "generations" / "1" / "nccl.sh"
    sh.write_text("# réglé\u00a0à la main\u3000調整済み\n" + sh.read_text())
    got = read_set(state)
    assert got is not None and got.env == {"NCCL_ALGO": "Ring"}


def test_a_set_without_markers_is_read_as_it_was(tmp_path: Path) -> None:
    """A set published before the marker existed has none: read as it was, no marker to check."""
    state = tmp_path / "state"
    publish_set(state, {"NCCL_ALGO": "Ring"}, prov())
    for name in ("nccl.sh", "nccl.env", "nccl-single-node.sh", "nccl-single-node.env"):
        path = state / "generations" / "1" / name
        path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                                if "NCCLTUNE_APPLIED" not in line))
    got = read_set(state)
    assert got is not None and got.env == {"NCCL_ALGO": "Ring"}


# -- the parts by node count ---------------------------------------------------------------------

NODES = {2: {"NCCL_ALGO": "Tree"}, 4: {"NCCL_PROTO": "Simple"}}


def test_the_parts_by_node_count_are_files_of_the_set_each_with_its_marker(tmp_path: Path) -> None:
    state = tmp_path / "state"
    files = publish_set(state, {"NCCL_IB_HCA": "mlx5_0"}, prov(), single_node_env={"NCCL_ALGO": "Ring"},
                        nodes_env=NODES)
    got = read_set(state)
    assert got is not None and got.nodes_env == files.nodes_env == NODES
    assert got.parts == {1: {"NCCL_ALGO": "Ring"}, **NODES}
    gen = state / "current"
    assert "# node counts: 2 4" in (gen / "nccl.sh").read_text().splitlines()
    # Loaded after the every-job files: the marker names both parts, as the single-node files' does.
    assert (gen / "nccl-nodes-2.sh").read_text().splitlines()[-2:] == [
        "export NCCL_ALGO='Tree'", f"export NCCLTUNE_APPLIED='{got.set_id}:NCCL_IB_HCA,NCCL_ALGO'"]
    assert (gen / "nccl-nodes-4.env").read_text().splitlines()[-1] == \
        f"NCCLTUNE_APPLIED={got.set_id}:NCCL_IB_HCA,NCCL_PROTO"
    assert "# scope: nodes_4: only jobs known to run on 4 nodes or more" in (gen / "nccl-nodes-4.env").read_text()
    doc = json.loads((gen / "nccl.json").read_text())
    assert doc["nodes_env"] == {"2": NODES[2], "4": NODES[4]}
    assert [doc["scopes"][f"nodes_{n}"]["applies_to"].split(" (")[0] for n in (2, 4)] == [
        "only jobs known to run on 2 to 3 nodes", "only jobs known to run on 4 nodes or more"]
    assert not os.path.lexists(state / "nccl-nodes-2.sh")  # no link beside nccl.sh: the counts change
    # A set without them is as it always was: no key, no header line.
    publish_set(state, {"NCCL_IB_HCA": "mlx5_0"}, prov())
    plain = read_set(state)
    assert plain is not None and plain.nodes_env == {} and "nodes_env" not in json.loads(plain.texts["nccl.json"])
    assert "# node counts" not in plain.texts["nccl.sh"]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda g: (g / "nccl-nodes-4.sh").unlink(), "cannot read"),
    (lambda g: (g / "nccl-nodes-2.env").write_text((g / "nccl-nodes-2.env").read_text().replace("Tree", "Ring")),
     "does not hold the variables of nccl.json"),
    (lambda g: (g / "nccl.env").write_text((g / "nccl.env").read_text().replace("counts: 2 4", "counts: 2")),
     "the parts by node count it lists are not nccl.json's"),
    (lambda g: (g / "nccl.sh").write_text((g / "nccl.sh").read_text().replace("# node counts: 2 4\n", "")),
     "the parts by node count it lists are not nccl.json's"),
])
def test_a_missing_or_edited_part_by_node_count_refuses_the_set(tmp_path: Path, edit: object, message: str) -> None:
    state = tmp_path / "state"
    publish_set(state, {"NCCL_IB_HCA": "mlx5_0"}, prov(), nodes_env=NODES)
    edit(state / "generations" / "1")  # type: ignore[operator]
    with pytest.raises(NccltuneError, match=message):  # as a missing or edited single-node file
        read_set(state)


@pytest.mark.parametrize(("nodes", "message"), [
    ({1: {"NCCL_ALGO": "Tree"}}, "node count 1: a part by node count is for 2 to 100000 nodes"),
    ({True: {"NCCL_ALGO": "Tree"}}, "node count True"),
    ({2: {"NCCL_IB_HCA": "mlx5_1"}}, "2-node environment: NCCL_IB_HCA: also in the part for every job"),
    ({2: {"NCCL_TOPO_FILE": "/x.xml"}}, "NCCL_TOPO_FILE: files, plugins and the job's shape belong"),
    ({2: {"NCCL_HOSTID": "a"}}, "2-node environment: NCCL_HOSTID"),
    ({2: {"NCCL_ALGO": "a b"}}, "NCCL_ALGO: value contains the forbidden character"),
    ({n: {} for n in range(2, 67)}, "65 parts by node count; a set holds at most 64"),
])
def test_a_part_by_node_count_is_checked_like_the_others(tmp_path: Path, nodes: dict[int, dict[str, str]],
                                                         message: str) -> None:
    state = tmp_path / "state"
    with pytest.raises(InputError, match=message) as exc:
        publish_set(state, {"NCCL_IB_HCA": "mlx5_0"}, prov(), nodes_env=nodes)
    assert exc.value.exit_code == EXIT_CONFIG and read_set(state) is None


@pytest.mark.parametrize(("mode", "word"), [(0o666, "world-writable"), (0o664, "group-writable")])
def test_env_and_exec_refuse_a_writable_published_file(tmp_path: Path, mode: int, word: str) -> None:
    state = tmp_path / "state"
    publish_set(state, {"NCCL_ALGO": "Ring"}, prov())
    (state / "generations" / "1" / "nccl.json").chmod(mode)
    for args, code in ((("env",), EXIT_CONFIG), (("exec", "--", "true"), 0)):
        got = cli(state, *args)
        assert got.returncode == code and word in got.stderr and "runs untuned" in got.stderr, got.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_env_and_exec_refuse_a_file_owned_by_another_user(tmp_path: Path) -> None:
    state = tmp_path / "state"
    publish_set(state, {"NCCL_ALGO": "Ring"}, prov())
    os.chown(state / "generations" / "1" / "nccl.sh", NOBODY, NOBODY)
    got = cli(state, "env")
    assert got.returncode == EXIT_CONFIG and f"uid {NOBODY}" in got.stderr
    ran = cli(state, "exec", "--", "true")
    assert ran.returncode == 0 and f"uid {NOBODY}" in ran.stderr and "runs untuned" in ran.stderr


def test_topology_file_is_part_of_the_set_and_outlives_the_next_publish(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = publish_set(state, {"NCCL_ALGO": "Ring", "NCCL_TOPO_FILE": "/x.xml"}, prov(), topology_xml="<system/>\n")
    assert first.topology_path == state / "generations" / "1" / "ncclTopology.xml"
    env, _ = read_published(state)  # type: ignore[misc]
    assert env["NCCL_TOPO_FILE"] == str(first.topology_path)
    publish_set(state, {"NCCL_ALGO": "Tree"}, prov())
    assert first.topology_path.read_text() == "<system/>\n"  # a job started on generation 1 keeps it


def test_old_generations_are_pruned_but_numbers_never_repeat(tmp_path: Path) -> None:
    state = tmp_path / "state"
    for _ in range(7):
        last = publish_set(state, {"NCCL_ALGO": "Ring"}, prov())
    assert last.generation == 7
    assert sorted(int(n) for n in os.listdir(state / "generations") if n.isdigit()) == [4, 5, 6, 7]
    shutil.rmtree(state / "generations" / "7")
    os.unlink(state / "current")
    os.symlink("generations/6", state / "current")
    assert publish_set(state, {"NCCL_ALGO": "Ring"}, prov()).generation == 8


def test_a_regular_file_layout_is_taken_over(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "nccl.json").write_text(json.dumps({"schema_version": 1, "env": {"NCCL_ALGO": "Ring"},
                                                 "provenance": {"generation": 41}}))
    assert publish_set(state, {"NCCL_ALGO": "Tree"}, prov()).generation == 42
    assert os.readlink(state / "nccl.json") == "current/nccl.json"


_PUBLISHER = """
import os, sys, time
from pathlib import Path
from nccltune import publish as pub
from nccltune.config import Config
state = Path(sys.argv[1])
node = Config(state_dir=str(state))
real_replace, real_rename = os.replace, os.rename
def slow(fn):
    def run(a, b, *k):
        time.sleep(0.01)
        return fn(a, b, *k)
    return run
os.replace, os.rename = slow(real_replace), slow(real_rename)
prov = pub.Provenance('0', 'now', 'f', None, 'gloo', True, None)
n = 0
while True:
    n += 1
    pub.publish_setting(node, pub.Setting({'NCCL_ALGO': 'Ring', 'NCCL_BUFFSIZE': str(1000 + n)}, prov))
    print(n, flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_publisher_killed_mid_publish_never_leaves_a_mixed_set(tmp_path: Path, sig: signal.Signals) -> None:
    """Publishes in a loop with the renames slowed down, killed at many points; after each kill the
    set reads back whole, with every file of one generation, and the next number is new."""
    state = tmp_path / "state"
    publish_set(state, {"NCCL_ALGO": "Ring", "NCCL_BUFFSIZE": "1000"}, prov())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    seen = 1
    for delay_ms in (5, 12, 23, 31, 47, 58, 66, 79):
        proc = subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(state)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        proc.stdout.readline()  # it has published at least once: the loop is running
        time.sleep(delay_ms / 1000)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        got = read_set(state)
        assert got is not None
        assert got.generation > seen - 1
        gens = {line for text in (got.texts["nccl.sh"], got.texts["nccl.env"]) for line in text.splitlines()
                if line.startswith("# generation: ")}
        assert gens == {f"# generation: {got.generation}"}
        assert got.env["NCCL_BUFFSIZE"] == json.loads(got.texts["nccl.json"])["env"]["NCCL_BUFFSIZE"]
        nxt = publish_set(state, {"NCCL_ALGO": "Ring", "NCCL_BUFFSIZE": "1000"}, prov())
        assert nxt.generation > got.generation
        seen = nxt.generation
        listing = os.listdir(state)
        assert not [n for n in listing if ".tmp-" in n], listing
        assert not [n for n in os.listdir(state / "generations") if ".tmp-" in n]


def test_read_set_without_current_reads_nothing(tmp_path: Path) -> None:
    assert read_set(tmp_path) is None
    (tmp_path / "current").symlink_to("/etc")
    with pytest.raises(InputError, match="current"):
        read_set(tmp_path)
