"""What is published, used and written: `env`, `exec` and `apply`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import EXIT_OK, CheckFailed, UsageError
from .common import load_cfg, out, reading_cfg


def _job_nnodes(args: argparse.Namespace) -> int | None:
    """--nnodes, else NCCLTUNE_JOB_NNODES, else None (the job does not say)."""
    from ..publish import job_nnodes

    return args.nnodes if args.nnodes is not None else job_nnodes(os.environ)


def cmd_env(args: argparse.Namespace) -> int:
    """Print what is published as a job with the calling environment gets it (nccltune.delivery.jobenv: its
    own variables kept, nothing under NCCLTUNE_DISABLE; --as-published: byte for byte), after
    checking the whole set: trusted owner and mode, every line one nccltune writes, one generation.

    The every-job part always; the single-node part as assignments for a job known to be
    single-node (--nnodes 1), otherwise as comments that say which jobs get it (so the output
    can still be sourced or used as an env file). --format json is nccl.json: both parts, labelled.
    """
    from ..delivery.jobenv import decide, filter_text, site_comment
    from ..nccl.site import conf_settings
    from ..nccl.sitetuner import default_conf_files, existing_tuner
    from ..publish import ENV_NAME, JSON_NAME, SH_NAME, SINGLE_ENV_NAME, SINGLE_SH_NAME, job_env, read_set
    from ..report.sweep import single_node_comment

    cfg = reading_cfg(args)
    nnodes = _job_nnodes(args)
    got = read_set(cfg.publish_dir)
    if got is None:
        raise CheckFailed(f"nothing is published in {cfg.publish_dir}", hint="run `nccltune sweep` first")
    fmt = "json" if args.json else args.format
    if fmt == "json":
        sys.stdout.write(got.texts[JSON_NAME])
        return EXIT_OK
    name, single_name = {"sh": (SH_NAME, SINGLE_SH_NAME), "env": (ENV_NAME, SINGLE_ENV_NAME)}[fmt]
    # For a job (the default) the precedence rule applies to what is printed: what the calling
    # environment already sets, or everything under NCCLTUNE_DISABLE, is shown as a comment.
    decision = None if args.as_published else decide(job_env(got, nnodes), os.environ, got.set_id)
    sys.stdout.write(got.texts[name] if decision is None else filter_text(got.texts[name], decision))
    if got.single_node_env and nnodes == 1:
        single = got.texts[single_name]
        sys.stdout.write(single if decision is None else filter_text(single, decision))
    elif got.single_node_env:
        sys.stdout.write(single_node_comment(got.single_node_env, nnodes))
    if decision is not None:
        # What the site gives the job besides (NCCL's conf files, a tuner nccltune leaves in place).
        sys.stdout.write(site_comment(conf_settings(os.environ), existing_tuner(os.environ,
                                                                                 default_conf_files(os.environ))))
    return EXIT_OK


# What shells return for a command that is missing (127) or cannot be run (126).
EXIT_NOT_FOUND = 127
EXIT_CANNOT_RUN = 126


def cmd_exec(args: argparse.Namespace) -> int:
    """Run a command with the published environment: the every-job part, plus the single-node
    part when the job is known to span one node (--nnodes 1, or NCCLTUNE_JOB_NNODES=1), less what
    the calling environment sets itself, and the marker NCCLTUNE_APPLIED of what it added;
    nothing under NCCLTUNE_DISABLE."""
    from ..delivery.jobenv import decide
    from ..publish import job_env, read_set

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("nccltune exec: give a command after --, e.g. nccltune exec -- torchrun train.py")
    cfg = load_cfg(args)
    nnodes = _job_nnodes(args)
    got = read_set(cfg.publish_dir)
    env = dict(os.environ)
    if got is None:
        print(f"nccltune: nothing published in {cfg.publish_dir}; running with the current environment",
              file=sys.stderr)
    else:
        # The every-job part always; the single-node part only for a job known to run on one node;
        # of those, what the job does not set itself (the rule in nccltune.delivery.jobenv).
        decision = decide(job_env(got, nnodes), env, got.set_id)
        for note in decision.notes("nccltune"):
            print(note, file=sys.stderr)
        env = decision.environment(env)
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        print(f"nccltune: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_RUN
    return EXIT_OK  # pragma: no cover - exec does not return


def profile_and_demo(args: argparse.Namespace) -> tuple[Path, str | bool | None]:
    """(PROFILE, --demo's value) of `apply`: `--demo [SNAPSHOT]` takes the word after it, so in
    `apply --demo class.json` that word is the profile, and the demo its bundled node."""
    profile, demo = args.profile_path, args.demo
    if profile is None and isinstance(demo, str):
        profile, demo = demo, True
    if profile is None:
        raise UsageError("apply: the PROFILE argument is required", hint="nccltune apply PROFILE [--demo [SNAPSHOT]]")
    return Path(profile), demo


def cmd_apply(args: argparse.Namespace) -> int:
    from ..fleet.apply import apply_profile

    profile, demo = profile_and_demo(args)
    cfg = load_cfg(args, demo=bool(demo))
    got = apply_profile(cfg, profile, demo=demo, python=args.python)
    out(f"Applied {got.note}: generation {got.published.generation} in {cfg.publish_dir}")
    return EXIT_OK
