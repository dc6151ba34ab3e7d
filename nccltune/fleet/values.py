"""What a class profile may carry into a node's published set: one check, which `nccltune apply`
runs on a profile before it publishes anything and `nccltune fleet decide` on what it would
write, so that decide never writes a profile apply then refuses.

The profile's environment is held to every rule of a published set (publish.policy: the
allow-list of names, the value alphabet, no variable that names a file or loads code) and leaves
the publisher's own variables to the publisher: NCCL_TOPO_FILE is each node's own file (the
profile says `topology_file: true`), and the tuner's plugin, table and fingerprint are the files
the node builds from the profile's `tuner_table`. Its `chosen` label and its number of variables
stay within what a published set holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InputError
from ..publish import TOPO_FILE_VAR, TUNER_FINGERPRINT_VAR, TUNER_PLUGIN_VAR, TUNER_TABLE_VAR
from ..publish.policy import MAX_VARIABLES, check_names, check_path_variables, validate_env

# The longest `chosen` label a profile may carry into the published provenance (its note and
# `class_profile.chosen`): far above any candidate's label, far below what readers accept.
MAX_CHOSEN_CHARS = 2048
# Set by the publisher on each node, never by a profile's env.
PUBLISHER_OWN = (TOPO_FILE_VAR, TUNER_PLUGIN_VAR, TUNER_TABLE_VAR, TUNER_FINGERPRINT_VAR)


def env_problem(env: Mapping[str, str], source: str) -> InputError | None:
    """Why ``env`` cannot be a class's environment (the error apply would raise), or None."""
    for name in PUBLISHER_OWN:
        if name in env:
            why = ("is set per node; a profile says topology_file: true instead" if name == TOPO_FILE_VAR
                   else "names this node's own tuner files; a profile carries its tuner_table instead")
            return InputError(source, f"{name}: {why}")
    try:
        validate_env(env, source=source)
        check_names(env, source)
        check_path_variables(env, default_where=source)
    except InputError as exc:
        return exc
    return None


def check_values(doc: Mapping[str, Any], where: str) -> None:
    """What a (schema-valid) profile would publish: its `env`, and every section's and part's, as
    env_problem checks it, at most MAX_VARIABLES variables each, a `chosen` label of at most
    MAX_CHOSEN_CHARS characters.

    Raises:
        InputError: naming ``where`` and the field or variable (exit 78).
    """
    chosen = str(doc["chosen"])
    if len(chosen) > MAX_CHOSEN_CHARS:
        raise InputError(where, f"$.chosen: {len(chosen)} characters; a published profile's label has at most "
                         f"{MAX_CHOSEN_CHARS}", hint="regenerate the profile with `nccltune fleet decide`")
    env = doc["env"]
    if len(env) > MAX_VARIABLES:
        raise InputError(where, f"$.env: {len(env)} variables; at most {MAX_VARIABLES} are published")
    problem = env_problem(env, f"{where}: env")
    if problem is not None:
        raise problem
    # Every NCCL version's section and every job shape's part is published somewhere (the node's
    # NCCL's section into its set, every section into the env plugin's file): held to the same rules.
    for i, section in enumerate(doc.get("nccl_sections", [])):
        envs = [(f"$.nccl_sections[{i}].env", section["env"])]
        envs += [(f"$.nccl_sections[{i}].parts[{j}].env", part["env"]) for j, part in enumerate(section["parts"])]
        for field, part_env in envs:
            if len(part_env) > MAX_VARIABLES:
                raise InputError(where, f"{field}: {len(part_env)} variables; at most {MAX_VARIABLES} are published")
            problem = env_problem(part_env, f"{where}: {field}")
            if problem is not None:
                raise problem
