"""Topology-aware pruning and the sweep plan: what will be measured, what was pruned and why.

Values that cannot change anything on this node are measured once or not at all:
  * NCCL_P2P_LEVEL / NCCL_P2P_DISABLE by the signature rule (paths.cc, ncclTopoCheckP2p): two levels are
    equivalent iff no GPU pair with NVML P2P allowed has a raw path type between them;
  * network knobs (GDR, PXN, cross-NIC, IB QPs, socket threads) on a single node, where all-reduce
    never crosses a NIC; on a multi-node or NIC-loopback shape they are judged on the GPU-NIC paths
    NCCL finally uses (topology.nicpaths): GDR levels by the signature rule over (GPU, NIC) pairs,
    PXN only where some path goes through a peer GPU, cross-NIC only with several NICs, IB queue
    pairs only with RDMA NICs, socket-transport knobs only without them;
  * NVLS without an NVSwitch or below sm90, and whenever the site pinned it;
  * LL128 where NCCL itself would not enable it (forcing it bypasses NCCL's safety checks);
  * values equal to NCCL's default.
Channel values at or below the count NCCL already uses are dropped once the baseline shows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..collectives import from_tuner_name
from ..names import TUNED_NAME_STARTS
from ..topology.model import Topology
from ..topology.nicpaths import NicPathOptions, NicPaths, compute_nic_paths
from ..topology.paths import RANK, PathMatrix
from ..tuner.build import is_own_tuner
from .pertable import PrunedCandidate, SizeCandidate, per_size_candidates
from .space import CATALOGUE, MANAGED, level_of

NVLINK_TYPES = ("NVL", "NVB")
P2P_OFF_REASON = ("turns P2P off between NVLink-connected GPUs, which moves all-reduce onto SHM through "
                  "host memory (measured about 12x slower on the 2x H200 NVSwitch reference node)")


@dataclass(frozen=True)
class Why:
    """Why a candidate is not measured: a stable code for automation (`sweep --plan --json`, an
    enum in the plan schema) beside the prose for people."""

    code: str
    text: str


@dataclass(frozen=True)
class Pruned:
    name: str
    value: str  # "*" when the whole variable is pruned
    reason: str
    code: str  # Why.code: stable across versions and wordings

    @classmethod
    def of(cls, name: str, value: str, why: Why) -> Pruned:
        return cls(name, value, why.text, why.code)


@dataclass(frozen=True)
class Pinned:
    name: str
    value: str
    source: str  # "environment", "config" or "conf file PATH" (NCCL's conf files: the site's)
    warning: str | None = None


@dataclass(frozen=True)
class JobShape:
    """The job a plan is for: how many nodes, and whether one node is forced onto its NICs."""

    nnodes: int = 1
    loopback: bool = False  # single-node NIC loopback (P2P and SHM off)

    @property
    def crosses_nic(self) -> bool:
        return self.nnodes > 1 or self.loopback


SINGLE_NODE_NET_REASON = ("single-node sweep: all-reduce between local GPUs never crosses a NIC, so network "
                          "settings cannot change the result")
EXCLUDED = Why("excluded-by-config", "excluded by config (sweep.exclude)")
SOCKET_KNOBS = ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD")
# NCCL's socket transport opens helper threads by its own choice only on these NICs' PCI vendors
# (AWS ENA 2 x 8, Google gVNIC 4 x 1: net_socket.cc ncclNetSocketGetNsockNthread); elsewhere its
# auto is no helper thread, and NCCL_NSOCKS_PERTHREAD without NCCL_SOCKET_NTHREADS opens none.
SOCKET_AUTO_THREAD_VENDORS = ("0x1d0f", "0x1ae0")
CHANNEL_NOTE = ("Channel values that cannot change NCCL's channel count are dropped once the baseline shows how "
                "many channels NCCL uses.")


# nccltune's own tuner table variables: what an earlier sweep published, never a pin.
OWN_TUNER_VARS = ("NCCLTUNE_TUNER_TABLE", "NCCLTUNE_TUNER_FINGERPRINT")
# The variables a per-size candidate sets: measured per size, not as whole-environment candidates.
PER_SIZE_VARS = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")
PER_SIZE_REASON = "measured per size as (algorithm, protocol, channels) candidates for the tuner table"

# The per-size candidates a plan leaves out (PrunedCandidate, named by what they are), by code.
CANDIDATE_CODES = {"nvls": "nvls-never-swept", "collnet": "collnet-unavailable", "tree": "tree-all-reduce-only",
                   "pat": "pat-not-applicable", "ll128": "ll128-not-auto", "*": "one-rank"}


@dataclass(frozen=True)
class CodedCandidate(PrunedCandidate):
    """A per-size candidate this module leaves out, with its code (pinned, excluded)."""

    code: str = "excluded-by-config"


def candidate_code(p: PrunedCandidate) -> str:
    """The stable code of a per-size candidate left out of the plan."""
    if p.code:
        return p.code
    try:
        return CANDIDATE_CODES[p.what]
    except KeyError:
        raise ValueError(f"per-size candidate {p.what!r} has no code in sweep.plan.CANDIDATE_CODES") from None


@dataclass
class PerSizePlan:
    """The per-size part of a plan: whether the tuner table is active, and what is measured for it.

    Channel candidates are half and a third more of the channel count NCCL's defaults use, known
    only once the baseline's NCCL log shows it."""

    active: bool
    reason: str | None = None  # why it is not active
    candidates: list[SizeCandidate] = field(default_factory=list)
    collectives: list[str] = field(default_factory=list)  # the measured ones the table steers (its spelling)
    channels: bool = False  # whether channel candidates follow the baseline
    pruned: list[PrunedCandidate] = field(default_factory=list)
    measured_with_nccl: bool = True  # False on the CPU demo: the table is computed, never loaded
    notes: list[str] = field(default_factory=list)

    def trial_count(self) -> int:
        """Trials of the per-size candidates (the channel pair counted as two)."""
        return len(self.candidates) + (2 if self.channels else 0) if self.active else 0

    @property
    def inactive_text(self) -> str:
        return f"per-size tuner table not active: {self.reason}"


