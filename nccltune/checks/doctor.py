"""`nccltune doctor`: settings and node state that make NCCL slow, fragile or silently wrong.

Each finding has a severity (error, warning, info), a stable code, what was seen, and a fix.
It looks at the calling environment, NCCL's conf files, what nccltune published, and the node
(NVLink and PCIe state, whether the published topology still matches).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..compare import upgrade_check
from ..delivery.jobenv import decide
from ..files.trust import trusted_uids, writable_word
from ..nccl.site import ConfSetting, SiteTuner, conf_settings, conf_text
from ..nccl.sitetuner import existing_tuner
from ..publish import read_published
from ..store import Store
from ..sweep.plan import ll128_auto
from ..sweep.space import CATALOGUE, level_of
from ..sweep.variables import did_you_mean
from ..sweep.variables import unknown as unknown_variable
from ..topology.fingerprint import topology_fingerprint
from ..topology.links import RANK
from ..topology.model import Topology
from ..topology.paths import PathMatrix
from ..tuner.build import find_compiler, prebuilt_plugin

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
    text = conf_text(path)  # bounded, no newline translation
    if text is None:
        return out
    for line in text.split("\n"):
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, value)
    return out


def site_settings_finding(site: Mapping[str, ConfSetting]) -> Finding | None:
    """What the site's NCCL conf files already give every job (nccltune's own block left out): kept
    as pins, never swept and never published over (the environment would beat the file in NCCL)."""
    tuned = {name: c for name, c in site.items() if name.startswith(("NCCL_", "TORCH_NCCL_"))}
    if not tuned:
        return None
    listed = ", ".join(f"{name} ({c.path})" for name, c in sorted(tuned.items()))
    return Finding("info", "site-settings", f"the site's NCCL conf files set {listed}; nccltune keeps them "
                   "(pinned: never swept, never published over)", "sweep.unpin NAME to tune one anyway")


def plugin_finding() -> Finding | None:
    """Which nccltune tuner plugin this node would publish, when it is not the usual one compiled
    here: the package's prebuilt library, or none at all (no compiler, no prebuilt one that fits)."""
    prebuilt, why = prebuilt_plugin()
    if prebuilt is not None:
        return Finding("info", "tuner-plugin-prebuilt", f"nccltune's tuner plugin is the one {why}", "")
    if find_compiler() is None:
        return Finding("info", "tuner-plugin-unavailable", "no C compiler (cc, gcc or clang) on PATH and "
                       f"{why[0].lower()}{why[1:]}: nccltune's per-size tuner table cannot be active here",
                       "install a C compiler, or nccltune from a wheel built with one")
    return None


def tuner_finding(existing: SiteTuner | None, mode: str) -> Finding | None:
    """What doctor (and the plan) say about a tuner that is already set, under config tuner.plugin."""
    if existing is None:
        return None
    if existing.named and existing.value.lower() == "none":
        what = f"{existing.describe()} turns NCCL's tuner plugins off"
    elif existing.named:
        what = f"{existing.describe()} already names a tuner"
    else:
        what = f"NCCL loads {existing.describe()}"
    if mode == "nccltune":
        return Finding("warning", "tuner-plugin-replaced", f"{what}; tuner.plugin is nccltune, so nccltune's "
                       "published environment REPLACES it with its own tuner", "set tuner.plugin: auto or keep "
                       "to keep the existing tuner")
    return Finding("info", "tuner-plugin-kept", f"{what}; tuner.plugin is {mode}, so it is kept and nccltune's "
                   "per-size tuner table is not active", "set tuner.plugin: nccltune to use nccltune's table instead")


