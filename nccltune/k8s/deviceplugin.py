"""A kubelet device plugin that hands nccltune's CDI devices to the pods that ask for them.

A tenant asks in its pod spec, as for any extended resource (docs/kubernetes.md)::

    resources:
      limits:
        nccltune.io/every-job: 1

and the kubelet, at admission, asks this plugin to Allocate one unit; the answer names the CDI
device ``nccltune.io/tuning=every-job`` (CRI's ``CDIDevices``, which the kubelet passes since 1.28
and always since 1.31), and containerd or CRI-O apply that device's edits from the spec the daemon
publishes (publish.cdi). So the tuning is a resource the cluster's admission, quota and policy
see (a ResourceQuota or a policy can say which namespaces may have it), instead of an annotation
any tenant may add to get whatever device it names.

One resource per CDI device: ``nccltune.io/every-job``, ``nccltune.io/single-node`` and
``nccltune.io/files``, each with ``units`` interchangeable units (the tuning is shared, not used
up: the count only bounds how many containers of a node may hold one at once, by default as many
as the kubelet's default pod limit). Each is its own gRPC server on a socket in the kubelet's
device-plugins directory, registered with the kubelet there (API v1beta1).

The units are healthy while the published CDI spec has their device, so a pod that asks is
scheduled only to a node that can give it (a node before its first publish, or whose spec is
unreadable, shows its units unhealthy: allocatable 0), and re-read every ``interval`` seconds. The
kubelet removes every plugin socket when it restarts; the plugin then finds its socket gone, or
the kubelet's socket a new one, and serves and registers again.

The messages are encoded by k8s.wire (no generated code); gRPC is the ``k8s`` extra's grpcio.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from ..errors import NccltuneError
from ..files.inputfile import parse_json, read_input_file
from ..publish.cdi import EVERY_JOB_DEVICE, FILES_DEVICE, KIND, SINGLE_NODE_DEVICE, SPEC_NAME, check_spec
from . import wire

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
RESOURCE_DOMAIN = "nccltune.io"
DEVICES = (EVERY_JOB_DEVICE, SINGLE_NODE_DEVICE, FILES_DEVICE)
# The kubelet's default --max-pods: a node cannot run more containers that hold a unit than this
# unless it runs more pods.
DEFAULT_UNITS = 110
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# The kubelet's dial-back and the registration answer come within a second on a live node.
REGISTER_TIMEOUT_S = 10.0
SPEC_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Resource:
    """One extended resource: the CDI device it hands out."""

    device: str

    @property
    def name(self) -> str:
        return f"{RESOURCE_DOMAIN}/{self.device}"

    @property
    def endpoint(self) -> str:
        """The socket's name in the device-plugins directory."""
        return f"nccltune-{self.device}.sock"

    @property
    def cdi_device(self) -> str:
        return f"{KIND}={self.device}"

    def unit_ids(self, units: int) -> list[str]:
        return [f"{self.device}-{i}" for i in range(units)]


def published_devices(cdi_dir: Path) -> frozenset[str]:
    """The device names of the published CDI spec; none while it is missing, and none (with a
    warning) while it cannot be trusted or read: the runtime could not apply it either."""
    path = cdi_dir / SPEC_NAME
    try:
        spec = parse_json(read_input_file(path, SPEC_MAX_BYTES, "CDI spec", trusted=True), str(path))
        if not isinstance(spec, dict) or spec.get("kind") != KIND:
            raise ValueError(f"{path}: kind is not {KIND}")
        check_spec(spec)
        return frozenset(str(d["name"]) for d in spec.get("devices", []))
    except FileNotFoundError:
        return frozenset()
    except (OSError, ValueError, KeyError, TypeError, NccltuneError) as exc:
        log.warning("CDI spec %s unusable, nccltune's units unhealthy: %s", path, exc)
        return frozenset()