@dataclass
class Plan:
    variables: dict[str, list[str]]
    pruned: list[Pruned]
    pinned: dict[str, Pinned]
    policy: dict[str, str]
    sizes: list[int]
    backend: str
    nranks: int
    notes: list[str] = field(default_factory=list)
    default_p2p_level: str = "PXB"
    shape: JobShape = field(default_factory=JobShape)
    per_size: PerSizePlan | None = None
    # What would have been pinned from the environment had nccltune's published set not put it there
    # (a launch's marker of what it applied, checked against the set: delivery.jobenv.from_published):
    # swept as if unset; the set's generation.
    from_published: dict[str, str] = field(default_factory=dict)
    published_generation: int | None = None
    # Variables that act only with another (space.Tunable.acts_with) and are, alone, NCCL's
    # defaults on this node, with why: the search never screens them without their partner.
    # NCCL_NSOCKS_PERTHREAD where NCCL starts no socket helper thread of its own choice
    # (socket_auto_threads False; not known: not here).
    inert_alone: dict[str, str] = field(default_factory=dict)

    def screening_count(self) -> int:
        return sum(len(v) for v in self.variables.values())

    def candidates(self) -> list[tuple[str, str]]:
        return [(n, v) for n, vals in self.variables.items() for v in vals]


def socket_auto_threads(topo: Topology) -> bool | None:
    """Whether NCCL's socket transport starts helper threads of its own choice here: an Ethernet NIC
    that is a PCI function of a vendor it gives them to (SOCKET_AUTO_THREAD_VENDORS). None where no
    sysfs reading of the NICs is at hand (a topology from an XML file)."""
    if topo.snapshot is None:
        return None
    vendors = {d.bus_id: d.vendor for d in topo.snapshot.sysfs.pci}
    return any(n.kind == "eth" and n.bus_id is not None and vendors.get(n.bus_id) in SOCKET_AUTO_THREAD_VENDORS
               for n in topo.snapshot.sysfs.nics)


def default_p2p_level(topo: Topology) -> str:
    """NCCL's default P2P level: PXB, or SYS on AMD CPUs with at most 2 GPUs (2.26+)."""
    vendor = next((c.attrs.get("vendor") for c in topo.system.iter("cpu")), None)
    if vendor == "AuthenticAMD" and len(topo.gpus) <= 2:
        return "SYS"
    return "PXB"


