"""The collectives nccltune measures, with nccl-tests' definitions of size and bus bandwidth.

Standard library only: the trial worker loads this file by path under the node's own Python
(see trials/worker.py), where nccltune's dependencies may be missing.

Definitions follow nccl-tests (src/<collective>.cu), so numbers compare with its columns:
- "the" size is nccl-tests' size column: the larger of the send and receive buffers of one rank.
  For all_gather, reduce_scatter and all_to_all that is the whole array, count x nranks elements;
  for the others one rank's buffer.
- all_gather, reduce_scatter and all_to_all split the array in per-rank blocks whose element
  count is rounded down to a multiple of 4 (nccl-tests aligns them so), at least 4 here so that a
  size is never empty.
- algbw = size / time; busbw = algbw x factor: 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
  reduce_scatter and all_to_all, 1 for broadcast, reduce and sendrecv.
Every measurement is float32 (sum for the reductions, root 0 for broadcast and reduce).
Each `*_perf` binary also prints a reduction-operation and a root column: "sum" where it runs a
reduction (sendrecv too: it passes the operation list), "none" for all_gather, broadcast and
alltoall; root -1 ("no root") except broadcast and reduce, which the binaries run for root 0
by default.
"""

from __future__ import annotations

from dataclasses import dataclass

ELEMENT_BYTES = 4  # float32, the only data type measured
BLOCK_ALIGN_ELEMENTS = 4  # per-rank blocks of the split collectives, as nccl-tests rounds them


