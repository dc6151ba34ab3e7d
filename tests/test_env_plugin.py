"""nccltune's NCCL env plugin, built with the system C compiler and driven through ctypes as NCCL
2.28 drives it (init with NCCL's version, getEnv for each variable, finalize), and its env file as
nccltune renders it."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from publishing import publish_set

from nccltune.errors import InputError
from nccltune.publish import Provenance, Tuner, read_set
from nccltune.tuner.build import ENV_LIBRARY_NAME, build_env_plugin
from nccltune.tuner.envfile import EnvValue, env_values, parse_env_file, render_env_file

INIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint8, ctypes.c_uint8, ctypes.c_uint8, ctypes.c_char_p)
FINALIZE = ctypes.CFUNCTYPE(ctypes.c_int)
GET_ENV = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_char_p)


class EnvV1(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", INIT), ("finalize", FINALIZE), ("getEnv", GET_ENV)]


# Two sections, three versions: 2.28.9 and 2.27.9 are in the file, 2.31.0 is not.
VALUES = env_values({
    "2.28.9": {"all": {"NCCL_MIN_NCHANNELS": "16"}, "single": {"NCCL_P2P_LEVEL": "NVL"},
               "multi": {"NCCL_P2P_LEVEL": "SYS", "NCCL_IB_QPS_PER_CONNECTION": "4"}},
    "2.27.9": {"all": {"NCCL_MIN_NCHANNELS": "8"}},
})
SHAPE_VARS = ("NCCLTUNE_JOB_NNODES", "SLURM_JOB_NUM_NODES", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE",
              "OMPI_COMM_WORLD_LOCAL_SIZE")
TUNED = ("NCCL_MIN_NCHANNELS", "NCCL_P2P_LEVEL", "NCCL_IB_QPS_PER_CONNECTION")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> EnvV1:
    result = build_env_plugin(tmp_path_factory.mktemp("env"))  # CI has a C compiler: none is a failure
    assert result.ok and result.path is not None, result.message
    assert result.path.name == ENV_LIBRARY_NAME
    return EnvV1.in_dll(ctypes.CDLL(str(result.path)), "ncclEnvPlugin_v1")


@pytest.fixture
def env_file(tmp_path: Path) -> Path:
    path = tmp_path / "env-plugin.txt"
    path.write_text(render_env_file(VALUES), encoding="ascii")
    tmp_path.chmod(0o755)
    return path


@contextmanager
def job(**env: str | None) -> Iterator[None]:
    """The job's environment for one init: the shape variables and the tuned names unset unless given."""
    names = {*SHAPE_VARS, *TUNED, "NCCLTUNE_ENV_TABLE", "NCCL_DEBUG", *env}
    saved = {k: os.environ.get(k) for k in names}
    try:
        for k in names:
            value = env.get(k)
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def answers(plugin: EnvV1, version: tuple[int, int, int], names: tuple[str, ...] = TUNED,
            **env: str | None) -> dict[str, str | None]:
    """init under `version` in a job of `env`, then getEnv for each name, then finalize."""
    with job(**env):
        assert plugin.init(*version, b"") == 0
        try:
            got = {n: plugin.getEnv(n.encode()) for n in names}
        finally:
            assert plugin.finalize() == 0
    return {n: v.decode() if v is not None else None for n, v in got.items()}


def test_exports_v1_named_nccltune(plugin: EnvV1) -> None:
    assert plugin.name == b"nccltune"


@pytest.mark.parametrize(("version", "expected"), [
    ((2, 28, 9), {"NCCL_MIN_NCHANNELS": "16", "NCCL_P2P_LEVEL": "SYS", "NCCL_IB_QPS_PER_CONNECTION": "4"}),
    ((2, 27, 9), {"NCCL_MIN_NCHANNELS": "8", "NCCL_P2P_LEVEL": None, "NCCL_IB_QPS_PER_CONNECTION": None}),
    ((2, 31, 0), {"NCCL_MIN_NCHANNELS": None, "NCCL_P2P_LEVEL": None, "NCCL_IB_QPS_PER_CONNECTION": None}),
])
def test_three_versions_get_their_own_section_or_none(plugin: EnvV1, env_file: Path, version: tuple[int, int, int],
                                                      expected: dict[str, str | None]) -> None:
    assert answers(plugin, version, NCCLTUNE_ENV_TABLE=str(env_file), NCCLTUNE_JOB_NNODES="2") == expected


def test_the_jobs_value_wins_and_unknown_names_are_unset(plugin: EnvV1, env_file: Path) -> None:
    got = answers(plugin, (2, 28, 9), (*TUNED, "NCCL_SOCKET_IFNAME", "NCCL_NO_SUCH_THING"),
                  NCCLTUNE_ENV_TABLE=str(env_file), NCCLTUNE_JOB_NNODES="1", NCCL_MIN_NCHANNELS="2",
                  NCCL_SOCKET_IFNAME="eth0")
    assert got == {"NCCL_MIN_NCHANNELS": "2",  # the job's own value over the tuned 16
                   "NCCL_P2P_LEVEL": "NVL",  # single node
                   "NCCL_IB_QPS_PER_CONNECTION": None,  # multi-node only
                   "NCCL_SOCKET_IFNAME": "eth0",  # not tuned: the environment's answer
                   "NCCL_NO_SUCH_THING": None}