def p2p_signature(level: str, paths: PathMatrix, refused: set[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    """GPU pairs that use P2P at this level: raw type <= level, and NVML allows P2P."""
    limit = RANK[level]
    return frozenset(
        (a, b) for (a, b), p in paths.gpu_gpu.items()
        if a < b and (a, b) not in refused and RANK.get(p.type, 99) <= limit
    )


def has_nvswitch(topo: Topology) -> bool:
    return any(n.attrs.get("tclass") == "0x068000" for n in topo.system.iter("nvlink"))


def ll128_auto(topo: Topology, paths: PathMatrix) -> bool:
    """Would NCCL enable LL128 by itself? Intra-node paths all NVLink, same sm (or sm90+), sm>=70."""
    sms = {g.sm for g in topo.gpus}
    if None in sms or not sms:
        return False
    if min(s for s in sms if s is not None) < 70:
        return False
    if len(sms) > 1 and min(s for s in sms if s is not None) < 90:
        return False
    types = {p.type for (a, b), p in paths.gpu_gpu.items() if a != b}
    return bool(types) and all(RANK[t] <= RANK["NVB"] for t in types)


def build_plan(
    topo: Topology,
    paths: PathMatrix,
    *,
    env: Mapping[str, str],
    config_pins: Mapping[str, str],
    unpin: Sequence[str],
    variables: Mapping[str, Sequence[str]],
    exclude: Sequence[str],
    policy: Mapping[str, str],
    sizes: Sequence[int],
    backend: str,
    nranks: int,
    shape: JobShape | None = None,
    site_pins: Mapping[str, tuple[str, str]] | None = None,
    published: Mapping[str, str] | None = None,
) -> Plan:
    """Build the plan. Values must already be validated (see sweep.space).

    `env` is the job's own environment: what nccltune's published set put into the calling one is
    left out (delivery.jobenv.from_published), and `published` names it; those of its variables
    that would have been pins are listed as the plan's `from_published`.

    `site_pins`: name -> (value, where) of what NCCL's conf files give the jobs (nccl.site): pinned
    exactly like the environment, which wins over them as in NCCL; NCCL_TOPO_FILE among them too (a
    site's curated topology file is kept, and nccltune then neither sets nor publishes its own).

    `shape` is the job the plan is for (one node by default); network knobs are only candidates
    when traffic crosses a NIC (several nodes, or NIC loopback).
    """
    pruned: list[Pruned] = []
    pinned: dict[str, Pinned] = {}
    for name, value in env.items():
        pin = _environment_pin(name, value, unpin)
        if pin is not None:
            pinned[name] = pin
    for name, (value, where) in (site_pins or {}).items():
        if not name.startswith(TUNED_NAME_STARTS) or name in unpin or name in pinned or name in OWN_TUNER_VARS:
            continue
        if (name in MANAGED and name != "NCCL_TOPO_FILE") or (name == "NCCL_TUNER_PLUGIN" and is_own_tuner(value)):
            continue
        tun = CATALOGUE.get(name)
        pinned[name] = Pinned(name, value, f"conf file {where}", tun.validate(value) if tun else None)
    for name, value in config_pins.items():
        # `--unpin`/`sweep.unpin` promise to sweep a variable "although the environment or config
        # sets it": a config pin is no stronger than an environment one.
        if name not in unpin:
            pinned[name] = Pinned(name, value, "config")

    plan = Plan(variables={}, pruned=pruned, pinned=pinned, policy=dict(policy), sizes=list(sizes),
                backend=backend, nranks=nranks, default_p2p_level=default_p2p_level(topo),
                shape=shape or JobShape())
    if socket_auto_threads(topo) is False:
        plan.inert_alone["NCCL_NSOCKS_PERTHREAD"] = ("alone it is NCCL's defaults on this node's NICs (NCCL starts "
                                                     "no socket helper thread of its own choice on them)")
    plan.from_published = {name: value for name, value in (published or {}).items()
                           if name not in pinned and _environment_pin(name, value, unpin) is not None}
    if backend == "gloo":
        plan.notes.append("CPU demo: the gloo backend ignores NCCL variables, so every candidate measures "
                          "the same thing; the plan is the one this topology would get on its GPUs.")

    refused = topo.p2p_refused
    default_sig = p2p_signature(plan.default_p2p_level, paths, refused)
    nvlink_pairs = {(a, b) for (a, b), p in paths.gpu_gpu.items() if a < b and p.type in NVLINK_TYPES}
    types = sorted({p.type for (a, b), p in paths.gpu_gpu.items() if a < b}, key=lambda t: RANK[t])
    plan.notes.append(f"GPU pair path types: {', '.join(types) or 'none'}; NCCL's default P2P level here is "
                      f"{plan.default_p2p_level}.")
    seen_sigs: dict[frozenset[tuple[int, int]], str] = {default_sig: "the default"}
    nvs = has_nvswitch(topo)
    min_sm = min((g.sm or 0) for g in topo.gpus) if topo.gpus else 0
    ll128 = ll128_auto(topo, paths)
    net: _NetRules | None = None
    if plan.shape.crosses_nic:
        net = _NetRules(topo, paths, plan.shape)
        plan.notes.append(net.note())

    for name, tunable in CATALOGUE.items():
        if tunable.kind == "policy":
            continue
        if name in pinned:
            continue  # listed under pinned, never swept
        if name in exclude:
            pruned.append(Pruned.of(name, "*", EXCLUDED))
            continue
        values = list(variables.get(name, tunable.sweep))
        if not values:
            continue
        if tunable.scope == "net" and net is None:
            pruned.append(Pruned.of(name, "*", Why("single-node-network", SINGLE_NODE_NET_REASON)))
            continue
        keep: list[str] = []
        for value in values:
            if net is not None and tunable.scope == "net":
                why = net.prune(name, value, tunable.default)
            else:
                why = _prune_value(name, value, tunable.default, paths, refused, default_sig, nvlink_pairs,
                                   seen_sigs, nvs, min_sm, ll128, plan.default_p2p_level)
            if why:
                pruned.append(Pruned.of(name, value, why))
            else:
                keep.append(value)
        if keep:
            plan.variables[name] = keep
    if "NCCL_MIN_NCHANNELS" in plan.variables or "NCCL_MAX_NCHANNELS" in plan.variables:
        plan.notes.append(CHANNEL_NOTE)
    return plan


def _environment_pin(name: str, value: str, unpin: Sequence[str]) -> Pinned | None:
    """The pin a variable of the job's environment is, or None: not NCCL's or torch's, freed by
    sweep.unpin, or one nccltune manages (its topology file, its own tuner and table)."""
    if not name.startswith(TUNED_NAME_STARTS) or name in unpin:
        return None
    if name in MANAGED or name in OWN_TUNER_VARS or (name == "NCCL_TUNER_PLUGIN" and is_own_tuner(value)):
        return None
    tun = CATALOGUE.get(name)
    warning = tun.validate(value) if tun else "not a setting nccltune knows; passed to every trial unchanged"
    return Pinned(name, value, "environment", warning)


def plan_per_size(plan: Plan, topo: Topology, paths: PathMatrix, *, inactive_reason: str | None,
                  user_variables: Sequence[str], demo: bool, exclude: Sequence[str] = (),
                  collectives: Sequence[str] = ("all_reduce",), nccl_version: str | None = None) -> PerSizePlan:
    """Add the per-size candidates to the plan (or say why there are none). When the table is active,
    the catalogue's algorithm, protocol and channel values leave the whole-environment search (the
    per-size candidates measure them, in pairs), unless the config names them in sweep.variables.

    `collectives` are the ones every trial measures (nccltune's names); the table steers those NCCL
    asks a tuner about. `nccl_version`, where known before the trials, decides whether an algorithm
    that runs only some of them can be set for those alone (sweep.pertable.per_size_candidates)."""
    # The communicator the trials form: this node's ranks, on each of the job's nodes.
    nnodes = 1 if plan.shape.loopback else plan.shape.nnodes
    comm_ranks = plan.nranks * nnodes
    if inactive_reason is None and comm_ranks < 2:
        inactive_reason = "one rank: NCCL consults no tuner"
    if inactive_reason is None and plan.shape.loopback:
        inactive_reason = "NIC loopback is a shape no job has: no table is measured for it"
    if inactive_reason is not None:
        plan.per_size = PerSizePlan(False, inactive_reason)
        plan.notes.append(plan.per_size.inactive_text)
        return plan.per_size
    got = per_size_candidates(collectives, ll128=ll128_auto(topo, paths), nranks=comm_ranks, nnodes=nnodes,
                              nccl_version=nccl_version)
    candidates, pruned = got.candidates, got.pruned
    if not got.collectives:
        why = "; ".join(f"{p.what}: {p.reason}" for p in pruned)
        plan.per_size = PerSizePlan(False, f"no measured collective is steered by a tuner ({why})", pruned=pruned,
                                    collectives=[])
        plan.notes.append(plan.per_size.inactive_text)
        return plan.per_size
    pinned_ap = [n for n in ("NCCL_ALGO", "NCCL_PROTO") if n in plan.pinned]
    if pinned_ap:
        candidates = []
        pruned.append(CodedCandidate("algorithm/protocol", f"{' and '.join(pinned_ap)} pinned: the environment "
                                     "always wins over a tuner", "pinned"))
    elif any(n in exclude for n in ("NCCL_ALGO", "NCCL_PROTO")):
        candidates = []
        pruned.append(CodedCandidate("algorithm/protocol", EXCLUDED.text, EXCLUDED.code))
    channel_vars = ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")
    channels = not any(n in plan.pinned or n in exclude for n in channel_vars)
    if any(n in plan.pinned for n in channel_vars):
        pruned.append(CodedCandidate("channels", "NCCL_MIN/MAX_NCHANNELS pinned: the communicator's channel count "
                                     "is fixed, and a table can only ask for up to it", "pinned"))
    elif not channels:
        pruned.append(CodedCandidate("channels", EXCLUDED.text, EXCLUDED.code))
    if not candidates and not channels:
        why = "; ".join(f"{p.what}: {p.reason}" for p in pruned if p.what in ("algorithm/protocol", "channels"))
        plan.per_size = PerSizePlan(False, f"nothing left to measure per size ({why})", pruned=pruned,
                                    collectives=got.collectives)
        plan.notes.append(plan.per_size.inactive_text)
        return plan.per_size
    ps = PerSizePlan(True, None, candidates, got.collectives, channels, pruned, measured_with_nccl=not demo,
                     notes=list(got.notes) if candidates else [])
    if demo:
        ps.notes.append("CPU demo: the table is computed and shown, not measured with NCCL (gloo cannot load "
                        "NCCL's tuner plugin)")
    for name in PER_SIZE_VARS:
        if name in plan.variables and name not in user_variables:
            for value in plan.variables.pop(name):
                plan.pruned.append(Pruned.of(name, value, Why("measured-per-size", PER_SIZE_REASON)))
    if not any(n in plan.variables for n in ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")):
        plan.notes = [n for n in plan.notes if n != CHANNEL_NOTE]
    plan.per_size = ps
    return ps


def _prune_value(name: str, value: str, default: str | None, paths: PathMatrix, refused: set[tuple[int, int]],
                 default_sig: frozenset[tuple[int, int]], nvlink_pairs: set[tuple[int, int]],
                 seen_sigs: dict[frozenset[tuple[int, int]], str], nvs: bool, min_sm: int, ll128: bool,
                 default_level: str) -> Why | None:
    if default is not None and value == default:
        return Why("equal-to-default", f"equal to NCCL's default ({default})")
    if name in ("NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE"):
        level = "LOC" if name == "NCCL_P2P_DISABLE" and value == "1" else (
            default_level if name == "NCCL_P2P_DISABLE" else level_of(value))
        if level is None:
            return Why("ignored-by-nccl", "NCCL ignores this value")
        sig = p2p_signature(level, paths, refused)
        lost = default_sig - sig
        if lost & nvlink_pairs:
            return Why("p2p-off-over-nvlink", P2P_OFF_REASON)
        if sig in seen_sigs:
            other = seen_sigs[sig]
            return Why("same-path-signature",
                       "same GPU pairs use P2P as with NCCL's default on this topology" if other == "the default"
                       else f"same effect as {other} on this topology")
        seen_sigs[sig] = f"{name}={value}"
        return None
    if name == "NCCL_SHM_DISABLE":
        if len(default_sig) == sum(1 for (a, b) in paths.gpu_gpu if a < b):
            return Why("all-pairs-use-p2p",
                       "every GPU pair already uses P2P, and SHM is only the fallback for pairs without it")
        return None
    if name == "NCCL_NVLS_ENABLE":
        if not nvs:
            return Why("no-nvswitch", "no NVSwitch: NVLS cannot run here")
        if min_sm < 90:
            return Why("nvls-needs-sm90", "NVLS needs sm90 or newer")
        return None
    if name == "NCCL_PROTO":
        # Any entry that names LL128 without `^` forces it, for whatever function it is scoped
        # to, and the published value reaches every collective of the user's jobs.
        forced = any(not excluded and "ll128" in tokens for _func, excluded, tokens in _list_entries(value))
        if forced and not ll128:
            return Why("ll128-not-auto", "NCCL would not enable LL128 on this topology; forcing it bypasses "
                       "NCCL's checks (data corruption where data transits the CPU)")
        return None
    if name == "NCCL_ALGO":
        return _prune_algo(value, nvs and min_sm >= 90)
    return None


class _NetRules:
    """Pruning of the network knobs for a shape whose traffic crosses NICs.

    Everything is judged on the GPU-NIC paths NCCL finally uses (topology.nicpaths), because
    that is what NCCL's GDR, PXN and NIC choices act on.
    """

    def __init__(self, topo: Topology, paths: PathMatrix, shape: JobShape) -> None:
        self.topo, self.paths = topo, paths
        # NIC loopback turns P2P and SHM off, so NCCL trims every other GPU from each rank's
        # topology (paths.cc marks them NET): no peer GPU is left to relay to a NIC.
        self.no_peers = shape.loopback and shape.nnodes == 1
        self.options = NicPathOptions(pxn_disable=self.no_peers)
        self.default = compute_nic_paths(topo, paths, self.options)
        self.default_gdr = self.default.gdr_pairs()
        self.rdma = any(n.kind == "ib" for n in topo.nics)
        self.gdr_seen: dict[frozenset[tuple[int, str]], str] = {self.default_gdr: "the default"}

    def note(self) -> str:
        types = sorted(self.default.final_types(), key=lambda t: RANK[t])
        return (f"GPU-NIC path types as NCCL uses them: {', '.join(types) or 'none'} "
                f"({self.default.count('PXN')} of {len(self.default.paths)} through a peer GPU); "
                f"{len(self.default_gdr)} GPU-NIC pairs use GDR at NCCL's default level.")

    def gdr_signature(self, level: str) -> frozenset[tuple[int, str]]:
        """(GPU, NIC) pairs with GPUDirect RDMA at this NCCL_NET_GDR_LEVEL."""
        return self._at(dataclasses.replace(self.options, gdr_level=level)).gdr_pairs()

    def _at(self, options: NicPathOptions) -> NicPaths:
        return compute_nic_paths(self.topo, self.paths, options)

    def prune(self, name: str, value: str, default: str | None) -> Why | None:
        if default is not None and value == default:
            return Why("equal-to-default", f"equal to NCCL's default ({default})")
        if not self.topo.nics:
            return Why("no-nic", "no network device: nothing crosses a NIC")
        if name == "NCCL_NET_GDR_LEVEL":
            return self._prune_gdr_level(value)
        if name == "NCCL_NET_GDR_READ":
            if not self.default_gdr:
                return Why("no-gdr", "no GPU-NIC pair uses GDR here, so GDR reads change nothing")
            if value == "1" and all((g.sm or 0) >= 80 for g in self.topo.gpus):
                return Why("nccl-auto-already", "NCCL already uses GDR reads on sm80 and newer (its auto setting)")
            return None
        if name == "NCCL_PXN_DISABLE":
            if self.no_peers:
                return Why("no-peer-gpu", "NIC loopback: each rank's topology holds only its own GPU, so no peer "
                           "GPU can relay")
            if "PXN" not in self.default.final_types():
                return Why("no-pxn-path", "no GPU reaches a NIC through a peer GPU (no PXN path), so PXN cannot "
                           "change anything")
            return None
        if name == "NCCL_CROSS_NIC":
            if len(self.topo.nics) < 2:
                return Why("one-nic", "one NIC: a ring has no other NIC to cross to")
            return None
        if name == "NCCL_IB_QPS_PER_CONNECTION" and not self.rdma:
            return Why("no-rdma-nic", "no RDMA NIC: NCCL uses the socket transport, which has no queue pairs")
        if name in SOCKET_KNOBS and self.rdma:
            return Why("rdma-nics-present", "RDMA NICs present: NCCL uses the IB transport, not sockets")
        return None

    def _prune_gdr_level(self, value: str) -> Why | None:
        level = level_of(value)
        if level is None:
            return Why("ignored-by-nccl", "NCCL ignores this value")
        sig = self.gdr_signature(level)
        if sig in self.gdr_seen:
            other = self.gdr_seen[sig]
            if not sig and not self.default_gdr:
                return Why("no-gdr", "no GPU-NIC pair can use GDR here (a NIC or GPU without GPUDirect RDMA "
                           "support)")
            return Why("same-path-signature",
                       "same GPU-NIC pairs use GDR as with NCCL's default on this topology" if other == "the default"
                       else f"same effect as {other} on this topology")
        self.gdr_seen[sig] = f"NCCL_NET_GDR_LEVEL={value}"
        return None


def _list_entries(value: str) -> list[tuple[str, bool, set[str]]]:
    """NCCL_ALGO/NCCL_PROTO syntax `[^]a,b[;func:[^]a,b]...` as (function or "", excluded, tokens),
    the function as nccltune names the collective (NCCL's `allreduce:` -> all_reduce; NCCL reads
    it in any case) and a name NCCL has not as given."""
    out = []
    for entry in value.split(";"):
        func, _sep, items = entry.rpartition(":")
        items = items.strip()
        excluded = items.startswith("^")
        tokens = {t.strip().lower() for t in items.lstrip("^").split(",") if t.strip()}
        func = func.strip().lower()
        known = from_tuner_name(func)
        out.append((known.name if known else func, excluded, tokens))
    return out


def _prune_algo(value: str, nvls_ok: bool) -> Why | None:
    # All-reduce follows its own entry (the last one replaces earlier ones), else the unscoped
    # first entry (NCCL_ALGO syntax, 2.24+).
    entries = _list_entries(value)
    scoped = [e for e in entries if e[0] == "all_reduce"]
    unscoped = [e for e in entries if e[0] == ""]
    effective = scoped[-1] if scoped else (unscoped[0] if unscoped else None)
    if effective is None:
        return Why("same-as-default", "does not restrict all-reduce, so it measures the same as NCCL's default")
    _func, excluded, tokens = effective
    # What can run for a single-node all-reduce: NVLSTree is multi-node only, CollNet needs a
    # CollNet plugin and several nodes, PAT never applies to all-reduce.
    runnable = {"ring", "tree"} | ({"nvls"} if nvls_ok else set())
    if excluded:
        if not runnable - tokens:
            return Why("no-algorithm-left", "leaves no algorithm that can run an all-reduce here (NCCL fails with "
                       "ncclInvalidUsage)")
        if not tokens & runnable:
            return Why("same-as-default", "excludes only algorithms that cannot run here: same as NCCL's default")
        return None
    if tokens & runnable:
        return None
    if tokens & {"nvls"}:
        return Why("nvls-unavailable", "NVLS needs an NVSwitch and sm90")
    if tokens & {"collnetdirect", "collnetchain"}:
        return Why("collnet-unavailable", "CollNet needs a CollNet network plugin and several nodes")
    if tokens & {"nvlstree"}:
        return Why("multi-node-only", "NVLSTree runs only across nodes")
    return Why("pat-not-applicable", "PAT never applies to all-reduce")


def _at_or_below(limit: int) -> Callable[[str], bool]:
    return lambda v: int(v) <= limit


def _at_or_above(limit: int) -> Callable[[str], bool]:
    return lambda v: int(v) >= limit


def prune_channels(plan: Plan, coll_channels: int | None) -> list[Pruned]:
    """After the baseline: drop channel values that cannot change NCCL's channel count."""
    if not coll_channels:
        return []
    dropped: list[Pruned] = []
    rules: tuple[tuple[str, Callable[[str], bool], str], ...] = (
        ("NCCL_MIN_NCHANNELS", _at_or_below(coll_channels), "at or below"),
        ("NCCL_MAX_NCHANNELS", _at_or_above(coll_channels), "at or above"),
    )
    for name, test, why in rules:
        values = plan.variables.get(name)
        if not values:
            continue
        for v in list(values):
            if test(v):
                values.remove(v)
                dropped.append(Pruned.of(name, v, Why("channels-no-effect",
                                                      f"{why} the {coll_channels} channels NCCL already uses")))
        if not values:
            del plan.variables[name]
    plan.pruned.extend(dropped)
    return dropped
