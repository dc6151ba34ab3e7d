"""The tenant examples (deploy/kubernetes/examples/): valid against the Kubernetes API's schemas
(kubernetes-validate, offline, strict), asking for a resource the device plugin serves, with no
hostPath and a restricted security context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from nccltune.k8s.deviceplugin import DEVICES, RESOURCE_DOMAIN

EXAMPLES = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    return spec


def test_there_is_a_pod_and_a_job() -> None:
    kinds = {yaml.safe_load(f.read_text())["kind"] for f in FILES}
    assert kinds == {"Pod", "Job"}


@pytest.mark.parametrize("version", ["1.31", "1.37"])
@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_each_example_is_valid_and_asks_the_device_plugin(path: Path, version: str) -> None:
    doc = yaml.safe_load(path.read_text())
    kubernetes_validate.validate(doc, version, strict=True)
    pod = _pod_spec(doc)
    assert not [v for v in pod.get("volumes", []) if "hostPath" in v]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"]:
        limits = c["resources"]["limits"]
        ours = [k for k in limits if k.startswith(RESOURCE_DOMAIN + "/")]
        assert len(ours) == 1 and ours[0].partition("/")[2] in DEVICES and limits[ours[0]] == 1
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert not [a for a in doc["metadata"].get("annotations", {}) if a.startswith("cdi.k8s.io/")]
