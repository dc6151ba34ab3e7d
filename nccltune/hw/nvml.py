"""NVML reader: the only module that imports pynvml (from the nvidia-ml-py distribution).

Every field NVML answers with NotSupported (or a similar "cannot tell") becomes None on that
field; the reference VM, for one, answers NotSupported for the NUMA node and reports its
NVSwitch as bus id FFFFFFFF:FF:FF.0. A missing library or driver raises UnavailableError
(exit 69) with a hint. The binding is injectable so that the mapping logic can be exercised
without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ..errors import UnavailableError
from .cpuset import cpulist_from_cpus
from .types import Gpu, GpuProcess, NvLink, NvmlSnapshot, P2PStatus, normalize_bus_id

log = logging.getLogger(__name__)

T = TypeVar("T")

# NVML constants, spelled out so the reader does not depend on a particular binding version.
_NVLINK_MAX_LINKS = 18
_P2P_CAPS = {"read": 0, "write": 1, "nvlink": 2, "atomics": 3}
_P2P_STATUS = {
    0: "ok",
    1: "chipset_not_supported",
    2: "gpu_not_supported",
    3: "topology_not_supported",
    4: "disabled_by_regkey",
    5: "not_supported",
    6: "unknown",
}
_REMOTE_TYPES = {0: "gpu", 1: "cpu", 2: "switch"}
# NVML return codes that mean "no answer for this field" rather than "the node is broken".
_NO_ANSWER = {
    2,  # NVML_ERROR_INVALID_ARGUMENT (e.g. an NVLink index past the last link)
    3,  # NVML_ERROR_NOT_SUPPORTED
    4,  # NVML_ERROR_NO_PERMISSION
    6,  # NVML_ERROR_NOT_FOUND
    13,  # NVML_ERROR_FUNCTION_NOT_FOUND (older driver)
    999,  # NVML_ERROR_UNKNOWN
}
_GPU_LOST = 15


def _load_binding() -> Any:
    try:
        import pynvml  # the one import of pynvml (the import contract in pyproject.toml checks it)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise UnavailableError(
            "the pynvml module is not installed",
            hint="install the nvidia-ml-py distribution (pip install nvidia-ml-py)",
        ) from exc
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Reads one frozen NvmlSnapshot. Use as `NvmlReader().read()`.

    Raises (from read):
        UnavailableError: NVML cannot be loaded or initialised (no driver, no GPU).
    """

    def __init__(self, binding: Any | None = None) -> None:
        # Any, not Any | None: read() loads the binding before any other method touches it.
        self._nvml: Any = binding

    def _call(self, fn: Callable[..., T], *args: Any) -> T | None:
        """Call an NVML function, turning "no answer" errors into None."""
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == _GPU_LOST:
                raise
            if code in _NO_ANSWER or code is None:
                log.debug("NVML %s%r: %s", getattr(fn, "__name__", fn), args[1:], exc)
                return None
            raise

    @contextlib.contextmanager
    def _initialised(self) -> Iterator[Any]:
        """NVML initialised for the body, shut down after it; yields the binding."""
        if self._nvml is None:
            self._nvml = _load_binding()
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise UnavailableError(
                f"NVML could not be initialised: {exc}",
                hint="is the NVIDIA driver loaded on this node? On a machine without GPUs, "
                "use --demo (or --input SNAPSHOT for topology commands)",
            ) from exc
        except OSError as exc:  # library file missing on some bindings
            raise UnavailableError(f"NVML library not found: {exc}", hint="use --demo") from exc
        try:
            yield nvml
        finally:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()

    def read(self) -> NvmlSnapshot:
        with self._initialised():
            return self._read_initialised()

    def compute_pids(self, indices: Iterable[int]) -> dict[int, tuple[int, ...]]:
        """GPU index -> pids of its compute processes: one running-processes query per GPU.

        The busy check while trials run needs nothing else, so it skips the links, the P2P
        matrix and the PCI facts that read() gathers. A GPU that does not answer the query
        (NotSupported) lists no process; a lost GPU raises the binding's NVMLError.
        """
        with self._initialised() as nvml:
            return {i: tuple(p.pid for p in self._processes(nvml.nvmlDeviceGetHandleByIndex(i)))
                    for i in indices}

    def _read_initialised(self) -> NvmlSnapshot:
        nvml = self._nvml
        driver = self._call(nvml.nvmlSystemGetDriverVersion)
        cuda = self._call(getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", None)
                          or nvml.nvmlSystemGetCudaDriverVersion)
        nvml_version = self._call(nvml.nvmlSystemGetNVMLVersion)
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus = tuple(self._read_gpu(i, h) for i, h in enumerate(handles))
        p2p = tuple(
            self._read_p2p(i, j, handles[i], handles[j])
            for i in range(count)
            for j in range(count)
            if i < j
        )
        return NvmlSnapshot(
            driver_version=_text(driver) if driver is not None else None,
            cuda_driver_version=int(cuda) if cuda is not None else None,
            nvml_version=_text(nvml_version) if nvml_version is not None else None,
            gpus=gpus,
            p2p=p2p,
        )

    def _read_gpu(self, index: int, h: Any) -> Gpu:
        nvml = self._nvml
        pci = nvml.nvmlDeviceGetPciInfo(h)
        bus_id = normalize_bus_id(_text(getattr(pci, "busIdLegacy", None) or pci.busId))
        dev_id = int(pci.pciDeviceId)
        subsys = int(pci.pciSubSystemId)
        cc = self._call(nvml.nvmlDeviceGetCudaComputeCapability, h)
        mig = self._call(nvml.nvmlDeviceGetMigMode, h)
        mem = self._call(nvml.nvmlDeviceGetMemoryInfo, h)
        numa = self._call(getattr(nvml, "nvmlDeviceGetNumaNodeId", _unsupported(nvml)), h)
        return Gpu(
            index=index,
            uuid=_text(nvml.nvmlDeviceGetUUID(h)),
            name=_text(nvml.nvmlDeviceGetName(h)),
            bus_id=bus_id,
            pci_vendor_id=f"0x{dev_id & 0xFFFF:04x}",
            pci_device_id=f"0x{dev_id >> 16:04x}",
            pci_subsystem_vendor_id=f"0x{subsys & 0xFFFF:04x}",
            pci_subsystem_device_id=f"0x{subsys >> 16:04x}",
            compute_capability=tuple(int(x) for x in cc) if cc is not None else None,
            pcie_max_gen=self._call(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
            pcie_max_width=self._call(nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
            pcie_cur_gen=self._call(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
            pcie_cur_width=self._call(nvml.nvmlDeviceGetCurrPcieLinkWidth, h),
            numa_node=int(numa) if numa is not None and int(numa) >= 0 else None,
            cpu_affinity=self._cpu_affinity(h),
            mig_enabled=bool(mig[0]) if mig is not None else None,
            memory_total_bytes=int(mem.total) if mem is not None else None,
            nvlinks=self._nvlinks(h),
            processes=self._processes(h),
        )

    def _cpu_affinity(self, h: Any) -> str | None:
        words = 16  # 16 x 64 bits covers 1024 logical CPUs
        mask = self._call(self._nvml.nvmlDeviceGetCpuAffinity, h, words)
        if mask is None:
            return None
        cpus = [w * 64 + b for w, word in enumerate(mask) for b in range(64) if (int(word) >> b) & 1]
        return cpulist_from_cpus(cpus) if cpus else None

    def _nvlinks(self, h: Any) -> tuple[NvLink, ...]:
        nvml = self._nvml
        links = []
        for link in range(_NVLINK_MAX_LINKS):
            state = self._call(nvml.nvmlDeviceGetNvLinkState, h, link)
            if state is None:
                continue
            remote = self._call(
                getattr(nvml, "nvmlDeviceGetNvLinkRemotePciInfo_v2", None)
                or nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
            rtype = self._call(
                getattr(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", _unsupported(nvml)), h, link)
            remote_bus = None
            if remote is not None:
                try:
                    remote_bus = normalize_bus_id(_text(remote.busId))
                except ValueError:
                    remote_bus = None
            links.append(NvLink(
                link=link,
                active=bool(state),
                version=self._call(nvml.nvmlDeviceGetNvLinkVersion, h, link),
                remote_bus_id=remote_bus,
                remote_type=_REMOTE_TYPES.get(int(rtype)) if rtype is not None else None,
            ))
        return tuple(links)

    def _processes(self, h: Any) -> tuple[GpuProcess, ...]:
        procs = self._call(self._nvml.nvmlDeviceGetComputeRunningProcesses, h) or []
        out = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            out.append(GpuProcess(pid=int(p.pid), used_memory_bytes=int(used) if used is not None else None))
        return tuple(out)

    def _read_p2p(self, i: int, j: int, hi: Any, hj: Any) -> P2PStatus:
        status = {}
        for name, cap in _P2P_CAPS.items():
            code = self._call(self._nvml.nvmlDeviceGetP2PStatus, hi, hj, cap)
            status[name] = _P2P_STATUS.get(int(code), f"status_{code}") if code is not None else None
        return P2PStatus(gpu_a=i, gpu_b=j, **status)


def _unsupported(nvml: Any) -> Callable[..., Any]:
    """Stand-in for an NVML function this binding lacks: answers like NotSupported."""

    def fn(*_args: Any) -> Any:
        raise nvml.NVMLError(3)

    return fn


def read_nvml(binding: Any | None = None) -> NvmlSnapshot:
    """Read this node through NVML. See NvmlReader."""
    return NvmlReader(binding).read()


def compute_pids(indices: Iterable[int], binding: Any | None = None) -> dict[int, tuple[int, ...]]:
    """The compute processes on each GPU of `indices` (NVML indices). See NvmlReader.compute_pids.

    Raises:
        UnavailableError: NVML cannot be loaded or initialised.
    """
    return NvmlReader(binding).compute_pids(indices)