class _Settings:
    """What NCCL would read for a variable: the environment first, then the first conf file that
    sets it, each with where it came from."""

    def __init__(self, env: Mapping[str, str], conf_files: list[Path]) -> None:
        self.env = env
        self.conf: dict[str, tuple[str, Path]] = {}
        for path in conf_files:
            for key, value in read_conf_file(path).items():
                self.conf.setdefault(key, (value, path))

    def get(self, name: str) -> tuple[str, str] | None:
        if name in self.env:
            return self.env[name], "the environment"
        if name in self.conf:
            return self.conf[name][0], str(self.conf[name][1])
        return None

    def where(self, name: str) -> str:
        return "the environment" if name in self.env else str(self.conf[name][1])


def diagnose(
    topo: Topology,
    paths: PathMatrix,
    *,
    env: Mapping[str, str],
    publish_dir: Path,
    conf_files: list[Path],
    topologyd_file: Path = Path(NVIDIA_TOPOLOGYD_FILE),
    tuner_mode: str = "auto",
    interfaces: list[str] | None = None,
) -> list[Finding]:
    """What is wrong or worth knowing about NCCL on this node. `interfaces` are the node's network
    interfaces (the kernel's list where None), for NCCL_SOCKET_IFNAME."""
    f = _plugin_findings(env, conf_files, tuner_mode)
    settings = _Settings(env, conf_files)
    f += _p2p_findings(topo, paths, settings)
    f += _transport_findings(topo, settings)
    f += _variable_findings(settings)
    f += _setting_findings(topo, paths, settings, interfaces)
    f += _file_findings(settings, topologyd_file)
    f += _published_findings(topo, publish_dir, env, f)
    f += _hardware_findings(topo)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(f, key=lambda x: order[x.severity])


def _plugin_findings(env: Mapping[str, str], conf_files: list[Path], tuner_mode: str) -> list[Finding]:
    """The tuner NCCL would load, what the site's conf files pin, and nccltune's own plugin."""
    tuner = tuner_finding(existing_tuner(env, conf_files), tuner_mode)
    site = site_settings_finding(conf_settings(env, conf_files))
    plugin = plugin_finding() if tuner is None and tuner_mode != "keep" else None
    return [x for x in (tuner, site, plugin) if x is not None]


def _p2p_findings(topo: Topology, paths: PathMatrix, s: _Settings) -> list[Finding]:
    """NCCL_P2P_DISABLE and NCCL_P2P_LEVEL against the GPU pairs that would use P2P."""
    f: list[Finding] = []
    nvlink_pairs = [(a, b) for (a, b), p in paths.gpu_gpu.items() if a < b and p.type in ("NVL", "NVB")]
    p2p_disable = s.get("NCCL_P2P_DISABLE")
    p2p_level = s.get("NCCL_P2P_LEVEL")
    if nvlink_pairs and p2p_disable and p2p_disable[0] == "1":
        f.append(Finding("error", "p2p-disabled", f"NCCL_P2P_DISABLE=1 (from {p2p_disable[1]}) on a node whose GPUs "
                         "are joined by NVLink: all-reduce goes through host memory (about 12x slower on the 2x "
                         "H200 reference node: 27.5 vs 345 GB/s)",
                         "unset NCCL_P2P_DISABLE; if P2P hangs, fix ACS/IOMMU"))
    if nvlink_pairs and p2p_level and level_of(p2p_level[0]) == "LOC":
        f.append(Finding("error", "p2p-level-loc", f"NCCL_P2P_LEVEL={p2p_level[0]} (from {p2p_level[1]}) turns P2P "
                         "off between NVLink-connected GPUs", "unset NCCL_P2P_LEVEL"))
    lost = [] if p2p_level is None else _p2p_pairs_lost(topo, paths, p2p_level[0])
    # LOC on an NVLink node is the error above; the rest is what the level costs on this topology.
    if p2p_level is not None and lost and not (nvlink_pairs and level_of(p2p_level[0]) == "LOC"):
        f.append(Finding("warning", "p2p-level-off", f"NCCL_P2P_LEVEL={p2p_level[0]} (from {p2p_level[1]}) turns P2P "
                         f"off for {len(lost)} GPU pair(s) that would use it by default ("
                         + ", ".join(f"GPU{a}-GPU{b} {t}" for a, b, t in lost[:8])
                         + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
                         + "): their traffic goes through host memory instead",
                         "unset NCCL_P2P_LEVEL (NCCL's default uses P2P up to PXB)"))
    return f


