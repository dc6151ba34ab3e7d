"""The tuning fingerprint: everything a published tuning depends on, in sixteen hex digits.

The sweep writes it into the provenance of what it publishes; the daemon computes it from its own
view (topology, its probe of the worker's NCCL, the config) and re-tunes when the two differ.
"""

from __future__ import annotations

import hashlib
import json

from .. import __version__
from ..config import Config


def tuning_fingerprint(cfg: Config, topology_fp: str, nccl_version: str | None, demo: bool) -> str:
    """Everything a published tuning depends on: when it changes, the daemon re-tunes."""
    s = cfg.sweep
    facts = {
        "topology": topology_fp, "nccl": nccl_version, "nccltune": __version__, "demo": demo,
        "profile": s.profile, "profiles": {k: {str(a): b for a, b in v.items()} for k, v in s.profiles.items()},
        "variables": s.variables, "pin": s.pin, "unpin": s.unpin, "exclude": s.exclude,
        "min_gain_pct": s.min_gain_pct, "max_regression_pct": s.max_regression_pct,
        "async_error_handling": s.async_error_handling,
        "sizes": [cfg.bench.min_bytes, cfg.bench.max_bytes, cfg.bench.factor],
    }
    if cfg.bench.image:
        # Another image is another NCCL (and torch) even at the same version: a new tuning.
        facts["image"] = list(cfg.bench.image)
    if cfg.tuner.plugin != "auto":
        # Whether the tuner table is used changes what is published; the default leaves earlier
        # fingerprints as they were.
        facts["tuner_plugin"] = cfg.tuner.plugin
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
