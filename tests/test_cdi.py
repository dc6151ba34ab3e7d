"""The CDI spec for Kubernetes pods: written with every publish, read and applied by the CDI library
that container runtimes use (tests/cdi/check.go over Debian's packaged container-device-interface,
its built-in JSON schema check on; built by .ci/install-cdi-check), checked against CDI's naming
rules, replaced atomically, and naming only the generation's own files. What a pod then runs with,
through the CDI device and the torchrun wrapper, follows the one precedence rule."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from nccltune.config import Config, PublishConfig
from nccltune.errors import InputError
from nccltune.publish import Provenance, Setting, publish_setting, read_set
from nccltune.publish.applied import APPLIED_VAR
from nccltune.publish.cdi import CDI_VERSION, KIND, SPEC_NAME, check_spec, render_spec

EVERY = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_IB_HCA": "^mlx5_2"}
SINGLE = {"NCCL_MIN_NCHANNELS": "32"}
WRAPPER = REPO / "launchers" / "nccltune-torchrun"
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="the launchers trust only root-owned files")


@pytest.fixture(scope="module")
def cdi_check() -> Path:
    """The checker built against the CDI library (installed with apt-get where missing)."""
    got = subprocess.run(["bash", str(REPO / ".ci" / "install-cdi-check")], capture_output=True, text=True,
                         timeout=900, check=False)
    if got.returncode != 0:
        why = (got.stderr.strip().splitlines() or ["no output"])[-1]
        if os.environ.get("CI"):
            pytest.fail(f"CI must check the CDI spec with the CDI library: {why}")
        pytest.skip(f"the CDI library is not available here: {why}")
    return Path(got.stdout.strip().splitlines()[-1])


def cdi_read(check: Path, spec_dir: Path, *devices: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """What the CDI library makes of `spec_dir`: its devices, its errors, and for each device asked
    for, the container's env (a dict) and mounts after the runtime applied it to a container whose
    own env is `env`."""
    stdin = json.dumps([f"{k}={v}" for k, v in (env or {}).items()])
    got = subprocess.run([str(check), str(spec_dir), *(f"{KIND}={d}" for d in devices)], input=stdin,
                         capture_output=True, text=True, timeout=60, check=True)
    doc: dict[str, Any] = json.loads(got.stdout)
    for name, result in doc["injected"].items():
        assert not result.get("error"), (name, result["error"])
        result["env"] = dict(entry.split("=", 1) for entry in result["env"] or [])
    return doc


def prov() -> Provenance:
    return Provenance(nccltune_version="0", created_at="now", topology_fingerprint="f", nccl_version=None,
                      backend="nccl", demo=False, profile=None)


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    tmp_path.chmod(0o755)
    return Config(state_dir=str(tmp_path / "state"), publish=PublishConfig(cdi_dir=str(tmp_path / "cdi")))


def publish_once(cfg: Config, every: dict[str, str] = EVERY) -> None:
    publish_setting(cfg, Setting(every, prov(), SINGLE, "<system version=\"1\"/>\n"))


def marker(cfg: Config, name: str) -> dict[str, str]:
    """The marker line of a published file, as a variable: what a device must carry with that part."""
    [line] = [line for line in (cfg.publish_dir / name).read_text().splitlines() if line.startswith(APPLIED_VAR)]
    key, _, value = line.partition("=")
    return {key: value}


def spec_of(cfg: Config) -> dict[str, Any]:
    assert cfg.cdi_dir is not None
    doc: dict[str, Any] = json.loads((cfg.cdi_dir / SPEC_NAME).read_text())
    return doc


def test_every_publish_writes_a_spec_the_cdi_library_accepts(cfg: Config, cdi_check: Path) -> None:
    publish_once(cfg)
    spec = spec_of(cfg)
    check_spec(spec)
    assert spec["cdiVersion"] == CDI_VERSION == "0.4.0" and spec["kind"] == KIND == "nccltune.io/tuning"
    assert "annotations" not in spec  # a 0.6.0 feature: runtimes with an older CDI library refuse the spec
    assert cfg.cdi_dir is not None
    doc = cdi_read(cdi_check, cfg.cdi_dir)
    assert doc["errors"] == {}
    assert doc["devices"] == [f"{KIND}={name}" for name in ("every-job", "files", "single-node")]


def test_a_runtime_gives_each_device_its_env_and_the_generation_read_only(cfg: Config, cdi_check: Path) -> None:
    publish_once(cfg)
    got = read_set(cfg.publish_dir)
    assert got is not None and cfg.cdi_dir is not None
    gen = cfg.publish_dir / "generations" / "1"
    doc = cdi_read(cdi_check, cfg.cdi_dir, "every-job", "single-node", "files", env={"PATH": "/usr/bin"})
    injected = doc["injected"]
    assert injected[f"{KIND}=every-job"]["env"] == {"PATH": "/usr/bin", **got.env, **marker(cfg, "nccl.env")}
    assert injected[f"{KIND}=single-node"]["env"] == {"PATH": "/usr/bin", **got.env, **got.single_node_env,
                                                       **marker(cfg, "nccl-single-node.env")}
    assert injected[f"{KIND}=files"]["env"] == {"PATH": "/usr/bin", "NCCLTUNE_ENV_FILE": str(gen / "nccl.sh")}
    for result in injected.values():
        assert result["mounts"] == [{"source": str(gen), "destination": str(gen), "type": "bind",
                                     "options": ["ro", "nosuid", "nodev", "bind"]}]


def test_a_broken_spec_is_refused_by_the_cdi_library_naming_its_file(cfg: Config, cdi_check: Path,
                                                                        tmp_path: Path) -> None:
    spec = render_spec(tmp_path, EVERY, SINGLE)
    spec["devices"][0]["containerEdits"]["mounts"][0].pop("hostPath")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / SPEC_NAME).write_text(json.dumps(spec))
    doc = cdi_read(cdi_check, broken)
    assert list(doc["errors"]) == [str(broken / SPEC_NAME)] and doc["devices"] in (None, [])


@requires_root
@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_a_pod_through_the_files_device_and_the_wrapper_follows_the_precedence_rule(
        cfg: Config, cdi_check: Path, tmp_path: Path, shell: str) -> None:
    """CDI env replaces a variable the pod sets itself (the library's rule), which is why a pod that
    sets its own values requests `files` and starts through the wrapper: then its own value is kept,
    the rest is added, and NCCLTUNE_DISABLE=1 applies nothing."""
    publish_once(cfg)
    got = read_set(cfg.publish_dir)
    assert got is not None and cfg.cdi_dir is not None
    pod = {"PATH": os.environ["PATH"], "NCCL_IB_HCA": "^mlx5_9"}
    doc = cdi_read(cdi_check, cfg.cdi_dir, "every-job", "files", env=pod)
    assert doc["injected"][f"{KIND}=every-job"]["env"]["NCCL_IB_HCA"] == "^mlx5_2"  # the pod's own value lost
    container = doc["injected"][f"{KIND}=files"]["env"]
    assert container["NCCL_IB_HCA"] == "^mlx5_9"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "torchrun").write_text("#!/bin/sh\nexec env -0\n")
    (bindir / "torchrun").chmod(0o755)

    def job(**extra: str) -> dict[str, str]:
        env = {**container, "PATH": f"{bindir}{os.pathsep}{container['PATH']}", **extra}
        out = subprocess.run([shell, str(WRAPPER), "--standalone", "train.py"], env=env, capture_output=True,
                             timeout=60, check=True).stdout
        pairs = (item.decode().partition("=") for item in out.split(b"\0") if item)
        return {n: v for n, _, v in pairs if n.startswith(("NCCL_", "TORCH_NCCL_")) or n == APPLIED_VAR}

    ran = job()
    assert ran["NCCL_IB_HCA"] == "^mlx5_9"
    assert ran["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and ran["NCCL_MIN_NCHANNELS"] == "32"
    # The marker names what the wrapper added, not the pod's own value.
    assert ran[APPLIED_VAR] == f"{got.set_id}:NCCL_TOPO_FILE,TORCH_NCCL_ASYNC_ERROR_HANDLING,NCCL_MIN_NCHANNELS"
    assert job(NCCLTUNE_DISABLE="1") == {"NCCL_IB_HCA": "^mlx5_9"}


def test_the_devices_carry_each_scope_and_mount_the_generation_read_only(cfg: Config) -> None:
    publish_once(cfg)
    got = read_set(cfg.publish_dir)
    assert got is not None
    devices = {d["name"]: d["containerEdits"] for d in spec_of(cfg)["devices"]}
    gen = cfg.publish_dir / "generations" / "1"

    def env(name: str) -> dict[str, str]:
        return dict(entry.split("=", 1) for entry in devices[name]["env"])

    assert env("every-job") == {**got.env, **marker(cfg, "nccl.env")}
    assert env("single-node") == {**got.env, **got.single_node_env, **marker(cfg, "nccl-single-node.env")}
    # The marker names the set and every variable the device sets, as the published files do.
    assert env("single-node")[APPLIED_VAR] == (f"{got.set_id}:NCCL_IB_HCA,NCCL_TOPO_FILE,"
                                               "TORCH_NCCL_ASYNC_ERROR_HANDLING,NCCL_MIN_NCHANNELS")
    assert env("files") == {"NCCLTUNE_ENV_FILE": str(gen / "nccl.sh")}
    for edits in devices.values():
        assert edits["mounts"] == [{"hostPath": str(gen), "containerPath": str(gen), "type": "bind",
                                    "options": ["ro", "nosuid", "nodev", "bind"]}]
    # What the env names lies inside the mount, so the pod sees the very file.
    assert got.env["NCCL_TOPO_FILE"].startswith(f"{gen}/") and Path(got.env["NCCL_TOPO_FILE"]).is_file()


def test_the_next_publish_replaces_the_spec_atomically(cfg: Config) -> None:
    publish_once(cfg)
    publish_once(cfg, {**EVERY, "NCCL_IB_HCA": "^mlx5_3"})
    spec = spec_of(cfg)
    assert spec["devices"][0]["containerEdits"]["mounts"][0]["hostPath"].endswith("/generations/2")
    every = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
    assert every["NCCL_IB_HCA"] == "^mlx5_3"
    got = read_set(cfg.publish_dir)
    assert got is not None and every[APPLIED_VAR].startswith(f"{got.set_id}:") and got.generation == 2
    assert cfg.cdi_dir is not None
    assert os.listdir(cfg.cdi_dir) == [SPEC_NAME]  # no temporary file left beside it


def test_a_refused_publish_leaves_the_spec_as_it_was(cfg: Config) -> None:
    publish_once(cfg)
    assert cfg.cdi_dir is not None
    before = (cfg.cdi_dir / SPEC_NAME).read_bytes()
    with pytest.raises(InputError):
        publish_once(cfg, {**EVERY, "NCCL_IB_HCA": "$(reboot)"})
    assert (cfg.cdi_dir / SPEC_NAME).read_bytes() == before


def test_an_untrusted_cdi_dir_stops_the_publish_before_anything_is_written(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    cdi.chmod(0o777)  # anyone could plant a spec whose hooks the runtime runs as root
    cfg = Config(state_dir=str(tmp_path / "state"), publish=PublishConfig(cdi_dir=str(cdi)))
    with pytest.raises(InputError, match="refusing the CDI spec directory: it is world-writable"):
        publish_once(cfg)
    assert read_set(cfg.publish_dir) is None
    assert list(cdi.iterdir()) == []


def test_no_cdi_dir_no_spec(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    publish_once(Config(state_dir=str(tmp_path / "state")))
    assert not list(tmp_path.rglob(SPEC_NAME))


@pytest.mark.parametrize(("field", "value", "match"), [
    ("kind", "tuning", "not vendor/class"),
    ("kind", "Nccltune.IO/tuning", "not vendor/class"),
    ("kind", "nccltune.io/-tuning", "not vendor/class"),
])
def test_cdi_naming_rules_are_checked(tmp_path: Path, field: str, value: str, match: str) -> None:
    spec = render_spec(tmp_path, EVERY, SINGLE)
    spec[field] = value
    with pytest.raises(InputError, match=match):
        check_spec(spec)


def test_a_duplicate_device_or_a_relative_mount_is_refused(tmp_path: Path) -> None:
    spec = render_spec(tmp_path, EVERY, SINGLE)
    spec["devices"].append(dict(spec["devices"][0]))
    with pytest.raises(InputError, match="not unique"):
        check_spec(spec)
    spec = render_spec(Path("relative/dir"), EVERY, SINGLE)
    with pytest.raises(InputError, match="absolute"):
        check_spec(spec)