def _transport_findings(topo: Topology, s: _Settings) -> list[Finding]:
    """Shared memory or RDMA turned off where the node has a use for them."""
    f: list[Finding] = []
    shm = s.get("NCCL_SHM_DISABLE")
    if shm and shm[0] == "1":
        f.append(Finding("warning", "shm-disabled", f"NCCL_SHM_DISABLE=1 (from {shm[1]}): pairs without P2P then "
                         "go through the network stack", "unset NCCL_SHM_DISABLE"))
    ib_disable = s.get("NCCL_IB_DISABLE")
    if ib_disable and ib_disable[0] == "1" and any(n.kind == "ib" for n in topo.nics):
        f.append(Finding("warning", "ib-disabled", f"NCCL_IB_DISABLE=1 (from {ib_disable[1]}) although RDMA NICs "
                         f"are present ({', '.join(n.name for n in topo.nics if n.kind == 'ib')}): inter-node "
                         "traffic falls back to sockets", "unset NCCL_IB_DISABLE"))
    return f


def _variable_findings(s: _Settings) -> list[Finding]:
    """Values the catalogue refuses, and names NCCL does not read."""
    f: list[Finding] = []
    for name, tunable in CATALOGUE.items():
        got = s.get(name)
        if got is None:
            continue
        problem = tunable.validate(got[0])
        if problem:
            f.append(Finding("error", "invalid-value", f"{name} from {got[1]}: {problem}",
                             f"fix or unset {name}"))
    for name in sorted({*s.env, *s.conf}):
        if unknown_variable(name):
            hint = did_you_mean(name)
            f.append(Finding("warning", "unknown-variable",
                             f"{name} (from {s.where(name)}) is not a variable NCCL reads: NCCL ignores it"
                             + (f"; did you mean {hint}?" if hint else ""),
                             f"rename it to {hint}" if hint else f"unset {name}, or check its spelling"))
    return f


def _setting_findings(topo: Topology, paths: PathMatrix, s: _Settings,
                      interfaces: list[str] | None) -> list[Finding]:
    """Settings that stop NCCL, risk wrong results or cost time: the socket interface, LL128 named
    outright, the deprecated error-handling variable, debug logging left on."""
    f: list[Finding] = []
    ifname = s.get("NCCL_SOCKET_IFNAME")
    if ifname:
        names = sorted(n for _i, n in socket.if_nameindex()) if interfaces is None else list(interfaces)
        if not socket_ifname_matches(ifname[0], names):
            f.append(Finding("error", "socket-ifname-unmatched",
                             f"NCCL_SOCKET_IFNAME={ifname[0]} (from {ifname[1]}) matches none of this node's "
                             f"interfaces ({', '.join(names) or 'none'}): NCCL finds no socket interface and "
                             "fails to start", "name a prefix of an interface, `=NAME` for one exactly, `^NAME` "
                             "to leave one out"))
    proto = s.get("NCCL_PROTO")
    if proto:
        tokens = {t.strip().lower() for part in proto[0].split(";") for t in part.split(":")[-1].split(",")}
        if "ll128" in tokens and not proto[0].lstrip().startswith("^"):
            auto = ll128_auto(topo, paths)
            f.append(Finding("warning" if auto else "error", "explicit-ll128",
                             f"NCCL_PROTO={proto[0]} (from {proto[1]}) names LL128, which bypasses NCCL's checks; "
                             + ("NCCL would enable it here anyway" if auto else
                                "NCCL would not enable it on this topology (data corruption risk where data "
                                "transits the CPU)"), "remove LL128 from NCCL_PROTO and let NCCL decide"))
    if s.env.get("NCCL_ASYNC_ERROR_HANDLING") is not None:
        both = "TORCH_NCCL_ASYNC_ERROR_HANDLING" in s.env
        f.append(Finding("warning", "deprecated-async-error-handling",
                         "NCCL_ASYNC_ERROR_HANDLING is deprecated since torch 2.2"
                         + (" and TORCH_NCCL_ASYNC_ERROR_HANDLING, also set, wins over it" if both else ""),
                         "use TORCH_NCCL_ASYNC_ERROR_HANDLING only"))
    debug = s.get("NCCL_DEBUG")
    if debug and debug[0].upper() in ("INFO", "TRACE"):
        f.append(Finding("warning", "debug-on", f"NCCL_DEBUG={debug[0]} (from {debug[1]}) left on: logging on every "
                         "collective costs host time and fills logs", "unset NCCL_DEBUG or set it to WARN"))
    return f


