"""The CDI spec for Kubernetes pods: written with every publish, valid against CDI's own JSON schema
(schemas/cdi, vendored from cncf-tags/container-device-interface) and CDI's naming rules, replaced
atomically, and naming only the generation's own files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from jsonschema import Draft7Validator
from referencing import Registry
from referencing.jsonschema import DRAFT7

from nccltune.config import Config, PublishConfig
from nccltune.delivery.cdi import KIND, SPEC_NAME, check_spec, render_spec
from nccltune.errors import InputError
from nccltune.publish import Provenance, Setting, publish_setting, read_set

CDI_SCHEMAS = REPO / "schemas" / "cdi"
EVERY = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_IB_HCA": "^mlx5_2"}
SINGLE = {"NCCL_MIN_NCHANNELS": "32"}


def cdi_validator() -> Draft7Validator:
    schema = json.loads((CDI_SCHEMAS / "schema.json").read_text())
    defs = json.loads((CDI_SCHEMAS / "defs.json").read_text())
    # schema.json refers to "defs.json#/definitions/...": resolved from the vendored file, never fetched.
    registry: Registry[Any] = Registry().with_resource("defs.json", DRAFT7.create_resource(defs))
    return Draft7Validator(schema, registry=registry)


def prov() -> Provenance:
    return Provenance(nccltune_version="0", created_at="now", topology_fingerprint="f", nccl_version=None,
                      backend="nccl", demo=False, profile=None)


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    tmp_path.chmod(0o755)
    return Config(state_dir=str(tmp_path / "state"), publish=PublishConfig(cdi_dir=str(tmp_path / "cdi")))


def publish_once(cfg: Config, every: dict[str, str] = EVERY) -> None:
    publish_setting(cfg, Setting(every, prov(), SINGLE, "<system version=\"1\"/>\n"))


def spec_of(cfg: Config) -> dict[str, Any]:
    assert cfg.cdi_dir is not None
    doc: dict[str, Any] = json.loads((cfg.cdi_dir / SPEC_NAME).read_text())
    return doc


def test_every_publish_writes_a_spec_valid_against_cdis_schema(cfg: Config) -> None:
    publish_once(cfg)
    spec = spec_of(cfg)
    errors = [e.message for e in cdi_validator().iter_errors(spec)]
    assert errors == []
    check_spec(spec)
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == KIND == "nccltune.io/tuning"
    assert [d["name"] for d in spec["devices"]] == ["every-job", "single-node", "files"]


def test_the_devices_carry_each_scope_and_mount_the_generation_read_only(cfg: Config) -> None:
    publish_once(cfg)
    got = read_set(cfg.publish_dir)
    assert got is not None
    devices = {d["name"]: d["containerEdits"] for d in spec_of(cfg)["devices"]}
    gen = cfg.publish_dir / "generations" / "1"

    def env(name: str) -> dict[str, str]:
        return dict(entry.split("=", 1) for entry in devices[name]["env"])

    assert env("every-job") == got.env
    assert env("single-node") == {**got.env, **got.single_node_env}
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
    assert spec["annotations"] == {"nccltune.io/generation": "2"}
    every = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
    assert every["NCCL_IB_HCA"] == "^mlx5_3"
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
    spec = render_spec(tmp_path, EVERY, SINGLE, generation=1)
    spec[field] = value
    with pytest.raises(InputError, match=match):
        check_spec(spec)


def test_a_duplicate_device_or_a_relative_mount_is_refused(tmp_path: Path) -> None:
    spec = render_spec(tmp_path, EVERY, SINGLE, generation=1)
    spec["devices"].append(dict(spec["devices"][0]))
    with pytest.raises(InputError, match="not unique"):
        check_spec(spec)
    spec = render_spec(Path("relative/dir"), EVERY, SINGLE, generation=1)
    with pytest.raises(InputError, match="absolute"):
        check_spec(spec)
    # The schema itself refuses what CDI does not know.
    spec = render_spec(tmp_path, EVERY, SINGLE, generation=1)
    spec["devices"][0]["containerEdits"]["mounts"][0].pop("hostPath")
    assert list(cdi_validator().iter_errors(spec))