@pytest.mark.parametrize(("shape", "p2p"), [
    ({"NCCLTUNE_JOB_NNODES": "1", "SLURM_JOB_NUM_NODES": "4"}, "NVL"),  # nccltune's launcher first
    ({"SLURM_JOB_NUM_NODES": "4"}, "SYS"),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, "SYS"),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, "NVL"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "SYS"),
    ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, None),  # uneven: shape unknown, scope all only
    ({"NCCLTUNE_JOB_NNODES": "0"}, None),
    ({"NCCLTUNE_JOB_NNODES": "two"}, None),
    ({}, None),
])
def test_the_job_shape_picks_single_or_multi(plugin: EnvV1, env_file: Path, shape: dict[str, str],
                                             p2p: str | None) -> None:
    got = answers(plugin, (2, 28, 9), NCCLTUNE_ENV_TABLE=str(env_file), **shape)  # type: ignore[arg-type]
    assert got["NCCL_P2P_LEVEL"] == p2p
    assert got["NCCL_MIN_NCHANNELS"] == "16"  # scope all: whatever the shape


def test_debug_lines_say_what_was_loaded_and_answered(plugin: EnvV1, env_file: Path,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    answers(plugin, (2, 28, 9), NCCLTUNE_ENV_TABLE=str(env_file), NCCLTUNE_JOB_NNODES="2", NCCL_DEBUG="INFO",
            NCCL_MIN_NCHANNELS="2")
    err = capfd.readouterr().err
    assert f"NCCL INFO nccltune env: env file {env_file}: NCCL 2.28.9 section, a job of 2 nodes " \
           "(NCCLTUNE_JOB_NNODES): 3 tuned variables" in err
    assert "NCCL_P2P_LEVEL=SYS (tuned, multi)" in err
    assert "NCCL_MIN_NCHANNELS=2 from the job's environment (the job's value wins over the tuned 16)" in err
    answers(plugin, (2, 28, 9), NCCLTUNE_ENV_TABLE=str(env_file), NCCLTUNE_JOB_NNODES="2")
    assert capfd.readouterr().err == ""  # without NCCL_DEBUG=INFO the plugin says nothing


def test_no_file_variable_or_no_section_answers_from_the_environment(plugin: EnvV1, env_file: Path,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    assert answers(plugin, (2, 28, 9), NCCL_DEBUG="INFO", NCCL_P2P_LEVEL="LOC")["NCCL_P2P_LEVEL"] == "LOC"
    assert "no env file (NCCLTUNE_ENV_TABLE is not set)" in capfd.readouterr().err
    answers(plugin, (2, 31, 0), NCCLTUNE_ENV_TABLE=str(env_file), NCCL_DEBUG="INFO")
    assert f"env file {env_file} has no section for NCCL 2.31.0" in capfd.readouterr().err


@pytest.mark.parametrize(("edit", "why"), [
    (lambda t: t.replace("end 5", "end 4"), ":11 is malformed (the 'end' line counts 4 values, the file has 5)"),
    (lambda t: t.replace("nccl 2.28.9", "nccl 2.28"), ":2 is malformed (expected 'nccl <major.minor.patch>'"),
    (lambda t: t.replace("NCCL_P2P_LEVEL NVL", "NCCL_TUNER_PLUGIN /tmp/x.so"), ":5 is malformed ('NCCL_TUNER_PLUGIN'"),
    (lambda t: t.replace("NCCL_P2P_LEVEL NVL", "NCCL_TOPO_FILE /tmp/x"), ":5 is malformed ('NCCL_TOPO_FILE'"),
    (lambda t: t.replace("single NCCL_P2P_LEVEL", "all NCCL_P2P_LEVEL"), ":6 is malformed (NCCL_P2P_LEVEL is "
     "already given on line 5"),
    (lambda t: t.replace("multi NCCL_IB", "multi nccl_ib"), ":7 is malformed ('nccl_ib"),
    (lambda t: t[:-1], " is malformed (truncated: the file does not end with a newline)"),
    (lambda t: t.replace("nccltune-env-table 1", "nccltune-env-table 2"), ":1 is malformed (not a nccltune env file"),
])
def test_a_malformed_file_answers_nothing(plugin: EnvV1, env_file: Path, capfd: pytest.CaptureFixture[str],
                                          edit: object, why: str) -> None:
    text = edit(render_env_file(VALUES))  # type: ignore[operator]
    env_file.write_text(text)
    got = answers(plugin, (2, 28, 9), NCCLTUNE_ENV_TABLE=str(env_file), NCCLTUNE_JOB_NNODES="2", NCCL_DEBUG="INFO")
    assert got == dict.fromkeys(TUNED)
    assert f"env file {env_file}{why}" in capfd.readouterr().err
    with pytest.raises(InputError):  # nccltune's own parser refuses it too
        parse_env_file(text, str(env_file))


def test_an_untrusted_file_answers_nothing(plugin: EnvV1, env_file: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run = {"NCCLTUNE_ENV_TABLE": str(env_file), "NCCLTUNE_JOB_NNODES": "2", "NCCL_DEBUG": "INFO"}
    env_file.chmod(0o664)
    assert answers(plugin, (2, 28, 9), **run) == dict.fromkeys(TUNED)
    assert "not used (the file is writable by group or others)" in capfd.readouterr().err
    env_file.chmod(0o644)
    env_file.parent.chmod(0o777)
    assert answers(plugin, (2, 28, 9), **run) == dict.fromkeys(TUNED)
    assert "is writable by group or others" in capfd.readouterr().err
    env_file.parent.chmod(0o755)
    link = env_file.with_name("link.txt")
    link.symlink_to(env_file)
    assert answers(plugin, (2, 28, 9), **{**run, "NCCLTUNE_ENV_TABLE": str(link)}) == dict.fromkeys(TUNED)
    assert "not used (cannot open" in capfd.readouterr().err  # O_NOFOLLOW: a link is never followed
    if os.geteuid() == 0:
        os.chown(env_file, 65534, 65534)
        assert answers(plugin, (2, 28, 9), **run) == dict.fromkeys(TUNED)
        assert "not used (the file is owned by another user)" in capfd.readouterr().err
        os.chown(env_file, 0, 0)
    assert answers(plugin, (2, 28, 9), **run)["NCCL_P2P_LEVEL"] == "SYS"  # trusted again: answered


def test_render_and_parse_agree_and_refuse_what_the_plugin_refuses() -> None:
    text = render_env_file(VALUES)
    assert text.splitlines()[0] == "nccltune-env-table 1" and text.endswith("end 5\n")
    assert parse_env_file(text, "f") == VALUES
    for bad, fragment in ((EnvValue("2.28", "all", "NCCL_A", "1"), "not major.minor.patch"),
                          (EnvValue("2.28.9", "some", "NCCL_A", "1"), "unknown scope"),
                          (EnvValue("2.28.9", "all", "NCCL_NET_PLUGIN", "x"), "not a variable"),
                          (EnvValue("2.28.9", "all", "NCCL_A", "a b"), "not one token"),
                          (EnvValue("2.28.9", "all", "NCCL_A", "a#b"), "not one token")):
        with pytest.raises(ValueError, match=fragment):
            render_env_file((bad,))
    with pytest.raises(ValueError, match="already given"):
        render_env_file((EnvValue("2.28.9", "all", "NCCL_A", "1"), EnvValue("2.28.9", "multi", "NCCL_A", "2")))
    with pytest.raises(InputError, match=r":3: value before the first 'nccl <version>'"):
        parse_env_file("nccltune-env-table 1\n# x\nall NCCL_A 1\nend 1\n", "f")


def _prov() -> Provenance:
    return Provenance(nccltune_version="0", created_at="now", topology_fingerprint="f", nccl_version="2.28.9",
                      backend="nccl", demo=False, profile=None, tuning_fingerprint="abc123")


def test_publishing_names_the_env_plugin_only_with_its_file(plugin: EnvV1, tmp_path: Path) -> None:
    built = build_env_plugin(tmp_path / "built")
    assert built.ok and built.path is not None
    text = render_env_file(VALUES)
    publish_set(tmp_path / "s", {}, _prov(), tuner=Tuner(plugin=b"\x7fELF tuner", table_text="t\n",
                                                     env_plugin=built.path, env_text=text))
    gen = tmp_path / "s" / "generations" / "1"
    got = read_set(tmp_path / "s")
    assert got is not None
    assert got.env["NCCL_ENV_PLUGIN"] == str(gen / ENV_LIBRARY_NAME)
    assert got.env["NCCLTUNE_ENV_TABLE"] == str(gen / "env-plugin.txt")
    assert (gen / "env-plugin.txt").read_text() == text
    # What a job gets loads: the published plugin answers from the published file.
    published = EnvV1.in_dll(ctypes.CDLL(got.env["NCCL_ENV_PLUGIN"]), "ncclEnvPlugin_v1")
    assert answers(published, (2, 28, 9), NCCLTUNE_ENV_TABLE=got.env["NCCLTUNE_ENV_TABLE"],
                   NCCLTUNE_JOB_NNODES="1")["NCCL_P2P_LEVEL"] == "NVL"
    # Without the file, no NCCL_ENV_PLUGIN: the tuner alone is published.
    publish_set(tmp_path / "t", {}, _prov(), tuner=Tuner(plugin=b"\x7fELF tuner", table_text="t\n",
                                                     env_plugin=built.path))
    alone = read_set(tmp_path / "t")
    assert alone is not None and "NCCL_ENV_PLUGIN" not in alone.env and "NCCLTUNE_ENV_TABLE" not in alone.env
    # And nobody else may set them: they name files only the publisher writes.
    with pytest.raises(InputError, match="NCCL_ENV_PLUGIN"):
        publish_set(tmp_path / "u", {"NCCL_ENV_PLUGIN": "/tmp/other.so"}, _prov())