def _file_findings(s: _Settings, topologyd_file: Path) -> list[Finding]:
    """The graph and topology files NCCL is pointed at, or loads unasked."""
    f: list[Finding] = []
    for key, (value, path) in s.conf.items():
        if key == "NCCL_GRAPH_FILE":
            f.append(Finding("error", "graph-file-in-conf", f"NCCL_GRAPH_FILE={value} in {path} applies to every "
                             "communicator, also those of another GPU count (NVIDIA/nccl#1008)",
                             f"remove NCCL_GRAPH_FILE from {path}"))
        if key == "NCCL_TOPO_FILE" and not Path(value).exists():
            f.append(Finding("error", "stale-topo-file", f"NCCL_TOPO_FILE={value} in {path} does not exist: NCCL "
                             "silently falls back to auto-detection", f"remove it from {path} or run nccltune sweep"))
    graph_env = s.env.get("NCCL_GRAPH_FILE")
    if graph_env:
        f.append(Finding("warning", "graph-file", f"NCCL_GRAPH_FILE={graph_env} in the environment: for debugging "
                         "only", "unset NCCL_GRAPH_FILE"))
    if "NCCL_TOPO_FILE" not in s.env and "NCCL_TOPO_FILE" not in s.conf and topologyd_file.exists():
        f.append(Finding("info", "topologyd-file", f"{topologyd_file} exists: NCCL loads it whenever NCCL_TOPO_FILE "
                         "is unset", "make sure it describes this node"))
    return f


def _published_findings(topo: Topology, publish_dir: Path, env: Mapping[str, str],
                        found: list[Finding]) -> list[Finding]:
    """What nccltune published here against this node and the calling environment; `found`, the
    findings so far, is where reading the published set adds its own and what the environment's
    findings are weighed against."""
    published = _published(publish_dir, found)
    f: list[Finding] = []
    if published is not None:
        pub_env, prov = published
        kept = _kept_by_job(pub_env, env)
        if kept is not None:
            f.append(kept)
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
    return f + _calling_env_findings(env, published[0] if published is not None else {}, found + f)


def _hardware_findings(topo: Topology) -> list[Finding]:
    """NVLinks down and PCIe links below their width or generation, one finding per problem
    naming every GPU it concerns, not one per GPU."""
    f: list[Finding] = []
    inactive = [f"GPU{g.index} ({g.bus_id}): only {g.nvlinks_active} of {g.nvlinks_total} NVLinks are active"
                for g in topo.gpus if g.nvlinks_total and g.nvlinks_active < g.nvlinks_total]
    if inactive:
        f.append(Finding("error", "nvlink-inactive", "; ".join(inactive),
                         "check the NVLink/NVSwitch fabric (nvidia-smi nvlink -s, fabric manager)"))
    narrow = [f"GPU{g.index} ({g.bus_id}) runs PCIe x{g.pcie_cur_width} of x{g.pcie_max_width}"
              for g in topo.gpus if g.pcie_max_width and g.pcie_cur_width and g.pcie_cur_width < g.pcie_max_width]
    if narrow:
        f.append(Finding("warning", "pcie-width", "; ".join(narrow), "reseat the card or check the riser/slot"))
    slow: dict[tuple[int, int], list[str]] = {}
    for g in topo.gpus:
        if g.pcie_max_gen and g.pcie_cur_gen and g.pcie_cur_gen < g.pcie_max_gen:
            slow.setdefault((g.pcie_cur_gen, g.pcie_max_gen), []).append(f"GPU{g.index}")
    if slow:
        f.append(Finding("info", "pcie-gen", "; ".join(f"{', '.join(gpus)} link at PCIe Gen{cur} of Gen{top}"
                                                      for (cur, top), gpus in sorted(slow.items()))
                         + " (normal when idle; a problem under load)",
                         "check again under load (nvidia-smi -q -d PCIE)"))
    return f


