"""What root pays to read one rank's NCCL log of nccllog.MAX_LOG_BYTES (or --mib MiB): the wall
time and the peak memory of reading it as the runner does (nccllog.read_log, bounded) and parsing
it (debuglog.parse_nccl_log), for a log made of a real rank 0 log's lines (one of the test
fixtures: its init lines once, then its TUNING lines, one per collective launch, over and over,
as a long trial logs them).

    python bench/nccl_log_parse.py             # the cap itself
    python bench/nccl_log_parse.py --mib 16
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nccltune.nccl.debuglog import choices_by_size, parse_nccl_log
from nccltune.trials.nccllog import MAX_LOG_BYTES, read_log

FIXTURE = (Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "nccllog" / "h200x1-nccl-hosts"
           / "defaults-2hosts.rank0.nccl.log")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=MAX_LOG_BYTES / (1 << 20), help="the log's size")
    args = parser.parse_args()
    lines = FIXTURE.read_text().splitlines(keepends=True)
    tuning = "".join(line for line in lines if "Bytes ->" in line).encode()
    head = "".join(line for line in lines if "Bytes ->" not in line).encode()
    want = int(args.mib * (1 << 20))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nccl.1.log"
        with open(path, "wb") as fh:
            fh.write(head)
            written = len(head)
            while written < want:
                fh.write(tuning)
                written += len(tuning)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.monotonic()
        text = read_log(path).decode(errors="replace")
        log = parse_nccl_log(text)
        del text
        choices = choices_by_size(log)
        wall = time.monotonic() - started
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"log {written / (1 << 20):.1f} MiB ({min(written, MAX_LOG_BYTES) / (1 << 20):.1f} MiB read), "
          f"{len(log.tuning)} TUNING lines, {len(choices)} sizes")
    print(f"read + parse: {wall:.2f} s wall, peak RSS {peak / 1024:.0f} MiB (before: {before / 1024:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
