"""The kubelet device plugin against a fake kubelet: a real gRPC server on a unix socket
implementing the kubelet's Registration service with protobuf's own implementation of the API
(compiled here from nccltune/k8s/deviceplugin.proto by grpcio-tools), which, as the kubelet does,
dials the plugin back and calls ListAndWatch and Allocate. So the plugin's hand-made messages are
read by protobuf itself, and its answers name the CDI devices the daemon's spec has."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from fakekubelet import WAIT_S, FakeKubelet, compile_api

from nccltune.k8s import wire
from nccltune.k8s.deviceplugin import (
    DEVICES,
    HEALTHY,
    UNHEALTHY,
    DevicePlugin,
    Resource,
    allocate_requests,
    allocate_response,
    list_and_watch_response,
    register_request,
)
from nccltune.publish.cdi import KIND, SPEC_NAME, write_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, ModuleType]:
    return compile_api(tmp_path_factory.mktemp("pb"))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory short enough for unix socket names (108 bytes), as /var/lib/kubelet/... is."""
    d = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _publish(cdi_dir: Path, generation: Path) -> Path:
    return write_spec(cdi_dir, generation, {"NCCL_ALGO": "Ring"}, {"NCCL_P2P_LEVEL": "NVL"}, "3:0123456789abcdef")


@pytest.fixture
def plugin(short_dir: Path) -> Iterator[DevicePlugin]:
    (short_dir / "plugins").mkdir()
    p = DevicePlugin(short_dir / "cdi", short_dir / "plugins", units=4, interval_s=0.1)
    thread = threading.Thread(target=p.run, daemon=True)
    thread.start()
    yield p
    p.stop()
    thread.join(timeout=WAIT_S)
    assert not thread.is_alive()


# -- the messages, read and written by protobuf itself ----------------------------------------------

def test_every_message_is_what_protobuf_reads_and_writes(api: tuple[ModuleType, ModuleType]) -> None:
    pb, _ = api
    req = pb.RegisterRequest.FromString(register_request(Resource("every-job")))
    assert (req.version, req.endpoint, req.resource_name) == ("v1beta1", "nccltune-every-job.sock",
                                                              "nccltune.io/every-job")
    assert req.HasField("options") and not req.options.pre_start_required

    listed = pb.ListAndWatchResponse.FromString(list_and_watch_response(["a-0", "a-1"], HEALTHY))
    assert [(d.ID, d.health) for d in listed.devices] == [("a-0", HEALTHY), ("a-1", HEALTHY)]

    answer = pb.AllocateResponse.FromString(allocate_response([["nccltune.io/tuning=files"], []], False))
    assert [[c.name for c in r.cdi_devices] for r in answer.container_responses] == [["nccltune.io/tuning=files"], []]
    assert not answer.container_responses[0].envs and not answer.container_responses[0].mounts
    annotated = pb.AllocateResponse.FromString(allocate_response([["nccltune.io/tuning=every-job"]], True))
    (only,) = annotated.container_responses
    assert dict(only.annotations) == {"cdi.k8s.io/nccltune_every-job": "nccltune.io/tuning=every-job"}
    assert not only.cdi_devices

    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["x-1", ""]),
                                                     pb.ContainerAllocateRequest()])
    assert allocate_requests(request.SerializeToString()) == [["x-1", ""], []]


def test_the_reader_refuses_what_is_not_wire_format() -> None:
    good = wire.string(1, "abc")
    with pytest.raises(wire.WireError, match="announced"):
        list(wire.fields(good[:-1]))
    with pytest.raises(wire.WireError, match="truncated varint"):
        list(wire.fields(b"\x08\xff"))
    with pytest.raises(wire.WireError, match="wire type 3"):
        list(wire.fields(b"\x0b"))
    # A field the reader does not know is skipped, as protobuf skips it.
    assert wire.repeated_strings(wire.string(7, "zz") + good + b"\x10\x05", 1) == ["abc"]


# -- against the fake kubelet ------------------------------------------------------------------------

