"""`nccltune doctor`: settings and node state that make NCCL slow, fragile or silently wrong.

Each finding has a severity (error, warning, info), a stable code, what was seen, and a fix.
It looks at the calling environment, NCCL's conf files, what nccltune published, and the node
(NVLink and PCIe state, whether the published topology still matches).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .publish import read_published
from .sweep.plan import ll128_auto
from .sweep.space import CATALOGUE, level_of
from .topology.fingerprint import topology_fingerprint
from .topology.model import Topology
from .topology.paths import PathMatrix
from .trust import trusted_uids, writable_word

SEVERITIES = ("error", "warning", "info")
# NCCL loads this file silently when NCCL_TOPO_FILE is unset (topo.cc, since at least 2.12).
NVIDIA_TOPOLOGYD_FILE = "/var/run/nvidia-topologyd/virtualTopology.xml"


@dataclass(frozen=True)
class Finding:
    severity: str
    code: str
    message: str
    fix: str


def read_conf_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines the way NCCL reads them (no trimming, `#` only at line start).

    Lines end at '\n' only, as with NCCL's getline(): a CRLF file leaves '\r' in every value
    (a NCCL_TOPO_FILE that then does not exist), which universal newlines and str.splitlines() would hide.
    """
    out: dict[str, str] = {}
    try:
        text = path.read_bytes().decode(errors="replace")  # no newline translation
    except OSError:
        return out
    for line in text.split("\n"):
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, value)
    return out