# NCCL's default P2P level (paths.cc): P2P between two GPUs whose path is at most PXB.
DEFAULT_P2P_LEVEL = "PXB"


def socket_ifname_matches(value: str, interfaces: list[str]) -> bool:
    """Whether NCCL_SOCKET_IFNAME `value` selects at least one of `interfaces`, as NCCL reads it:
    comma-separated names, each a prefix, or with a leading `=` the exact name; a leading `^`
    turns the list into the interfaces to leave out."""
    exclude = value.startswith("^")
    body = value[1:] if exclude else value
    exact = body.startswith("=")
    if exact:
        body = body[1:]
    wanted = [w.strip() for w in body.split(",") if w.strip()]

    def named(iface: str) -> bool:
        return any(iface == w if exact else iface.startswith(w) for w in wanted)

    return any(named(i) != exclude for i in interfaces)


def _p2p_pairs_lost(topo: Topology, paths: PathMatrix, value: str) -> list[tuple[int, int, str]]:
    """GPU pairs (a < b, path type) that use P2P by default but not under NCCL_P2P_LEVEL=value:
    NCCL uses P2P where the path type is at most the level (paths.cc ncclTopoCheckP2p)."""
    level = level_of(value)
    if level is None:
        return []  # an ignored value is the invalid-value finding
    return [(a, b, _cell(p.type, p.nvlinks)) for (a, b), p in sorted(paths.gpu_gpu.items())
            if a < b and (a, b) not in topo.p2p_refused
            and RANK[level] < RANK[p.type] <= RANK[DEFAULT_P2P_LEVEL]]


def _cell(path_type: str, nvlinks: int) -> str:
    return f"NV{nvlinks}" if path_type == "NVL" and nvlinks else path_type


def _kept_by_job(published: Mapping[str, str], env: Mapping[str, str]) -> Finding | None:
    """What a job started from this environment keeps of its own and what nccltune adds, by the
    precedence rule (delivery/jobenv.py): a variable the job sets itself is the job's decision, so
    a value that differs from the published one is information, not a fault. None when the
    environment sets no published variable to another value."""
    decision = decide(published, env)
    differ = {name: pair for name, pair in sorted(decision.kept.items()) if pair[0] != pair[1]}
    if not differ:
        return None
    own = ", ".join(f"{name}={mine} (published: {theirs})" for name, (mine, theirs) in differ.items())
    added = (f"nccltune adds the other published variables ({', '.join(sorted(decision.applied))})"
             if decision.applied else "nccltune adds nothing else")
    return Finding("info", "env-overrides-published",
                   f"a job started from this environment keeps its own {own}: a variable the job sets itself is "
                   f"the job's decision; {added}",
                   f"unset {' '.join(differ)} in the job to get the published value")


