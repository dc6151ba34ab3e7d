"""What is published, used and written: `env`, `exec` and `apply`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import EXIT_OK, CheckFailed, NccltuneError, UsageError
from .context import load_cfg, out, reading_cfg

if TYPE_CHECKING:
    from ..publish import PublishedSet


def _job_nnodes(args: argparse.Namespace) -> int | None:
    """--nnodes, else NCCLTUNE_JOB_NNODES, else None (the job does not say)."""
    from ..publish import job_nnodes

    return args.nnodes if args.nnodes is not None else job_nnodes(os.environ)


def cmd_env(args: argparse.Namespace) -> int:
    """Print what is published as a job with the calling environment gets it (nccltune.delivery.jobenv: its
    own variables kept, nothing under NCCLTUNE_DISABLE; --as-published: byte for byte), after
    checking the whole set: trusted owner and mode, every line one nccltune writes, one generation.

    The every-job part always, then the part of the job's shape (publish/shapes.py: the
    single-node part for --nnodes 1, the part of the largest measured node count <= N for
    --nnodes N); a single-node part the job does not get as comments that say which jobs get it
    (so the output can still be sourced or used as an env file). --format json is nccl.json:
    every part, labelled.
    """
    from ..delivery.jobenv import JobDecision, filter_text, launch, site_comment, untuned_text
    from ..nccl.site import conf_settings
    from ..nccl.sitetuner import default_conf_files, existing_tuner
    from ..publish import ENV_NAME, JSON_NAME, SH_NAME, read_set
    from ..publish.readback import part_files
    from ..publish.shapes import shape_key
    from ..report.sweep import single_node_comment

    cfg = reading_cfg(args)
    nnodes = _job_nnodes(args)
    fmt = "json" if args.json else args.format
    got: PublishedSet | None
    decision: JobDecision | None = None
    if fmt == "json" or args.as_published:
        # The files as they are, for inspection or for a file others read: a set that cannot be
        # used is an error here (exit 78 or 1), not an untuned job.
        got = read_set(cfg.publish_dir)
        if got is None:
            raise CheckFailed(f"nothing is published in {cfg.publish_dir}", hint="run `nccltune sweep` first")
    else:
        # For a job: the failure policy and the precedence rule (nccltune.delivery.jobenv.launch).
        job = launch(cfg.publish_dir, os.environ, nnodes)
        if job.untuned is not None:
            print(f"nccltune: {job.message}", file=sys.stderr)
            # What the job gets (sourced, it sets nothing but the marker); the status says why.
            sys.stdout.write(untuned_text(job, fmt))
            return job.exit_code
        got, decision = job.published, job.decision
        if got is None:  # opted out: the set is shown commented out where it can be read
            got = _readable_set(cfg.publish_dir)
        if got is None:
            sys.stdout.write("# nccltune: nothing applied (NCCLTUNE_DISABLE is set)\n")
            return EXIT_OK
    if fmt == "json":
        sys.stdout.write(got.texts[JSON_NAME])
        return EXIT_OK
    name = SH_NAME if fmt == "sh" else ENV_NAME
    # For a job (the default) the precedence rule applies to what is printed: what the calling
    # environment already sets is shown as a comment.
    sys.stdout.write(got.texts[name] if decision is None else filter_text(got.texts[name], decision))
    # The part of the job's shape (publish/shapes.py), from its own file of the set.
    key = shape_key(got.parts, nnodes)
    if key is not None and got.parts[key]:
        part = got.texts[part_files(key)[0 if fmt == "sh" else 1]]
        sys.stdout.write(part if decision is None else filter_text(part, decision))
    if got.single_node_env and key != 1:
        sys.stdout.write(single_node_comment(got.single_node_env, nnodes))
    if decision is not None:
        # What the site gives the job besides (NCCL's conf files, a tuner nccltune leaves in place).
        sys.stdout.write(site_comment(conf_settings(os.environ), existing_tuner(os.environ,
                                                                                 default_conf_files(os.environ))))
    return EXIT_OK


def _readable_set(publish_dir: Path) -> PublishedSet | None:
    from ..publish import read_set

    try:
        return read_set(publish_dir)
    except NccltuneError:
        return None


# What shells return for a command that is missing (127) or cannot be run (126).
EXIT_NOT_FOUND = 127
EXIT_CANNOT_RUN = 126


def cmd_exec(args: argparse.Namespace) -> int:
    """Run a command with the published environment: the every-job part, plus the part of the
    job's shape (--nnodes N, or NCCLTUNE_JOB_NNODES=N: the single-node part for one node, the
    part of the largest measured node count <= N for more; publish/shapes.py), less what
    the calling environment sets itself, and the marker NCCLTUNE_APPLIED of what it added;
    nothing under NCCLTUNE_DISABLE; untuned, said on stderr, when the set cannot be used."""
    from ..delivery.jobenv import launch

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("nccltune exec: give a command after --, e.g. nccltune exec -- torchrun train.py")
    cfg = load_cfg(args)
    nnodes = _job_nnodes(args)
    # The failure policy and the precedence rule in one place (nccltune.delivery.jobenv.launch):
    # a set that cannot be used runs the command untuned, said once here, never refused.
    job = launch(cfg.publish_dir, os.environ, nnodes)
    if job.untuned is not None:
        print(f"nccltune: {job.message}", file=sys.stderr)
    for note in job.decision.notes("nccltune"):
        print(note, file=sys.stderr)
    env = job.environment(os.environ)
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
