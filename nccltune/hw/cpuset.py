"""CPU sets in the kernel's two spellings: cpulist ("0-3,8") and cpumask ("000000ff,ffffffff")."""

from __future__ import annotations


def cpus_from_cpulist(text: str) -> list[int]:
    """Parse a kernel cpulist such as "0-3,8-11" (empty text gives no CPUs).

    Raises:
        ValueError: the text is not a cpulist.
    """
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        start, end = int(lo), int(hi) if hi else int(lo)
        if end < start:
            raise ValueError(f"bad cpulist range {part!r}")
        cpus.extend(range(start, end + 1))
    return sorted(set(cpus))


def cpulist_from_cpus(cpus: list[int]) -> str:
    """Format CPU numbers as a kernel cpulist ("0-3,8-11")."""
    ordered = sorted(set(cpus))
    if not ordered:
        return ""
    ranges: list[str] = []
    start = prev = ordered[0]
    for c in ordered[1:]:
        if c == prev + 1:
            prev = c
            continue
        ranges.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = c
    ranges.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(ranges)


def cpumask_from_cpus(cpus: list[int], total_cpus: int | None = None) -> str:
    """Format CPUs as the kernel's cpumask: comma-separated 32-bit hex words, most significant first.

    This is the form NCCL's `<cpu affinity=...>` attribute takes (`cpuset.h:ncclStrToCpuset`).
    """
    top = max([*cpus, (total_cpus or 1) - 1, 0])
    nwords = top // 32 + 1
    words = [0] * nwords
    for c in cpus:
        words[c // 32] |= 1 << (c % 32)
    return ",".join(f"{w:08x}" for w in reversed(words))


def cpus_from_cpumask(text: str) -> list[int]:
    """Parse a kernel cpumask ("00000000,000000ff").

    Raises:
        ValueError: the text is not a cpumask.
    """
    words = [w for w in text.strip().split(",")]
    cpus: list[int] = []
    for i, word in enumerate(reversed(words)):
        value = int(word, 16)
        cpus.extend(i * 32 + b for b in range(32) if (value >> b) & 1)
    return cpus
