"""A sweep measured in the job's image (bench.image) says so: `sweep --json`'s `image` (its schema in
schemas/sweep.schema.json) and the report's header, as trials.container.provenance records it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import REPO

from nccltune.fleet.jsonschema import SchemaViolation, validate
from nccltune.pipeline import SweepReport
from nccltune.report.jsondoc import dumps
from nccltune.report.sweep import sweep_doc, sweep_text

DIGEST = "sha256:" + "ab" * 32
IMAGE = {"image": f"registry.example/team/train@{DIGEST}", "image_digest": DIGEST, "runtime": "podman",
         "image_python": "3.11.2", "image_torch_version": "2.5.1", "image_nccl_version": "2.21.5",
         "image_nccl_lib": "/usr/lib/x86_64-linux-gnu/libnccl.so.2", "image_os": "Ubuntu 22.04.4 LTS"}


def _report(image: dict[str, str] | None) -> SweepReport:
    # Nothing measured: the plan is read for its pruned candidates and per-size stage alone.
    return SweepReport(run_id=7, demo=False, backend="nccl", fingerprint="0123456789abcdef",
                       plan=SimpleNamespace(per_size=None, pruned=[]),  # type: ignore[arg-type]
                       result=None, chosen_env={}, chosen_label="defaults", published=None, topology_file=None,
                       nccl_version="2.21.5", torch_version="2.5.1", trials=0, failed_trials=[], wall_s=1.0,
                       profile="default", image=image)


def _schema() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((REPO / "schemas" / "sweep.schema.json").read_text())
    return doc


def test_the_sweep_document_and_header_name_the_image_it_measured_in() -> None:
    doc = json.loads(dumps(sweep_doc(_report(IMAGE))))
    validate(doc, _schema())
    assert doc["image"] == IMAGE
    header = sweep_text(_report(IMAGE)).splitlines()[1]
    assert header == (f"Measured in image registry.example/team/train@{DIGEST} (podman): NCCL 2.21.5, "
                      "torch 2.5.1")
    on_host = json.loads(dumps(sweep_doc(_report(None))))
    validate(on_host, _schema())
    assert on_host["image"] is None and "Measured in image" not in sweep_text(_report(None))


def test_the_schema_takes_an_image_only_by_digest_and_its_runtime() -> None:
    for bad in ({**IMAGE, "image_digest": "sha256:abc"}, {**IMAGE, "runtime": "singularity"},
                {**IMAGE, "image_tag": "latest"}):
        doc = json.loads(dumps(sweep_doc(_report(bad))))
        with pytest.raises(SchemaViolation, match=r"image\."):
            validate(doc, _schema())