def _calling_env_findings(env: Mapping[str, str], published: Mapping[str, str],
                          found: list[Finding]) -> list[Finding]:
    """Settings of the calling environment (not of nccl.conf: those are the node's own choice)
    that slow every job down or take a decision away from NCCL. A value equal to the published
    one is the tuning itself (a job that sourced nccl.sh), not a finding."""
    f: list[Finding] = []
    if env.get("CUDA_LAUNCH_BLOCKING") == "1":
        f.append(Finding("warning", "cuda-launch-blocking", "CUDA_LAUNCH_BLOCKING=1 in the environment: every kernel "
                         "launch waits for the kernel to finish, so computation and communication no longer "
                         "overlap (a debugging setting)", "unset CUDA_LAUNCH_BLOCKING"))
    reported = {x.code for x in found}
    for name in ("NCCL_ALGO", "NCCL_PROTO"):
        value = env.get(name)
        if value is None or published.get(name) == value:
            continue
        if name == "NCCL_PROTO" and "explicit-ll128" in reported:
            continue  # already said, more precisely
        algo = name == "NCCL_ALGO"
        # Each code spelled out: codes are a schema enum, collected from this file by the tests.
        f.append(Finding("warning", "forced-algo" if algo else "forced-proto", f"{name}={value} in the environment "
                         f"forces NCCL's {'algorithm' if algo else 'protocol'} for every size and every "
                         "job started from here, and wins over the published tuning",
                         f"unset {name} (nccltune sweep measures whether it helps on this node)"))
    return f


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


def upgrade_findings(store: Store, fingerprint: str) -> list[Finding]:
    """The upgrade gate as a finding: the latest ok sweep of this topology, under another NCCL,
    driver or torch than the sweep before it, is slower there beyond noise (defaults or published)."""
    run = store.latest_run(fingerprint, kind="sweep", status="ok")
    check = upgrade_check(store, run, warn=False) if run is not None else None
    if check is None or not check.regressions:
        return []
    side, worst = min(check.regressions, key=lambda r: r[1].change_pct or 0.0)
    names = ("NCCL", "driver", "torch")
    changed = ", ".join(f"{n} {a or '?'} -> {b or '?'}"
                        for n, a, b in zip(names, check.before, check.after, strict=True) if a != b)
    return [Finding("warning", "upgrade-regression",
                    f"after the upgrade ({changed}), sweep {check.run_id} is slower than sweep {check.previous_run_id} "
                    f"beyond noise at {len(check.regressions)} size(s) (worst: {side} at {worst.size_bytes} B "
                    f"{worst.collective}, {-(worst.change_pct or 0.0):.1f}%)",
                    f"nccltune compare {check.previous_run_id} {check.run_id} --side defaults; pin the previous "
                    "versions or re-tune, and gate jobs with nccltune verify --baseline RUN")]


def class_findings(store: Store, fingerprint: str) -> list[Finding]:
    """A class profile is in force and the latest verify of this topology found the node below its
    class beyond noise (the verify's rule: nccltune.fleet.outlier.judge_node)."""
    run = store.latest_run(fingerprint, kind="verify", status=None)
    verified = run.verify_summary if run is not None else None
    if run is None or verified is None or verified.code != "below_class":
        return []
    profile = verified.class_profile or {}
    below = [r for r in verified.rows or () if not r.ok and r.drift_pct is not None]
    sizes = ", ".join(f"{r.collective} {r.size_bytes} B {r.drift_pct or 0.0:+.1f}% "
                      f"(allowed -{r.allowed_pct or 0.0:.1f}%)" for r in below[:4])
    more = f" and {len(below) - 4} more" if len(below) > 4 else ""
    return [Finding("warning", "class-outlier",
                    f"verify {run.id} found this node below its class {profile.get('class_id', '?')} (profile "
                    f"{profile.get('file', '?')}, {profile.get('nodes', '?')} node(s)) beyond noise: {sizes}{more}",
                    "check this node's links and clocks (nvidia-smi nvlink -s, nvidia-smi -q -d PCIE,CLOCK) against "
                    "a sibling; re-run nccltune verify after a fix")]


def history_findings(store: Store, fingerprint: str) -> list[Finding]:
    """What the history says about this topology: the upgrade gate and the class comparison."""
    return upgrade_findings(store, fingerprint) + class_findings(store, fingerprint)
