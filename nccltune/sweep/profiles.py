"""Workload profiles: which collectives a sweep measures and how much each (collective, size) counts.

A profile names what the node's jobs spend their communication on. The size profiles (balanced,
large, small; select.BUILTIN_PROFILES) weigh the sizes of all_reduce. The workload profiles weigh
the collectives of a kind of job: a range of sizes where its messages lie counts fully, the other
sizes of the ladder count a tenth, so that a setting that slows them is still refused (every
size with a weight is protected) while the gain is mostly made where the job's messages are.
Custom profiles (config `sweep.profiles`) arrive as collective -> {size: weight}.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .select import BUILTIN_PROFILES, Key, profile_weights

MiB = 1 << 20
GiB = 1 << 30
LIGHT = 0.1  # the weight, relative to the part's share, of ladder sizes outside a part's range


@dataclass(frozen=True)
class Part:
    """One collective of a workload profile: its share, and the sizes where the job's messages lie."""

    collective: str
    share: float
    min_bytes: int
    max_bytes: int


WORKLOADS: dict[str, tuple[str, tuple[Part, ...]]] = {
    "ddp": ("data parallel: all-reduce of gradient buckets, 1-256 MiB heavy",
            (Part("all_reduce", 1.0, MiB, 256 * MiB),)),
    "fsdp": ("sharded data parallel: all-gather of parameters and reduce-scatter of gradients, "
             "1 MiB-1 GiB heavy",
             (Part("all_gather", 1.0, MiB, GiB), Part("reduce_scatter", 1.0, MiB, GiB))),
    "moe": ("mixture of experts: all-to-all token dispatch (256 KiB-64 MiB heavy, twice the share) "
            "and the all-reduce of dense gradients (1-256 MiB heavy)",
            (Part("all_to_all", 2.0, 256 << 10, 64 * MiB), Part("all_reduce", 1.0, MiB, 256 * MiB))),
    "pipeline": ("pipeline parallel: send/recv of activations between stages, 1-64 MiB heavy",
                 (Part("sendrecv", 1.0, MiB, 64 * MiB),)),
}

# Every built-in profile with what it weighs.
BUILTIN: dict[str, str] = {**{name: f"all-reduce: {what}" for name, what in BUILTIN_PROFILES.items()},
                           **{name: what for name, (what, _parts) in WORKLOADS.items()}}

Custom = Mapping[str, Mapping[str, Mapping[int, float]]]  # name -> collective -> size -> weight


def collectives_of(name: str, custom: Custom) -> list[str]:
    """The collectives profile `name` measures, in its order.

    Raises:
        KeyError: unknown profile name.
    """
    if name in custom:
        return [c for c, sizes in custom[name].items() if any(w > 0 for w in sizes.values())]
    if name in WORKLOADS:
        return [p.collective for p in WORKLOADS[name][1]]
    if name in BUILTIN_PROFILES:
        return ["all_reduce"]
    raise KeyError(name)


def _part_weights(part: Part, sizes: Sequence[int]) -> dict[int, float]:
    inside = [s for s in sizes if part.min_bytes <= s <= part.max_bytes]
    if not inside:
        # A ladder that misses the range (the CPU demo's): every size counts alike.
        return {s: part.share for s in sizes}
    return {s: part.share * (1.0 if s in inside else LIGHT) for s in sizes}


def weights(name: str, sizes: Sequence[int], custom: Custom) -> dict[Key, float]:
    """(collective, size) -> weight over the ladder `sizes` for profile `name`. A custom size
    counts at the nearest size of the ladder, as for the size profiles.

    Raises:
        KeyError: unknown profile name.
    """
    out: dict[Key, float] = {}
    if name in custom:
        for collective, by_size in custom[name].items():
            one = profile_weights(name, sizes, {name: by_size})
            out.update({(collective, s): w for s, w in one.items()})
        return out
    if name in WORKLOADS:
        for part in WORKLOADS[name][1]:
            out.update({(part.collective, s): w for s, w in _part_weights(part, sizes).items()})
        return out
    return {("all_reduce", s): w for s, w in profile_weights(name, sizes, {}).items()}