class SpecDevices:
    """The devices of the published spec, shared by the servers; a change wakes every
    ListAndWatch stream."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._devices: frozenset[str] = frozenset()
        self._version = 0
        self._closed = False

    def update(self, devices: frozenset[str]) -> None:
        with self._cond:
            if devices != self._devices:
                self._devices = devices
                self._version += 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def has(self, device: str) -> bool:
        with self._cond:
            return device in self._devices

    def watch(self, alive: Callable[[], bool]) -> Iterator[frozenset[str]]:
        """The devices now, then at every change, while `alive()` and not closed."""
        seen = -1
        while True:
            with self._cond:
                while self._version == seen and not self._closed and alive():
                    self._cond.wait(timeout=1.0)
                if self._closed or not alive():
                    return
                seen = self._version
                devices = self._devices
            yield devices


# -- the messages (deviceplugin.proto) -------------------------------------------------------------

def register_request(resource: Resource) -> bytes:
    return (wire.string(1, API_VERSION) + wire.string(2, resource.endpoint) + wire.string(3, resource.name)
            + wire.message(4, b""))


def list_and_watch_response(ids: list[str], health: str) -> bytes:
    return b"".join(wire.message(1, wire.string(1, i) + wire.string(2, health)) for i in ids)


def allocate_response(cdi_devices: list[list[str]], annotations: bool) -> bytes:
    """One ContainerAllocateResponse per container request, naming its CDI devices in
    cdi_devices, or with `annotations` as the `cdi.k8s.io/` annotations runtimes also read (for a
    kubelet that does not pass cdi_devices)."""
    out = b""
    for names in cdi_devices:
        if annotations:
            body = wire.string_map(4, {f"cdi.k8s.io/nccltune_{n.rpartition('=')[2]}": n for n in names})
        else:
            body = b"".join(wire.message(5, wire.string(1, n)) for n in names)
        out += wire.message(1, body)
    return out


def allocate_requests(data: bytes) -> list[list[str]]:
    """The unit ids of each container request of an AllocateRequest."""
    return [wire.repeated_strings(c, 1) for c in wire.repeated_bytes(data, 1)]


# -- one resource's server ---------------------------------------------------------------------------

class ResourceServer:
    """The DevicePlugin service of one resource on its socket, and its registration."""

    def __init__(self, resource: Resource, plugin_dir: Path, units: int, published: SpecDevices, *,
                 annotations: bool = False) -> None:
        self.resource = resource
        self.socket = plugin_dir / resource.endpoint
        self.kubelet_socket = plugin_dir / KUBELET_SOCKET
        self.ids = resource.unit_ids(units)
        self._published = published
        self._annotations = annotations
        self._server: grpc.Server | None = None
        self._serving = threading.Event()
        # The socket this server made, to tell it from one that replaced it.
        self.socket_id: tuple[int, int] | None = None

    def start(self) -> None:
        _remove_socket(self.socket)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=self.resource.device))
        server.add_generic_rpc_handlers((self._handlers(),))
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        st = os.stat(self.socket)
        self.socket_id = (st.st_dev, st.st_ino)
        self._server = server
        self._serving.set()
        log.info("serving %s on %s", self.resource.name, self.socket)

    def stop(self) -> None:
        self._serving.clear()
        if self._server is not None:
            self._server.stop(grace=1.0).wait()
            self._server = None
        if self.socket_id is not None and _socket_id(self.socket) == self.socket_id:
            _remove_socket(self.socket)
        self.socket_id = None

    def socket_is_ours(self) -> bool:
        return self.socket_id is not None and _socket_id(self.socket) == self.socket_id

    def register(self) -> None:
        """Register with the kubelet (which then dials the plugin's socket).

        Raises:
            grpc.RpcError: the kubelet is not there or refused it (the caller retries).
        """
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            call = channel.unary_unary("/v1beta1.Registration/Register",
                                       request_serializer=_identity, response_deserializer=_identity)
            call(register_request(self.resource), timeout=REGISTER_TIMEOUT_S)
        log.info("registered %s with the kubelet", self.resource.name)

    # The service's methods: (request bytes, context) -> response bytes.

    def _options(self, _request: bytes, _context: grpc.ServicerContext) -> bytes:
        return b""  # neither PreStartContainer nor GetPreferredAllocation

    def _list_and_watch(self, _request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for devices in self._published.watch(lambda: self._serving.is_set() and context.is_active()):
            health = HEALTHY if self.resource.device in devices else UNHEALTHY
            yield list_and_watch_response(self.ids, health)

    def _allocate(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            containers = allocate_requests(request)
        except wire.WireError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"AllocateRequest: {exc}")
        known = set(self.ids)
        for ids in containers:
            unknown = [i for i in ids if i not in known]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{self.resource.name}: unknown unit ids {', '.join(unknown)}")
        if not self._published.has(self.resource.device):
            # Said to the pod (the kubelet's admission error) rather than left to the runtime,
            # which would fail the container on a device no spec has.
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{self.resource.name}: this node has not published CDI device {self.resource.cdi_device}")
        return allocate_response([[self.resource.cdi_device] for _ in containers], self._annotations)

    def _preferred(self, _request: bytes, _context: grpc.ServicerContext) -> bytes:
        return b""

    def _pre_start(self, _request: bytes, _context: grpc.ServicerContext) -> bytes:
        return b""

    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[[bytes, grpc.ServicerContext], bytes]) -> grpc.RpcMethodHandler[bytes, bytes]:
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=_identity,
                                                       response_serializer=_identity)

        return grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", {
            "GetDevicePluginOptions": unary(self._options),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                self._list_and_watch, request_deserializer=_identity, response_serializer=_identity),
            "GetPreferredAllocation": unary(self._preferred),
            "Allocate": unary(self._allocate),
            "PreStartContainer": unary(self._pre_start),
        })


def _identity(data: bytes) -> bytes:
    return data


def _socket_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def _remove_socket(path: Path) -> None:
    """Remove a socket left at `path` (a plugin's earlier run); anything else there is left alone
    and refused, since binding would fail on it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket")
    os.unlink(path)


# -- the plugin: every resource, kept registered ---------------------------------------------------------

class DevicePlugin:
    """Serves and keeps registered one ResourceServer per CDI device until `stop()`."""

    def __init__(self, cdi_dir: Path, plugin_dir: Path = PLUGIN_DIR, *, units: int = DEFAULT_UNITS,
                 interval_s: float = 5.0, annotations: bool = False) -> None:
        if units < 1:
            raise ValueError("units must be at least 1")
        self.cdi_dir = cdi_dir
        self.plugin_dir = plugin_dir
        self.interval_s = interval_s
        self.published = SpecDevices()
        self.servers = [ResourceServer(Resource(d), plugin_dir, units, self.published, annotations=annotations)
                        for d in DEVICES]
        self._stop = threading.Event()
        # The kubelet socket each server registered with; None: not registered.
        self._registered: dict[str, tuple[int, int] | None] = {s.resource.name: None for s in self.servers}

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Serve until stop(): re-read the spec and check the registrations every interval."""
        try:
            while not self._stop.is_set():
                self.step()
                self._stop.wait(self.interval_s)
        finally:
            self.published.close()
            for server in self.servers:
                server.stop()

    def step(self) -> None:
        """One round: the spec's devices, then each server serving and registered with the
        kubelet that is there now."""
        self.published.update(published_devices(self.cdi_dir))
        kubelet = _socket_id(self.plugin_dir / KUBELET_SOCKET)
        for server in self.servers:
            name = server.resource.name
            if not server.socket_is_ours():
                # Gone with a kubelet restart (it clears the directory), or never started.
                server.stop()
                server.start()
                self._registered[name] = None
            if kubelet is None or self._registered[name] == kubelet:
                continue
            try:
                server.register()
            except grpc.RpcError as exc:
                log.warning("cannot register %s with the kubelet at %s (retrying): %s", name,
                            server.kubelet_socket, exc.details() if isinstance(exc, grpc.Call) else exc)
                continue
            self._registered[name] = kubelet

    def registered(self) -> dict[str, bool]:
        return {name: kubelet is not None for name, kubelet in self._registered.items()}
