"""A class profile's tuner table on one node: checked, rendered with this node's tuning
fingerprint, and the plugin built, for `nccltune apply` to publish with the environment.

The rules are a node's own sweep's: nothing of the table is published under `tuner.plugin: keep`,
nor under `auto` when another tuner is already set (environment or NCCL's conf files), nor on
the CPU demo (gloo never loads NCCL's tuner), nor without a C compiler; the profile's environment
is published all the same, as it was judged on its own. A table the plugin would refuse is
refused before anything is written.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import InputError
from ..nccl.sitetuner import default_conf_files, existing_tuner
from ..publish import Tuner
from ..tuner.build import build_env_plugin, build_plugin
from ..tuner.envfile import EnvValue, render_env_file, value_problem
from ..tuner.table import TableEntry, TunerTable, render_table
from .parts import sections, shape_envs

log = logging.getLogger(__name__)


def profile_table(doc: Mapping[str, Any], where: str, fingerprint: str) -> TunerTable:
    """The profile's entries as a table carrying `fingerprint` (the tuning fingerprint the node
    publishes, which the plugin checks).

    Raises:
        InputError: an entry the plugin would refuse (exit 78).
    """
    # Each NCCL version's entries are that version's section, this node's NCCL's first: the plugin
    # applies the section of the NCCL a job runs, whichever it is.
    nccl = doc["versions"]["nccl"]
    if not nccl:
        raise InputError(where, "versions.nccl: the profile names no NCCL version, and a tuner table applies only "
                         "to the NCCL version it was measured with", hint="regenerate the profile with "
                         "`nccltune fleet decide` from exports of NCCL runs")
    others = [(str(s["nccl"]), s["tuner_table"]) for s in sections(doc) if s["nccl"] and s["nccl"] != nccl]
    entries = tuple(TableEntry(str(e["collective"]), int(e["min_bytes"]), int(e["max_bytes"]), int(e["nnodes"]),
                               int(e["nranks"]), int(e["ranks_per_node"]), str(e["algo"]), str(e["proto"]),
                               int(e["channels"] or 0), version)
                    for version, rows in [(str(nccl), doc["tuner_table"]), *others] for e in rows)
    table = TunerTable(fingerprint, entries)
    try:
        render_table(table)
    except ValueError as exc:
        raise InputError(where, f"tuner_table: {exc}", hint="regenerate the profile with `nccltune fleet decide`") \
            from exc
    return table


def profile_env_text(doc: Mapping[str, Any], where: str) -> str | None:
    """The env plugin's file for a profile of several NCCL versions: per version, the safe part as
    scope `all`, the single-node part as `single`, and as `multi` the values every multi-node part
    chose alike (the file has one scope for every job of two nodes or more); None for a profile of
    one version, whose values the env files carry, and for one the file cannot hold (logged: the
    env files still carry this node's version's values). A value the plugin would refuse (a space
    in it, a name it never answers) is left out of the file, logged."""
    keyed = [s for s in sections(doc) if s["nccl"]]
    if len(keyed) < 2:
        return None
    values: list[EnvValue] = []
    for section in keyed:
        safe, parts = shape_envs(section)
        multi = [part for n, part in sorted(parts.items()) if n > 1]
        common = {k: v for k, v in multi[0].items() if all(p.get(k) == v for p in multi[1:])} if multi else {}
        for scope, named in (("all", safe), ("single", parts.get(1, {})), ("multi", common)):
            # Only NCCL's own variables reach NCCL through the plugin (torch reads its own from the env files).
            for name, value in sorted(named.items()):
                v = EnvValue(str(section["nccl"]), scope, name, value)
                problem = value_problem(v) if name.startswith("NCCL_") else "not NCCL's"
                if problem is None:
                    values.append(v)
                elif name.startswith("NCCL_"):
                    log.warning("%s: NCCL %s, %s: left out of the env plugin's file: %s", where, v.nccl, name, problem)
    try:
        return render_env_file(tuple(values))
    except ValueError as exc:
        log.warning("%s: the env plugin's file is not published: %s", where, exc)
        return None


def profile_tuner(cfg: Config, doc: Mapping[str, Any], where: str, fingerprint: str,
                  env: Mapping[str, str]) -> tuple[Tuner | None, str | None]:
    """The plugin and table to publish for this profile, or None; and what to say about the table
    (None when the profile has none). `env` is the calling environment (for a tuner already set).

    Raises:
        InputError: the table is malformed (exit 78).
    """
    if not doc["tuner_table"]:
        return None, None
    if doc["demo"]:  # gloo ran, no NCCL: no version to key the table by, and nothing loads it
        log.info("%s: the tuner table is not published: %s", where, _not_published(cfg, doc, env))
        return None, f"tuner table not published: {_not_published(cfg, doc, env)}"
    table = profile_table(doc, where, fingerprint)
    why = _not_published(cfg, doc, env)
    if why is None:
        with tempfile.TemporaryDirectory(prefix="nccltune-apply-") as tmp:
            built = build_plugin(Path(tmp))
            if built.ok and built.path is not None:
                plugin = built.path.read_bytes()
                note = f"tuner table of {len(table.entries)} entries"
                env_text = profile_env_text(doc, where)
                env_plugin = _env_plugin(Path(tmp) / "env") if env_text is not None else None
                if env_plugin is not None:
                    note += ", env plugin file of every NCCL version's values"
                return Tuner(plugin, render_table(table), env_plugin, env_text if env_plugin else None), note
            why = built.reason or built.message
    # The demo never publishes a table (as its own sweep never does): nothing to warn about.
    (log.info if doc["demo"] else log.warning)("%s: the tuner table is not published: %s", where, why)
    return None, f"tuner table not published: {why}"


def _env_plugin(out_dir: Path) -> bytes | None:
    """The env plugin built for this node, or None (logged: the env files carry this node's values)."""
    built = build_env_plugin(out_dir)
    if built.ok and built.path is not None:
        return built.path.read_bytes()
    log.warning("the env plugin is not published: %s", built.reason or built.message)
    return None


def _not_published(cfg: Config, doc: Mapping[str, Any], env: Mapping[str, str]) -> str | None:
    if doc["demo"]:
        return "CPU demo profile (gloo never loads NCCL's tuner)"
    if cfg.tuner.plugin == "keep":
        return "tuner.plugin is keep: nccltune never sets NCCL_TUNER_PLUGIN"
    existing = existing_tuner(env, default_conf_files(env))
    if existing is not None and cfg.tuner.plugin == "auto":
        return (f"{existing.describe()} is already set and kept (tuner.plugin: auto; set "
                "tuner.plugin: nccltune to replace it)")
    return None