@dataclass(frozen=True)
class Collective:
    """One collective: its names elsewhere and its size and bandwidth definitions."""

    name: str  # nccltune's name, as on the worker's --collectives
    perf_binary: str  # the nccl-tests binary that measures it
    nccl_call: str  # the NCCL API call the worker makes (all_to_all: grouped send/recv where absent)
    log_func: str | None  # the function name of NCCL's per-size "Bytes -> Algo" line; None: p2p, no such line
    split: bool  # the size is the whole array of count x nranks elements, in per-rank blocks
    factor_kind: str  # "2(n-1)/n", "(n-1)/n" or "1"
    # torch's gloo backend has it (checked with torch 2.13 on two gloo ranks; on one rank gloo
    # cannot send to itself, and the worker reports sendrecv as not measured with torch's reason).
    gloo: bool
    perf_redop: str = "sum"  # the redop column of the `*_perf` binary
    perf_root: int = -1  # the root column: -1 where the collective has no root
    # NCCL's ncclFunc_t index where NCCL asks a tuner plugin about it (broadcast 0 ... all_reduce 4);
    # None for all_to_all and sendrecv, which NCCL moves as point-to-point sends and receives.
    tuner_index: int | None = None

    @property
    def tuner_name(self) -> str | None:
        """NCCL's own spelling (allreduce, allgather, reducescatter: its function name in lower
        case), for the collectives NCCL asks a tuner about; None for the others. It is the spelling
        of NCCL_ALGO/NCCL_PROTO's per-collective entries (`allreduce:Tree`) and of the collective
        field of nccltune's tuner table file (and so of a class profile's table rows), and nowhere
        else: nccltune's own code names collectives as `name` does. `from_tuner_name` reads it back."""
        return self.log_func.lower() if self.tuner_index is not None and self.log_func else None

    def busbw_factor(self, nranks: int) -> float:
        """busbw / algbw for `nranks` ranks, as nccl-tests computes it."""
        if nranks < 1:
            raise ValueError(f"nranks must be at least 1, got {nranks}")
        if self.factor_kind == "2(n-1)/n":
            return 2.0 * (nranks - 1) / nranks
        if self.factor_kind == "(n-1)/n":
            return (nranks - 1) / nranks
        return 1.0

    def counts(self, size_bytes: int, nranks: int) -> tuple[int, int, int]:
        """(count, send elements, receive elements) per rank for a requested size.

        `count` is the count argument of the NCCL call: the per-rank block of the split
        collectives (all_gather's send count, reduce_scatter's receive count, all_to_all's count
        per peer), the whole buffer for the others.
        """
        if nranks < 1:
            raise ValueError(f"nranks must be at least 1, got {nranks}")
        elements = max(size_bytes, 0) // ELEMENT_BYTES
        if not self.split:
            count = max(elements, 1)
            return count, count, count
        block = max(elements // (BLOCK_ALIGN_ELEMENTS * nranks) * BLOCK_ALIGN_ELEMENTS, BLOCK_ALIGN_ELEMENTS)
        whole = block * nranks
        if self.name == "all_gather":
            return block, block, whole
        if self.name == "reduce_scatter":
            return block, whole, block
        return block, whole, whole  # all_to_all: a block to and from every rank

    def nccl_bytes(self, size_bytes: int, nranks: int) -> int:
        """The byte count NCCL itself sees for a call of this measured size: the count argument
        times the element size. It is what NCCL passes to a tuner's getCollInfo and prints in its
        per-size TUNING line, so the table's ranges and the reading of NCCL's log use it. For
        all_gather and reduce_scatter it is one rank's block (NCCL 2.28.9 logs a 4 MiB all_gather
        on 4 ranks as "AllGather: 1048576 Bytes"), for the others the whole buffer."""
        return self.counts(size_bytes, nranks)[0] * ELEMENT_BYTES

    def nccl_byte_range(self, min_bytes: int, max_bytes: int, nranks: int) -> tuple[int, int]:
        """A range of measured sizes as the range of byte counts NCCL sees for them (see
        `nccl_bytes`). Ranges that partition the measured sizes still partition NCCL's counts:
        the lower edge rounds up and the upper edge down, so neighbours neither overlap nor
        leave a gap."""
        if not self.split or nranks <= 1:
            return min_bytes, max_bytes
        return -(-min_bytes // nranks), max_bytes // nranks

    def size_bytes(self, requested_bytes: int, nranks: int) -> int:
        """The size nccl-tests prints for a requested size: what is measured and reported."""
        _count, send, recv = self.counts(requested_bytes, nranks)
        return max(send, recv) * ELEMENT_BYTES

    def busbw_gbps(self, size_bytes: int, time_us: float, nranks: int) -> float:
        """Bus bandwidth in GB/s (1e9 bytes/s) of one operation of `size_bytes` taking `time_us`."""
        return algbw_gbps(size_bytes, time_us) * self.busbw_factor(nranks)


def algbw_gbps(size_bytes: int, time_us: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s): size / time."""
    if time_us <= 0:
        raise ValueError(f"time_us must be positive, got {time_us}")
    return size_bytes / (time_us * 1e3)


COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective("all_reduce", "all_reduce_perf", "ncclAllReduce", "AllReduce", False, "2(n-1)/n", True,
               tuner_index=4),
    Collective("all_gather", "all_gather_perf", "ncclAllGather", "AllGather", True, "(n-1)/n", True, "none",
               tuner_index=2),
    Collective("reduce_scatter", "reduce_scatter_perf", "ncclReduceScatter", "ReduceScatter", True, "(n-1)/n",
               True, tuner_index=3),
    Collective("broadcast", "broadcast_perf", "ncclBroadcast", "Broadcast", False, "1", True, "none", 0,
               tuner_index=0),
    Collective("reduce", "reduce_perf", "ncclReduce", "Reduce", False, "1", True, "sum", 0, tuner_index=1),
    # ncclAlltoAll exists from NCCL 2.28 on; with older libraries the worker groups send/recv pairs.
    Collective("all_to_all", "alltoall_perf", "ncclAlltoAll", "AlltoAll", True, "(n-1)/n", True, "none"),
    # One ring step: every rank sends to rank+1 and receives from rank-1, in one group.
    Collective("sendrecv", "sendrecv_perf", "ncclSend/ncclRecv", None, False, "1", True),
)}
NAMES: tuple[str, ...] = tuple(COLLECTIVES)
DEFAULT = "all_reduce"
# The collectives NCCL asks a tuner about, in NCCL's ncclFunc_t order (the plugin's collective index).
TUNED: tuple[Collective, ...] = tuple(sorted((c for c in COLLECTIVES.values() if c.tuner_index is not None),
                                             key=lambda c: c.tuner_index or 0))
TUNER_NAMES: tuple[str, ...] = tuple(c.tuner_name for c in TUNED if c.tuner_name)  # the same, as NCCL spells them


def get(name: str) -> Collective:
    """The collective called `name`.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return COLLECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown collective {name!r} (known: {', '.join(NAMES)})") from None


def by_perf_binary(name: str) -> Collective | None:
    """The collective a `*_perf` binary measures ("all_reduce_perf", or a path to it); None for a
    binary nccltune has no collective for (alltoallv_perf, gather_perf, ...)."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    return next((c for c in COLLECTIVES.values() if c.perf_binary == base), None)


def from_tuner_name(name: str) -> Collective | None:
    """The collective NCCL spells `name` (exactly as `Collective.tuner_name` writes it: "allreduce"
    -> all_reduce); None for any other text. The one way back from NCCL's spelling."""
    return next((c for c in TUNED if c.tuner_name == name), None)


def parse_list(text: str) -> list[Collective]:
    """'all_reduce,all_gather' -> the collectives, in the given order, each once.

    Raises:
        ValueError: an unknown name, or an empty list.
    """
    out: list[Collective] = []
    for part in text.split(","):
        name = part.strip()
        if name and all(c.name != name for c in out):
            out.append(get(name))
    if not out:
        raise ValueError(f"no collective named in {text!r} (known: {', '.join(NAMES)})")
    return out


def gloo_reason(c: Collective) -> str | None:
    """Why torch's gloo backend does not measure `c`, or None where it does."""
    return None if c.gloo else f"torch's gloo backend has no {c.name}"
