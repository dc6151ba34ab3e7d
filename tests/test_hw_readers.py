"""The hardware readers and the snapshot files, checked against every topology in topologies/.

The sysfs reader reads a fake tree written from each snapshot (tests/fakesysfs.py) and must give
the snapshot back; the NVML reader reads a stand-in binding built from each snapshot and must do
the same. That is what makes a recorded or synthetic snapshot a faithful fixture: the readers
cannot tell it from the node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from conftest import TOPOLOGIES
from fakesysfs import build_fake_sysfs

from nccltune.errors import EXIT_CONFIG, EXIT_UNAVAILABLE, InputError, UnavailableError
from nccltune.hw.cpuset import cpus_from_cpulist, cpus_from_cpumask
from nccltune.hw.nvml import NvmlReader, compute_pids
from nccltune.hw.procfs import descendants, parent_pids
from nccltune.hw.sysfs import SysfsReader
from nccltune.hw.types import Gpu, GpuProcess, Nic, NvLink, NvmlSnapshot, P2PStatus, Snapshot, SysfsSnapshot
from nccltune.topology.snapshot import load_snapshot, snapshot_to_json

TOPOLOGY_DIR = TOPOLOGIES
TOPOLOGY_FILES = sorted(TOPOLOGY_DIR.glob("*.json"))
# Built from public facts by a script, hence written by snapshot_to_json byte for byte.
SYNTHETIC = ("hgx-h100-8gpu.json", "dgx-a100-8gpu.json", "pcie-4gpu-2socket.json",
             "pcie-2gpu-nvlink-bridge.json")
# NVML's answer for an NVSwitch that a VM cannot see.
INVISIBLE = "ffffffff:ff:ff.0"


def _load(name: str) -> Snapshot:
    return load_snapshot(TOPOLOGY_DIR / name)


@pytest.fixture(params=TOPOLOGY_FILES, ids=lambda p: p.name)
def snap_file(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


@pytest.fixture
def snap(snap_file: Path) -> Snapshot:
    return load_snapshot(snap_file)


def test_all_synthetic_topologies_are_present() -> None:
    names = {p.name for p in TOPOLOGY_FILES}
    assert set(SYNTHETIC) <= names


# -- sysfs reader: fake tree written from each snapshot, read back -----------------------------


def _read_back(tmp_path: Path, snap: Snapshot, with_gpu_ids: bool = True) -> SysfsSnapshot:
    root = build_fake_sysfs(tmp_path / "root", snap.sysfs)
    gpu_ids = [g.bus_id for g in snap.nvml.gpus] if with_gpu_ids else []
    return SysfsReader(root).read(gpu_ids)


def _nic_key(n: Nic) -> tuple[bool, str]:
    return (n.kind != "ib", n.name)


def test_sysfs_pci_round_trip(tmp_path: Path, snap: Snapshot) -> None:
    got = _read_back(tmp_path, snap)
    assert [d.bus_id for d in got.pci] == [d.bus_id for d in snap.sysfs.pci]
    for mine, want in zip(got.pci, snap.sysfs.pci, strict=True):
        assert mine.class_code == want.class_code, want.bus_id
        assert mine.path == want.path, want.bus_id
        assert (mine.vendor, mine.device) == (want.vendor, want.device), want.bus_id
        assert (mine.max_link_speed, mine.max_link_width) == (want.max_link_speed, want.max_link_width)
        assert mine.numa_node == want.numa_node, want.bus_id
    assert got.pci == snap.sysfs.pci


def test_sysfs_finds_nvidia_devices_without_nvml(tmp_path: Path, snap: Snapshot) -> None:
    """GPUs and NVSwitches are found by vendor and class alone, as when NVML is unusable."""
    got = _read_back(tmp_path, snap, with_gpu_ids=False)
    assert got.pci == snap.sysfs.pci


def test_sysfs_numa_round_trip(tmp_path: Path, snap: Snapshot) -> None:
    got = _read_back(tmp_path, snap)
    assert got.numa_nodes == snap.sysfs.numa_nodes


def test_sysfs_cpu_round_trip(tmp_path: Path, snap: Snapshot) -> None:
    got = _read_back(tmp_path, snap).cpu
    want = snap.sysfs.cpu
    assert (got.vendor, got.family, got.model) == (want.vendor, want.family, want.model)
    assert got.model_name == want.model_name
    assert (got.sockets, got.logical_cpus) == (want.sockets, want.logical_cpus)
    # `arch` is not in the tree: on "/" the reader asks the interpreter (platform.machine()),
    # elsewhere it assumes x86_64, which every topology here is.
    assert dataclasses.replace(got, arch=want.arch) == want


def test_sysfs_nic_round_trip(tmp_path: Path, snap: Snapshot) -> None:
    got = _read_back(tmp_path, snap)
    mine = sorted(got.nics, key=_nic_key)
    # `has_ipv4` comes from the kernel's address list, which only exists on a live node: off "/",
    # the reader says None rather than guess.
    want = sorted((dataclasses.replace(n, has_ipv4=None) for n in snap.sysfs.nics), key=_nic_key)
    assert [(n.name, n.kind, n.bus_id) for n in mine] == [(n.name, n.kind, n.bus_id) for n in want]
    for m, w in zip(mine, want, strict=True):
        assert m.ports == w.ports, w.name
        assert m.gdr == w.gdr, w.name
        assert (m.guid, m.speed_mbps, m.operstate) == (w.guid, w.speed_mbps, w.operstate), w.name
    assert mine == want
    assert got.gdr_module == snap.sysfs.gdr_module


def test_sysfs_whole_snapshot_round_trip(tmp_path: Path, snap: Snapshot) -> None:
    got = _read_back(tmp_path, snap)
    normalised = dataclasses.replace(
        got,
        cpu=dataclasses.replace(got.cpu, arch=snap.sysfs.cpu.arch),
        nics=tuple(sorted(got.nics, key=_nic_key)),
    )
    want = dataclasses.replace(
        snap.sysfs,
        nics=tuple(sorted((dataclasses.replace(n, has_ipv4=None) for n in snap.sysfs.nics), key=_nic_key)),
    )
    assert normalised == want


def _tiny_tree(root: Path) -> None:
    """One GPU on a root port, a virtio NIC, a docker bridge: the odd cases in one place."""
    gpu = root / "sys/devices/pci0000:00/0000:00:02.0/0000:01:00.0"
    rp = gpu.parent
    for d, cls, vendor in ((rp, "0x060400", "0x8086"), (gpu, "0x030200", "0x10de")):
        d.mkdir(parents=True, exist_ok=True)
        (d / "class").write_text(cls + "\n")
        (d / "vendor").write_text(vendor + "\n")
        (d / "numa_node").write_text("-1\n")
    pci = root / "sys/bus/pci/devices"
    pci.mkdir(parents=True)
    (pci / "0000:00:02.0").symlink_to("../../../devices/pci0000:00/0000:00:02.0")
    (pci / "0000:01:00.0").symlink_to("../../../devices/pci0000:00/0000:00:02.0/0000:01:00.0")
    virtio = root / "sys/devices/pci0000:00/0000:00:03.0/virtio2"
    eth0 = virtio / "net/eth0"
    eth0.mkdir(parents=True)
    (eth0 / "device").symlink_to("../../../virtio2")
    (eth0 / "operstate").write_text("up\n")
    (eth0 / "speed").write_text("-1\n")
    docker = root / "sys/devices/virtual/net/docker0"
    docker.mkdir(parents=True)
    net = root / "sys/class/net"
    net.mkdir(parents=True)
    (net / "eth0").symlink_to("../../devices/pci0000:00/0000:00:03.0/virtio2/net/eth0")
    (net / "docker0").symlink_to("../../devices/virtual/net/docker0")


def test_sysfs_odd_cases(tmp_path: Path) -> None:
    _tiny_tree(tmp_path)
    got = SysfsReader(tmp_path).read(["00000000:01:00.0"])
    # NVML's 8-digit domain is matched to the kernel's 4-digit name; -1 NUMA becomes None.
    assert [d.bus_id for d in got.pci] == ["0000:00:02.0", "0000:01:00.0"]
    assert got.pci[1].path == ("pci0000:00", "0000:00:02.0", "0000:01:00.0")
    assert all(d.numa_node is None for d in got.pci)
    # A virtio interface has no PCI function of its own; docker bridges are skipped like NCCL does.
    assert [(n.name, n.bus_id, n.speed_mbps, n.operstate) for n in got.nics] == [("eth0", None, None, "up")]
    # No /proc at all: nothing known, nothing invented.
    assert got.cpu.vendor is None and got.numa_nodes == () and got.gdr_module is None


def test_sysfs_peermem_from_sys_module(tmp_path: Path) -> None:
    """A peer-memory module compiled in shows in /sys/module, not in /proc/modules."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/modules").write_text("nvidia 1 0 - Live 0x0\n")
    assert SysfsReader(tmp_path).read().gdr_module is None
    (tmp_path / "sys/module/nv_peer_mem").mkdir(parents=True)
    assert SysfsReader(tmp_path).read().gdr_module == "nv_peer_mem"