def diagnose(
    topo: Topology,
    paths: PathMatrix,
    *,
    env: Mapping[str, str],
    publish_dir: Path,
    conf_files: list[Path],
    topologyd_file: Path = Path(NVIDIA_TOPOLOGYD_FILE),
) -> list[Finding]:
    f: list[Finding] = []
    nvlink_pairs = [(a, b) for (a, b), p in paths.gpu_gpu.items() if a < b and p.type in ("NVL", "NVB")]
    conf: dict[str, tuple[str, Path]] = {}
    for path in conf_files:
        for key, value in read_conf_file(path).items():
            conf.setdefault(key, (value, path))

    def setting(name: str) -> tuple[str, str] | None:
        if name in env:
            return env[name], "the environment"
        if name in conf:
            return conf[name][0], str(conf[name][1])
        return None

    p2p_disable = setting("NCCL_P2P_DISABLE")
    p2p_level = setting("NCCL_P2P_LEVEL")
    if nvlink_pairs and p2p_disable and p2p_disable[0] == "1":
        f.append(Finding("error", "p2p-disabled", f"NCCL_P2P_DISABLE=1 (from {p2p_disable[1]}) on a node whose GPUs "
                         "are joined by NVLink: all-reduce goes through host memory (about 12x slower on the 2x "
                         "H200 reference node: 27.5 vs 345 GB/s)",
                         "unset NCCL_P2P_DISABLE; if P2P hangs, fix ACS/IOMMU"))
    if nvlink_pairs and p2p_level and level_of(p2p_level[0]) == "LOC":
        f.append(Finding("error", "p2p-level-loc", f"NCCL_P2P_LEVEL={p2p_level[0]} (from {p2p_level[1]}) turns P2P "
                         "off between NVLink-connected GPUs", "unset NCCL_P2P_LEVEL"))
    shm = setting("NCCL_SHM_DISABLE")
    if shm and shm[0] == "1":
        f.append(Finding("warning", "shm-disabled", f"NCCL_SHM_DISABLE=1 (from {shm[1]}): pairs without P2P then "
                         "go through the network stack", "unset NCCL_SHM_DISABLE"))
    ib_disable = setting("NCCL_IB_DISABLE")
    if ib_disable and ib_disable[0] == "1" and any(n.kind == "ib" for n in topo.nics):
        f.append(Finding("warning", "ib-disabled", f"NCCL_IB_DISABLE=1 (from {ib_disable[1]}) although RDMA NICs "
                         f"are present ({', '.join(n.name for n in topo.nics if n.kind == 'ib')}): inter-node "
                         "traffic falls back to sockets", "unset NCCL_IB_DISABLE"))
    for name, tunable in CATALOGUE.items():
        got = setting(name)
        if got is None:
            continue
        problem = tunable.validate(got[0])
        if problem:
            f.append(Finding("error", "invalid-value", f"{name} from {got[1]}: {problem}",
                             f"fix or unset {name}"))
    proto = setting("NCCL_PROTO")
    if proto:
        tokens = {t.strip().lower() for part in proto[0].split(";") for t in part.split(":")[-1].split(",")}
        if "ll128" in tokens and not proto[0].lstrip().startswith("^"):
            auto = ll128_auto(topo, paths)
            f.append(Finding("warning" if auto else "error", "explicit-ll128",
                             f"NCCL_PROTO={proto[0]} (from {proto[1]}) names LL128, which bypasses NCCL's checks; "
                             + ("NCCL would enable it here anyway" if auto else
                                "NCCL would not enable it on this topology (data corruption risk where data "
                                "transits the CPU)"), "remove LL128 from NCCL_PROTO and let NCCL decide"))
    old_aeh = env.get("NCCL_ASYNC_ERROR_HANDLING")
    if old_aeh is not None:
        both = "TORCH_NCCL_ASYNC_ERROR_HANDLING" in env
        f.append(Finding("warning", "deprecated-async-error-handling",
                         "NCCL_ASYNC_ERROR_HANDLING is deprecated since torch 2.2"
                         + (" and TORCH_NCCL_ASYNC_ERROR_HANDLING, also set, wins over it" if both else ""),
                         "use TORCH_NCCL_ASYNC_ERROR_HANDLING only"))
    debug = setting("NCCL_DEBUG")
    if debug and debug[0].upper() in ("INFO", "TRACE"):
        f.append(Finding("warning", "debug-on", f"NCCL_DEBUG={debug[0]} (from {debug[1]}) left on: logging on every "
                         "collective costs host time and fills logs", "unset NCCL_DEBUG or set it to WARN"))
    for key, (value, path) in conf.items():
        if key == "NCCL_GRAPH_FILE":
            f.append(Finding("error", "graph-file-in-conf", f"NCCL_GRAPH_FILE={value} in {path} applies to every "
                             "communicator, also those of another GPU count (NVIDIA/nccl#1008)",
                             f"remove NCCL_GRAPH_FILE from {path}"))
        if key == "NCCL_TOPO_FILE" and not Path(value).exists():
            f.append(Finding("error", "stale-topo-file", f"NCCL_TOPO_FILE={value} in {path} does not exist: NCCL "
                             "silently falls back to auto-detection", f"remove it from {path} or run nccltune sweep"))
    graph_env = env.get("NCCL_GRAPH_FILE")
    if graph_env:
        f.append(Finding("warning", "graph-file", f"NCCL_GRAPH_FILE={graph_env} in the environment: for debugging "
                         "only", "unset NCCL_GRAPH_FILE"))
    if "NCCL_TOPO_FILE" not in env and "NCCL_TOPO_FILE" not in conf and topologyd_file.exists():
        f.append(Finding("info", "topologyd-file", f"{topologyd_file} exists: NCCL loads it whenever NCCL_TOPO_FILE "
                         "is unset", "make sure it describes this node"))

    published = _published(publish_dir, f)
    if published is not None:
        pub_env, prov = published
        for name, value in pub_env.items():
            if name in env and env[name] != value:
                f.append(Finding("warning", "env-overrides-published", f"{name}={env[name]} in the environment "
                                 f"differs from the published {value}", f"unset {name}, or re-run nccltune sweep"))
        fp = topology_fingerprint(topo)
        if prov.get("topology_fingerprint") not in (None, fp):
            f.append(Finding("error", "published-topology-stale", f"the published tuning was measured on topology "
                             f"{prov.get('topology_fingerprint')}, this node is now {fp}",
                             "run nccltune sweep (the daemon does this by itself)"))
        if prov.get("demo"):
            f.append(Finding("error", "published-demo", f"the environment published in {publish_dir} comes from a "
                             "CPU demo, not from NCCL measurements", "run nccltune sweep on the GPUs"))
        topo_file = pub_env.get("NCCL_TOPO_FILE")
        if topo_file and not Path(topo_file).exists():
            f.append(Finding("error", "published-topo-missing", f"the published NCCL_TOPO_FILE {topo_file} is missing",
                             "run nccltune sweep"))
    for g in topo.gpus:
        if g.nvlinks_total and g.nvlinks_active < g.nvlinks_total:
            f.append(Finding("error", "nvlink-inactive", f"GPU{g.index} ({g.bus_id}): only {g.nvlinks_active} of "
                             f"{g.nvlinks_total} NVLinks are active", "check the NVLink/NVSwitch fabric "
                             "(nvidia-smi nvlink -s, fabric manager)"))
        if g.pcie_max_width and g.pcie_cur_width and g.pcie_cur_width < g.pcie_max_width:
            f.append(Finding("warning", "pcie-width", f"GPU{g.index} ({g.bus_id}) runs PCIe x{g.pcie_cur_width} of "
                             f"x{g.pcie_max_width}", "reseat the card or check the riser/slot"))
        if g.pcie_max_gen and g.pcie_cur_gen and g.pcie_cur_gen < g.pcie_max_gen:
            f.append(Finding("info", "pcie-gen", f"GPU{g.index} ({g.bus_id}) links at PCIe Gen{g.pcie_cur_gen} of "
                             f"Gen{g.pcie_max_gen} (normal when idle; a problem under load)",
                             "check again under load (nvidia-smi -q -d PCIE)"))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(f, key=lambda x: order[x.severity])


