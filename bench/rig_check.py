"""What NCCL ran in one of the rig's jobs, by verify's own rule (nccl.ran.what_ran): rank 0's NCCL
log against the environment the job had and the table it names. Prints the verdict as JSON and
one TUNING line per (collective, size) beside the table's entry for that size.
   python bench/rig_check.py NCCL_LOG ENV_JSON"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nccltune.errors import NccltuneError
from nccltune.nccl.debuglog import parse_nccl_log
from nccltune.nccl.ran import TABLE_VAR, what_ran
from nccltune.tuner.table import TunerTable, read_table


def main() -> int:
    log = parse_nccl_log(Path(sys.argv[1]).read_text(errors="replace"))
    env = json.loads(Path(sys.argv[2]).read_text())
    table: TunerTable | None = None
    if env.get(TABLE_VAR):
        try:
            table = read_table(Path(env[TABLE_VAR]))
        except (NccltuneError, OSError) as exc:
            print(f"table {env[TABLE_VAR]} not read: {exc}")
    ran = what_ran(log, env, table)
    shape = ran.shape
    seen = set()
    for t in log.tuning:
        key = (t.func, t.size_bytes)
        if key in seen:
            continue
        seen.add(key)
        entry = table.choice(t.func.lower(), t.size_bytes, *shape) if table is not None and shape else None
        want = f"{entry.algo}/{entry.proto}" if entry else "no entry (NCCL's own choice)"
        print(f"  TUNING {t.func} {t.size_bytes} B -> {t.algo}/{t.proto}; table: {want}")
    print(json.dumps(ran.doc(), indent=1))
    return 0 if ran.passed else 1


if __name__ == "__main__":
    sys.exit(main())