# -- NVML reader: a stand-in binding built from each snapshot ----------------------------------


class FakeNVMLError(Exception):
    """pynvml's NVMLError: the NVML return code is in `.value`."""

    _NAMES: ClassVar[dict[int, str]] = {
        2: "Invalid Argument", 3: "Not Supported", 9: "Driver Not Loaded", 15: "GPU is lost",
    }

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._NAMES.get(self.value, f"NVML error {self.value}")


NOT_SUPPORTED = 3
INVALID_ARGUMENT = 2
GPU_LOST = 15
_P2P_CODES = {"ok": 0, "chipset_not_supported": 1, "gpu_not_supported": 2, "topology_not_supported": 3,
              "disabled_by_regkey": 4, "not_supported": 5, "unknown": 6}
_REMOTE_CODES = {"gpu": 0, "cpu": 1, "switch": 2}


def _nvml_bus_id(bus_id: str, legacy: bool = False) -> bytes:
    """NVML spells bus ids upper case, with an 8-digit domain (4 digits in busIdLegacy)."""
    domain, rest = bus_id.split(":", 1)
    width = 4 if legacy else 8
    return f"{int(domain, 16):0{width}X}:{rest.upper()}".encode()


class FakeNvml:
    """A pynvml stand-in answering from an NvmlSnapshot: None in the snapshot is NotSupported.

    `fail` maps a function name to the NVML error code it raises; `hook(name, args)` may return
    a code to raise for one particular call. Every call is recorded in `calls`.
    """

    NVMLError = FakeNVMLError

    def __init__(self, snap: NvmlSnapshot, *, fail: dict[str, int] | None = None,
                 hook: Callable[[str, tuple[Any, ...]], int | None] | None = None) -> None:
        self.snap = snap
        self.fail = fail or {}
        self.hook = hook
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.shutdowns = 0

    def _enter(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        if name in self.fail:
            raise FakeNVMLError(self.fail[name])
        if self.hook is not None:
            code = self.hook(name, args)
            if code is not None:
                raise FakeNVMLError(code)

    @staticmethod
    def _answer(value: Any) -> Any:
        if value is None:
            raise FakeNVMLError(NOT_SUPPORTED)
        return value

    # system
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return str(self._answer(self.snap.driver_version))

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return int(self._answer(self.snap.cuda_driver_version))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.nvmlSystemGetCudaDriverVersion_v2()

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._enter("nvmlSystemGetNVMLVersion")
        return str(self._answer(self.snap.nvml_version))

    # devices
    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.snap.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Gpu:
        self._enter("nvmlDeviceGetHandleByIndex", i)
        return self.snap.gpus[i]

    def nvmlDeviceGetPciInfo(self, h: Gpu) -> SimpleNamespace:
        self._enter("nvmlDeviceGetPciInfo", h)
        vendor = int(h.pci_vendor_id or "0", 16)
        device = int(h.pci_device_id or "0", 16)
        sub_vendor = int(h.pci_subsystem_vendor_id or "0", 16)
        sub_device = int(h.pci_subsystem_device_id or "0", 16)
        return SimpleNamespace(
            busId=_nvml_bus_id(h.bus_id), busIdLegacy=_nvml_bus_id(h.bus_id, legacy=True),
            pciDeviceId=(device << 16) | vendor, pciSubSystemId=(sub_device << 16) | sub_vendor,
        )

    def nvmlDeviceGetUUID(self, h: Gpu) -> str:
        self._enter("nvmlDeviceGetUUID", h)
        return h.uuid

    def nvmlDeviceGetName(self, h: Gpu) -> str:
        self._enter("nvmlDeviceGetName", h)
        return h.name

    def nvmlDeviceGetCudaComputeCapability(self, h: Gpu) -> tuple[int, ...]:
        self._enter("nvmlDeviceGetCudaComputeCapability", h)
        return tuple(self._answer(h.compute_capability))

    def nvmlDeviceGetMigMode(self, h: Gpu) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", h)
        mode = int(self._answer(h.mig_enabled))
        return [mode, mode]

    def nvmlDeviceGetMemoryInfo(self, h: Gpu) -> SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo", h)
        total = self._answer(h.memory_total_bytes)
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetNumaNodeId(self, h: Gpu) -> int:
        self._enter("nvmlDeviceGetNumaNodeId", h)
        return int(self._answer(h.numa_node))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: Gpu) -> int:
        self._enter("nvmlDeviceGetMaxPcieLinkGeneration", h)
        return int(self._answer(h.pcie_max_gen))

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: Gpu) -> int:
        self._enter("nvmlDeviceGetMaxPcieLinkWidth", h)
        return int(self._answer(h.pcie_max_width))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: Gpu) -> int:
        self._enter("nvmlDeviceGetCurrPcieLinkGeneration", h)
        return int(self._answer(h.pcie_cur_gen))

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: Gpu) -> int:
        self._enter("nvmlDeviceGetCurrPcieLinkWidth", h)
        return int(self._answer(h.pcie_cur_width))

    def nvmlDeviceGetCpuAffinity(self, h: Gpu, words: int) -> list[int]:
        """An array of 64-bit words, lowest CPUs first (c_ulong on Linux)."""
        self._enter("nvmlDeviceGetCpuAffinity", h, words)
        mask = [0] * words
        for cpu in cpus_from_cpulist(self._answer(h.cpu_affinity)):
            mask[cpu // 64] |= 1 << (cpu % 64)
        return mask

    def _link(self, h: Gpu, link: int) -> NvLink:
        found = next((n for n in h.nvlinks if n.link == link), None)
        if found is not None:
            return found
        # NVML: a GPU without NVLink answers NotSupported; an index past the GPU's last link
        # is an invalid argument.
        if h.nvlinks and link > max(n.link for n in h.nvlinks):
            raise FakeNVMLError(INVALID_ARGUMENT)
        raise FakeNVMLError(NOT_SUPPORTED)

    def nvmlDeviceGetNvLinkState(self, h: Gpu, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkState", h, link)
        return int(self._link(h, link).active)

    def nvmlDeviceGetNvLinkVersion(self, h: Gpu, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkVersion", h, link)
        return int(self._answer(self._link(h, link).version))

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, h: Gpu, link: int) -> SimpleNamespace:
        self._enter("nvmlDeviceGetNvLinkRemotePciInfo_v2", h, link)
        return SimpleNamespace(busId=_nvml_bus_id(self._answer(self._link(h, link).remote_bus_id)))

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: Gpu, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
        return _REMOTE_CODES[self._answer(self._link(h, link).remote_type)]

    def nvmlDeviceGetComputeRunningProcesses(self, h: Gpu) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetComputeRunningProcesses", h)
        return [SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_memory_bytes) for p in h.processes]

    def nvmlDeviceGetP2PStatus(self, a: Gpu, b: Gpu, cap: int) -> int:
        self._enter("nvmlDeviceGetP2PStatus", a, b, cap)
        i, j = sorted((a.index, b.index))
        pair = next(p for p in self.snap.p2p if (p.gpu_a, p.gpu_b) == (i, j))
        status = (pair.read, pair.write, pair.nvlink, pair.atomics)[cap]
        return _P2P_CODES[self._answer(status)]


def test_nvml_round_trip(snap: Snapshot) -> None:
    fake = FakeNvml(snap.nvml)
    assert NvmlReader(fake).read() == snap.nvml
    assert fake.shutdowns == 1


def _one_gpu(snap: Snapshot, **changes: Any) -> NvmlSnapshot:
    gpu = dataclasses.replace(snap.nvml.gpus[0], **changes)
    return dataclasses.replace(snap.nvml, gpus=(gpu,), p2p=())


def test_nvml_numa_and_affinity_answers_are_kept() -> None:
    nvml = _one_gpu(_load("hgx-h100-8gpu.json"), numa_node=0)
    gpu = NvmlReader(FakeNvml(nvml)).read().gpus[0]
    assert gpu.numa_node == 0
    assert gpu.cpu_affinity == "0-55,112-167"


def test_nvml_not_supported_numa_and_affinity_become_none() -> None:
    nvml = _one_gpu(_load("hgx-h100-8gpu.json"), numa_node=0)
    fake = FakeNvml(nvml, fail={"nvmlDeviceGetNumaNodeId": NOT_SUPPORTED,
                                "nvmlDeviceGetCpuAffinity": NOT_SUPPORTED})
    gpu = NvmlReader(fake).read().gpus[0]
    assert gpu.numa_node is None
    assert gpu.cpu_affinity is None
    # The rest of the GPU is still read.
    assert gpu.bus_id == "0000:1b:00.0" and gpu.memory_total_bytes == 81559 * 1024 * 1024


def test_nvml_negative_numa_and_old_binding_become_none() -> None:
    nvml = _one_gpu(_load("hgx-h100-8gpu.json"), numa_node=-1)
    assert NvmlReader(FakeNvml(nvml)).read().gpus[0].numa_node is None

    class OldBinding:
        """A binding from before nvmlDeviceGetNumaNodeId existed."""

        def __init__(self, inner: FakeNvml) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            if name == "nvmlDeviceGetNumaNodeId":
                raise AttributeError(name)
            return getattr(self._inner, name)

    old = OldBinding(FakeNvml(_one_gpu(_load("hgx-h100-8gpu.json"), numa_node=0)))
    assert not hasattr(old, "nvmlDeviceGetNumaNodeId")
    assert NvmlReader(old).read().gpus[0].numa_node is None


def test_nvml_invisible_nvswitch_bus_id_is_normalised() -> None:
    links = tuple(NvLink(link=i, active=True, version=6, remote_bus_id=INVISIBLE, remote_type="switch")
                  for i in range(18))
    fake = FakeNvml(_one_gpu(_load("hgx-h100-8gpu.json"), nvlinks=links))
    raw = fake.nvmlDeviceGetNvLinkRemotePciInfo_v2(fake.snap.gpus[0], 0).busId
    assert raw == b"FFFFFFFF:FF:FF.0"
    gpu = NvmlReader(fake).read().gpus[0]
    assert {n.remote_bus_id for n in gpu.nvlinks} == {INVISIBLE}
    assert len(gpu.nvlinks) == 18


def test_nvml_nvlink_indices_past_the_last_link_are_skipped() -> None:
    snap = _load("dgx-a100-8gpu.json")  # A100: 12 links, NVML probed for 18
    fake = FakeNvml(_one_gpu(snap))
    gpu = NvmlReader(fake).read().gpus[0]
    assert [n.link for n in gpu.nvlinks] == list(range(12))
    state_probes = [args[1] for name, args in fake.calls if name == "nvmlDeviceGetNvLinkState"]
    assert state_probes == list(range(18))
    # Nothing else is asked of a link that does not exist.
    asked = {args[1] for name, args in fake.calls if name.startswith("nvmlDeviceGetNvLink") and
             name != "nvmlDeviceGetNvLinkState"}
    assert asked == set(range(12))


def test_nvml_gpu_without_nvlink_has_none() -> None:
    gpu = NvmlReader(FakeNvml(_one_gpu(_load("pcie-4gpu-2socket.json")))).read().gpus[0]
    assert gpu.nvlinks == ()
    assert gpu.mig_enabled is None  # an L40S answers NotSupported for MIG


@pytest.mark.parametrize("code", [9, 12, 999])
def test_nvml_init_failure_is_unavailable(code: int) -> None:
    fake = FakeNvml(_load("hgx-h100-8gpu.json").nvml, fail={"nvmlInit": code})
    with pytest.raises(UnavailableError) as info:
        NvmlReader(fake).read()
    assert info.value.exit_code == EXIT_UNAVAILABLE == 69
    assert "NVML could not be initialised" in str(info.value)
    assert info.value.hint and "--demo" in info.value.hint
    assert [name for name, _ in fake.calls] == ["nvmlInit"]


def test_nvml_missing_library_is_unavailable() -> None:
    class NoLibrary(FakeNvml):
        def nvmlInit(self) -> None:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    with pytest.raises(UnavailableError) as info:
        NvmlReader(NoLibrary(NvmlSnapshot())).read()
    assert info.value.exit_code == 69


def test_nvml_gpu_lost_propagates() -> None:
    fake = FakeNvml(_load("hgx-h100-8gpu.json").nvml, fail={"nvmlDeviceGetMemoryInfo": GPU_LOST})
    with pytest.raises(FakeNVMLError) as info:
        NvmlReader(fake).read()
    assert info.value.value == GPU_LOST
    assert fake.shutdowns == 1  # NVML is shut down even when the read fails


def test_nvml_gpu_lost_on_a_no_answer_path_still_propagates() -> None:
    """Code 15 is not mistaken for "no answer" where None would otherwise be accepted."""

    def lost_on_link_3(name: str, args: tuple[Any, ...]) -> int | None:
        return GPU_LOST if name == "nvmlDeviceGetNvLinkState" and args[1] == 3 else None

    fake = FakeNvml(_one_gpu(_load("hgx-h100-8gpu.json")), hook=lost_on_link_3)
    with pytest.raises(FakeNVMLError) as info:
        NvmlReader(fake).read()
    assert info.value.value == GPU_LOST


@pytest.mark.parametrize(("code", "name"), [
    (0, "ok"), (1, "chipset_not_supported"), (2, "gpu_not_supported"), (3, "topology_not_supported"),
    (4, "disabled_by_regkey"), (5, "not_supported"), (6, "unknown"), (42, "status_42"),
])
def test_nvml_p2p_status_codes_map_to_names(code: int, name: str) -> None:
    nvml = dataclasses.replace(_load("pcie-2gpu-nvlink-bridge.json").nvml)

    class Status(FakeNvml):
        def nvmlDeviceGetP2PStatus(self, a: Gpu, b: Gpu, cap: int) -> int:
            self._enter("nvmlDeviceGetP2PStatus", a, b, cap)
            return code if cap == 0 else 0

    got = NvmlReader(Status(nvml)).read().p2p
    assert got == (P2PStatus(gpu_a=0, gpu_b=1, read=name, write="ok", nvlink="ok", atomics="ok"),)


def test_nvml_p2p_not_supported_query_is_none() -> None:
    nvml = _load("pcie-2gpu-nvlink-bridge.json").nvml
    fake = FakeNvml(nvml, hook=lambda name, args: NOT_SUPPORTED
                    if name == "nvmlDeviceGetP2PStatus" and args[2] == 3 else None)
    (pair,) = NvmlReader(fake).read().p2p
    assert (pair.read, pair.atomics) == ("ok", None)


# -- NVML busy check: one process query per GPU -------------------------------------------------


def _with_processes(nvml: NvmlSnapshot, by_gpu: dict[int, tuple[int, ...]]) -> NvmlSnapshot:
    gpus = tuple(dataclasses.replace(g, processes=tuple(GpuProcess(pid=p, used_memory_bytes=1 << 20)
                                                        for p in by_gpu.get(g.index, ())))
                 for g in nvml.gpus)
    return dataclasses.replace(nvml, gpus=gpus)


def test_compute_pids_asks_each_gpu_for_its_processes_and_nothing_else() -> None:
    fake = FakeNvml(_with_processes(_load("hgx-h100-8gpu.json").nvml, {1: (4242, 4343), 5: (77,)}))
    assert compute_pids([0, 1, 5], fake) == {0: (), 1: (4242, 4343), 5: (77,)}
    assert [name for name, _ in fake.calls] == [
        "nvmlInit",
        *(call for i in (0, 1, 5) for call in ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetComputeRunningProcesses")),
    ]
    assert fake.shutdowns == 1
    assert compute_pids([], FakeNvml(NvmlSnapshot())) == {}


def test_compute_pids_not_supported_lists_no_process() -> None:
    nvml = _with_processes(_load("pcie-2gpu-nvlink-bridge.json").nvml, {0: (10,), 1: (11,)})
    fake = FakeNvml(nvml, hook=lambda name, args: NOT_SUPPORTED
                    if name == "nvmlDeviceGetComputeRunningProcesses" and args[0].index == 0 else None)
    assert compute_pids([0, 1], fake) == {0: (), 1: (11,)}


def test_compute_pids_gpu_lost_propagates_and_init_failure_is_unavailable() -> None:
    nvml = _with_processes(_load("pcie-2gpu-nvlink-bridge.json").nvml, {0: (10,)})
    lost = FakeNvml(nvml, fail={"nvmlDeviceGetComputeRunningProcesses": GPU_LOST})
    with pytest.raises(FakeNVMLError) as info:
        compute_pids([0], lost)
    assert info.value.value == GPU_LOST
    assert lost.shutdowns == 1
    with pytest.raises(UnavailableError) as unavailable:
        compute_pids([0], FakeNvml(nvml, fail={"nvmlInit": 9}))
    assert unavailable.value.exit_code == EXIT_UNAVAILABLE


# -- procfs: the process tree -------------------------------------------------------------------


def _fake_proc(root: Path, entries: dict[str, str | None]) -> Path:
    """A /proc with one directory per entry; the stat line as given (None: no stat file)."""
    for name, stat in entries.items():
        (root / name).mkdir(parents=True)
        if stat is not None:
            (root / name / "stat").write_text(stat)
    return root


def test_procfs_descendants_from_a_fake_tree(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path / "proc", {
        "1": "1 (systemd) S 0 1 1 0 -1\n",
        "100": "100 (nccltune) S 1 100 100 0 -1\n",
        # a command name with spaces and parentheses: fields are counted from the last ')'
        "101": "101 (python3 (rank) 0) S 100 100 100 0 -1\n",
        "102": "102 (pt_main_thread) R 101 100 100 0 -1\n",
        "200": "200 (job) S 1 200 200 0 -1\n",
        "300": "300 (broken",  # truncated: skipped
        "301": None,  # exited between listing and reading
        "sys": None,  # not a process
    })
    assert parent_pids(proc) == {1: 0, 100: 1, 101: 100, 102: 101, 200: 1}
    assert descendants(100, proc) == {101, 102}
    assert descendants(1, proc) == {100, 101, 102, 200}
    assert descendants(102, proc) == set()
    assert descendants(100, tmp_path / "missing") == set()


def test_procfs_descendants_of_this_process_include_a_grandchild() -> None:
    child = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())
    try:
        found = descendants()
        assert {child.pid, grandchild} <= found
        assert os.getpid() not in found
        assert descendants(child.pid) >= {grandchild}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait(timeout=10)


# -- snapshot files ---------------------------------------------------------------------------


def test_topology_file_loads(snap_file: Path) -> None:
    snap = load_snapshot(snap_file)
    assert snap.schema_version == 1
    assert snap.description
    assert snap.nvml.gpus
    assert json.loads(snap_file.read_text())["kind"] == "nccltune-snapshot"


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_file_is_canonical(name: str) -> None:
    path = TOPOLOGY_DIR / name
    snap = load_snapshot(path)
    assert path.read_text() == snapshot_to_json(snap)
    assert snap.hostname is None and snap.recorded_at is None
    assert "synthetic snapshot built from public facts" in (snap.description or "")


def test_pci_ancestry_is_complete(snap: Snapshot) -> None:
    """Every bridge on a device's path is itself recorded, with what NCCL needs of it."""
    pci = {d.bus_id: d for d in snap.sysfs.pci}
    for dev in snap.sysfs.pci:
        assert dev.path[0].startswith("pci"), dev.bus_id
        assert dev.path[-1] == dev.bus_id
        for up in dev.path[1:-1]:
            assert up in pci, f"{dev.bus_id}: {up} missing"
            assert pci[up].class_code == "0x060400", up
        assert dev.vendor and dev.device, dev.bus_id
        assert dev.max_link_speed and dev.max_link_speed.endswith("GT/s PCIe"), dev.bus_id
        assert dev.max_link_width, dev.bus_id


def test_gpus_and_nics_are_pci_functions(snap: Snapshot) -> None:
    pci = {d.bus_id: d for d in snap.sysfs.pci}
    for gpu in snap.nvml.gpus:
        assert pci[gpu.bus_id].class_code.startswith("0x03")
        assert (pci[gpu.bus_id].vendor, pci[gpu.bus_id].device) == (gpu.pci_vendor_id, gpu.pci_device_id)
    for nic in snap.sysfs.nics:
        if nic.bus_id is not None:
            assert pci[nic.bus_id].class_code.startswith("0x02"), nic.name


def test_nvlink_targets_exist(snap: Snapshot) -> None:
    pci = {d.bus_id: d for d in snap.sysfs.pci}
    gpus = {g.bus_id: g for g in snap.nvml.gpus}
    for gpu in snap.nvml.gpus:
        for link in gpu.nvlinks:
            if link.remote_type == "switch" and link.remote_bus_id != INVISIBLE:
                assert pci[link.remote_bus_id or ""].class_code == "0x068000"
            elif link.remote_type == "gpu":
                peer = gpus[link.remote_bus_id or ""]
                back = sum(1 for n in peer.nvlinks if n.remote_bus_id == gpu.bus_id)
                mine = sum(1 for n in gpu.nvlinks if n.remote_bus_id == peer.bus_id)
                assert back == mine


def test_p2p_covers_every_pair(snap: Snapshot) -> None:
    n = len(snap.nvml.gpus)
    assert [(p.gpu_a, p.gpu_b) for p in snap.nvml.p2p] == [(i, j) for i in range(n) for j in range(i + 1, n)]


def test_numa_cpusets_agree(snap: Snapshot) -> None:
    seen: list[int] = []
    for node in snap.sysfs.numa_nodes:
        cpus = cpus_from_cpulist(node.cpulist)
        assert sorted(cpus_from_cpumask(node.cpumap)) == cpus
        seen += cpus
    assert sorted(seen) == list(range(snap.sysfs.cpu.logical_cpus or 0))
    nodes = {n.id: n for n in snap.sysfs.numa_nodes}
    pci = {d.bus_id: d for d in snap.sysfs.pci}
    for gpu in snap.nvml.gpus:
        numa = pci[gpu.bus_id].numa_node
        if numa is not None:
            assert gpu.cpu_affinity == nodes[numa].cpulist, gpu.bus_id


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "snap.json"
    path.write_text(text)
    return path


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, '{\n  "kind": "nccltune-snapshot",\n  "nvml": {,\n  "sysfs": {}\n}\n')
    with pytest.raises(InputError) as info:
        load_snapshot(path)
    assert info.value.exit_code == EXIT_CONFIG == 78
    assert info.value.line == 3
    assert f"{path}:3:" in str(info.value)