def test_it_registers_every_resource_and_allocate_names_the_cdi_device(
        api: tuple[ModuleType, ModuleType], short_dir: Path, plugin: DevicePlugin) -> None:
    pb, _ = api
    spec = _publish(short_dir / "cdi", Path("/var/lib/nccltune/generations/3"))
    kubelet = FakeKubelet(api, short_dir / "plugins")
    try:
        got = kubelet.registrations(len(DEVICES))
        assert set(got) == {f"nccltune.io/{d}" for d in DEVICES}
        for name, (request, options) in got.items():
            assert request.version == "v1beta1" and (short_dir / "plugins" / request.endpoint).is_socket()
            assert not options.pre_start_required and not options.get_preferred_allocation_available
            listed = kubelet.next_list(name)
            assert [(d.ID, d.health) for d in listed.devices] == [
                (f"{name.partition('/')[2]}-{i}", HEALTHY) for i in range(4)]
        answer = kubelet.stub("nccltune.io/single-node").Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=["single-node-2"]),
            pb.ContainerAllocateRequest(devices_ids=["single-node-0", "single-node-1"])]), timeout=5)
        assert [[c.name for c in r.cdi_devices] for r in answer.container_responses] == [
            [f"{KIND}=single-node"], [f"{KIND}=single-node"]]
        # The name is one the published spec has: what the runtime resolves.
        assert '"name": "single-node"' in spec.read_text()
        with pytest.raises(grpc.RpcError) as refused:
            kubelet.stub("nccltune.io/files").Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=["every-job-0"])]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown unit ids every-job-0" in refused.value.details()
    finally:
        kubelet.stop()


def test_units_are_unhealthy_until_the_spec_has_the_device(
        api: tuple[ModuleType, ModuleType], short_dir: Path, plugin: DevicePlugin) -> None:
    pb, _ = api
    kubelet = FakeKubelet(api, short_dir / "plugins")
    try:
        kubelet.registrations(len(DEVICES))
        first = kubelet.next_list("nccltune.io/every-job")
        assert {d.health for d in first.devices} == {UNHEALTHY}
        with pytest.raises(grpc.RpcError) as refused:
            kubelet.stub("nccltune.io/every-job").Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=["every-job-0"])]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "has not published CDI device nccltune.io/tuning=every-job" in refused.value.details()
        _publish(short_dir / "cdi", Path("/var/lib/nccltune/generations/1"))
        again = kubelet.next_list("nccltune.io/every-job")
        assert {d.health for d in again.devices} == {HEALTHY}
        # A spec the runtime could not apply either (another kind) makes them unhealthy again.
        spec = short_dir / "cdi" / SPEC_NAME
        spec.write_text(spec.read_text().replace(KIND, "example.com/other"))
        assert {d.health for d in kubelet.next_list("nccltune.io/every-job").devices} == {UNHEALTHY}
    finally:
        kubelet.stop()


def test_it_registers_again_when_the_kubelet_restarts(
        api: tuple[ModuleType, ModuleType], short_dir: Path, plugin: DevicePlugin) -> None:
    plugins = short_dir / "plugins"
    kubelet = FakeKubelet(api, plugins)
    kubelet.registrations(len(DEVICES))
    kubelet.stop()
    # A restarting kubelet removes every socket of the directory, then makes its own anew.
    for sock in plugins.iterdir():
        sock.unlink()
    kubelet = FakeKubelet(api, plugins)
    try:
        got = kubelet.registrations(len(DEVICES))
        assert set(got) == {f"nccltune.io/{d}" for d in DEVICES}
        for request, _ in got.values():
            assert (plugins / request.endpoint).is_socket()
        # The plugin counts a registration once the kubelet's answer is back.
        deadline = time.monotonic() + WAIT_S
        while not all(plugin.registered().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(plugin.registered().values()), plugin.registered()
    finally:
        kubelet.stop()


def test_the_command_serves_until_sigterm_and_removes_its_sockets(
        api: tuple[ModuleType, ModuleType], short_dir: Path) -> None:
    plugins = short_dir / "plugins"
    plugins.mkdir()
    config = short_dir / "config.yaml"
    config.write_text(f"state_dir: {short_dir / 'state'}\npublish:\n  cdi_dir: {short_dir / 'cdi'}\n")
    _publish(short_dir / "cdi", Path("/var/lib/nccltune/generations/2"))
    kubelet = FakeKubelet(api, plugins)
    proc = subprocess.Popen([sys.executable, "-m", "nccltune", "device-plugin", "--config", str(config),
                             "--plugin-dir", str(plugins), "--units", "2", "--interval", "0.2"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        got = kubelet.registrations(len(DEVICES))
        assert {d.health for d in kubelet.next_list("nccltune.io/files").devices} == {HEALTHY}
        assert len(kubelet.next_list("nccltune.io/every-job").devices) == 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, err
        for request, _ in got.values():
            assert not (plugins / request.endpoint).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kubelet.stop()


def test_the_command_without_a_cdi_dir_says_so(short_dir: Path) -> None:
    config = short_dir / "config.yaml"
    config.write_text(f"state_dir: {short_dir / 'state'}\n")
    run = subprocess.run([sys.executable, "-m", "nccltune", "device-plugin", "--config", str(config),
                          "--plugin-dir", str(short_dir)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ})
    assert run.returncode == 78, run.stderr
    assert "publish.cdi_dir is not set" in run.stderr
