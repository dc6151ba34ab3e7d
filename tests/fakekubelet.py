"""A fake kubelet for the device plugin's tests: the kubelet's Registration service on a unix
socket, through protobuf's own implementation of the device plugin API (compiled from
nccltune/k8s/deviceplugin.proto by grpcio-tools), dialling each registered plugin back as the
kubelet does."""

from __future__ import annotations

import importlib
import queue
import sys
import threading
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
from grpc_tools import protoc

PROTO = Path(__file__).resolve().parents[1] / "nccltune" / "k8s" / "deviceplugin.proto"
WAIT_S = 20.0


def compile_api(out: Path) -> tuple[ModuleType, ModuleType]:
    """deviceplugin_pb2 and deviceplugin_pb2_grpc, generated from the proto file into `out`."""
    rc = protoc.main(["protoc", f"-I{PROTO.parent}", f"--python_out={out}", f"--grpc_python_out={out}", str(PROTO)])
    assert rc == 0
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("deviceplugin_pb2"), importlib.import_module("deviceplugin_pb2_grpc")
    finally:
        sys.path.remove(str(out))


class FakeKubelet:
    """The kubelet's side: Registration on <dir>/kubelet.sock; on each Register it dials the
    plugin's endpoint, asks its options and keeps a ListAndWatch stream open, its answers
    queued per resource."""

    def __init__(self, api: tuple[ModuleType, ModuleType], plugin_dir: Path) -> None:
        self.pb, self.pb_grpc = api
        self.plugin_dir = plugin_dir
        self.registered: queue.Queue[Any] = queue.Queue()
        self.lists: dict[str, queue.Queue[Any]] = {}
        self.channels: dict[str, grpc.Channel] = {}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        outer = self

        class Registration(self.pb_grpc.RegistrationServicer):
            def Register(self, request: Any, context: Any) -> Any:  # the API's name
                outer.on_register(request)
                return outer.pb.Empty()

        self.pb_grpc.add_RegistrationServicer_to_server(Registration(), self.server)
        self.server.add_insecure_port(f"unix://{plugin_dir / 'kubelet.sock'}")
        self.server.start()

    def on_register(self, request: Any) -> None:
        channel = grpc.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        stub = self.pb_grpc.DevicePluginStub(channel)
        options = stub.GetDevicePluginOptions(self.pb.Empty(), timeout=5)
        lists: queue.Queue[Any] = queue.Queue()
        self.lists[request.resource_name] = lists
        self.channels[request.resource_name] = channel

        def watch() -> None:
            try:
                for answer in stub.ListAndWatch(self.pb.Empty()):
                    lists.put(answer)
            except grpc.RpcError:
                pass  # the plugin or this kubelet stopped

        threading.Thread(target=watch, daemon=True).start()
        self.registered.put((request, options))

    def stub(self, resource: str) -> Any:
        return self.pb_grpc.DevicePluginStub(self.channels[resource])

    def registrations(self, n: int) -> dict[str, Any]:
        got = {}
        for _ in range(n):
            request, options = self.registered.get(timeout=WAIT_S)
            got[request.resource_name] = (request, options)
        return got

    def next_list(self, resource: str) -> Any:
        return self.lists[resource].get(timeout=WAIT_S)

    def stop(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.server.stop(grace=0).wait()