def test_unreadable_file_names_file(tmp_path: Path) -> None:
    with pytest.raises(InputError) as info:
        load_snapshot(tmp_path / "missing.json")
    assert str(tmp_path / "missing.json") in str(info.value)
    assert info.value.exit_code == 78


def _doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((TOPOLOGY_DIR / "pcie-2gpu-nvlink-bridge.json").read_text())
    return doc


def test_unknown_key_is_named(tmp_path: Path) -> None:
    doc = _doc()
    doc["sysfs"]["pci"][0]["bogus_field"] = 1
    path = _write(tmp_path, json.dumps(doc, indent=2))
    with pytest.raises(InputError) as info:
        load_snapshot(path)
    assert info.value.exit_code == 78
    assert "bogus_field" in str(info.value)
    assert "$.sysfs.pci[0]" in str(info.value)
    assert str(path) in str(info.value)


def test_unknown_schema_version_is_named(tmp_path: Path) -> None:
    doc = _doc()
    doc["schema_version"] = 99
    path = _write(tmp_path, json.dumps(doc))
    with pytest.raises(InputError) as info:
        load_snapshot(path)
    assert info.value.exit_code == 78
    assert "schema_version 99" in str(info.value)
    assert str(path) in str(info.value)


def test_wrong_kind_and_wrong_type_are_input_errors(tmp_path: Path) -> None:
    doc = _doc()
    doc["kind"] = "something-else"
    with pytest.raises(InputError, match="not an nccltune snapshot"):
        load_snapshot(_write(tmp_path, json.dumps(doc)))
    doc = _doc()
    doc["nvml"]["gpus"][0]["index"] = "zero"
    with pytest.raises(InputError, match=r"\$\.nvml\.gpus\[0\]\.index"):
        load_snapshot(_write(tmp_path, json.dumps(doc)))