def _published(publish_dir: Path, f: list[Finding]) -> tuple[dict[str, str], dict[str, object]] | None:
    """Read the published set as launchers do; owner/mode problems, a mixed set and a corrupt file
    are findings. The files are judged through the well-known names (links into ``current``)."""
    untrusted = False
    for name in ("nccl.sh", "nccl.env", "nccl.json", "nccl-single-node.sh", "nccl-single-node.env"):
        path = publish_dir / name
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_uid not in trusted_uids() or (st.st_uid != 0 and os.geteuid() == 0):
            untrusted = True
            f.append(Finding("error", "published-owner", f"{path} is owned by uid {st.st_uid}, not root: whoever "
                             "owns it can change what every job sources", f"chown root:root {path}"))
        word = writable_word(st.st_mode)
        if word is not None:
            untrusted = True
            f.append(Finding("error", "published-writable", f"{path} is {word} "
                             f"(mode {st.st_mode & 0o777:o}): others can change what every job sources",
                             f"chmod 644 {path}"))
    if untrusted:
        return None  # nccltune env/exec and the launchers refuse it; its content is not to be judged
    try:
        got = read_published(publish_dir)
    except Exception as exc:
        if "mixed" in str(exc):
            f.append(Finding("error", "published-mixed", f"the files published in {publish_dir} are not one "
                             f"set: {exc}", "run nccltune sweep"))
        else:
            f.append(Finding("error", "published-corrupt", f"cannot read what is published in {publish_dir}: {exc}",
                             "run nccltune sweep"))
        return None
    return got


def default_conf_files(env: Mapping[str, str]) -> list[Path]:
    """NCCL's order: NCCL_CONF_FILE (2.23+) or ~/.nccl.conf, then /etc/nccl.conf."""
    first = env.get("NCCL_CONF_FILE") or (str(Path(env.get("HOME", "/root")) / ".nccl.conf"))
    return [Path(first), Path("/etc/nccl.conf")]
