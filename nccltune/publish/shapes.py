"""Which part of a published set a job gets, by the job's shape: THE one rule every launcher follows.

A set holds a *safe* part (the every-job part: values that hold for a job of any number of the
class's nodes, and for a job whose size nobody knows) and parts measured for one job shape each,
keyed by node count: 1 (the single-node part, values measured between one node's GPUs) and the
node counts a multi-node sweep measured (2, 4, 16, ...). A job of N nodes gets the safe part plus
the part of the largest measured count <= N: values measured on fewer nodes than the job runs on
are the nearest evidence that still exercised every transport the job uses (NVLink inside a node,
the NICs between nodes from 2 up), while values measured on more nodes were tuned for rings and
trees the job does not form. A job of unknown size (a CDI device's env, a systemd
EnvironmentFile=, a launcher that cannot tell) gets the safe part alone.

A name may be in several parts (the single-node part and the part for 4 nodes, say): a job gets one
part at most, so each part's value reaches exactly the jobs `shape_key` gives that part. A name in
the safe part is in no other (policy.check_scopes): the launchers apply a part after the safe part
and keep what a job already has, so a repeat would not mean the same in every form.

Standard library only: the shell launchers carry the same rule in sh (the largest listed count
<= the job's, the single-node file only for one node), and the tests compare them with
`part_for_shape`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def shape_key(measured: Iterable[int], nnodes: int | None) -> int | None:
    """The measured node count whose part a job of `nnodes` nodes gets, or None (the safe part
    alone). `measured`: the node counts the set has parts for."""
    if nnodes is None or nnodes < 1:
        return None
    fitting = [count for count in measured if 1 <= count <= nnodes]
    if nnodes > 1:
        # A part measured on one node never reaches a job that crosses the NICs.
        fitting = [count for count in fitting if count > 1]
    return max(fitting, default=None)


def part_for_shape(safe: Mapping[str, str], parts: Mapping[int, Mapping[str, str]],
                   nnodes: int | None) -> dict[str, str]:
    """What a job of `nnodes` nodes (None: not known) gets: `safe`, with the part `shape_key`
    picks from `parts` (node count -> variables) set over it, in the order the files set them."""
    env = dict(safe)
    key = shape_key(parts, nnodes)
    if key is not None:
        env.update(parts[key])
    return env


def part_reach(measured: Iterable[int], count: int) -> tuple[int, int | None]:
    """The node counts of the jobs that get the part measured for `count` (one of `measured`,
    2 or more): (fewest, most), most None for no bound. What nccl.json and the files' headers say
    of a part."""
    larger = [other for other in measured if other > count]
    return count, (min(larger) - 1 if larger else None)
