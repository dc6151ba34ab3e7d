"""deploy/container/Containerfile as the tests read it, without a container runtime: its
instructions (continued lines joined), the image's own stage (after the last FROM) with its ARG
defaults, the commands that create the rank user, and those commands run with `--prefix` against
an /etc of their own (`user_db`), so that the image's /etc/passwd and /etc/group can be read, or
stand in for this machine's in a mount namespace."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO

CONTAINERFILE = REPO / "deploy" / "container" / "Containerfile"
USER_TOOLS = ("groupadd", "useradd")
# What a base image's user database holds that the rank user's creation could meet: root, and the
# overflow user and group (65534) every Debian image has.
BASE_PASSWD = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
BASE_GROUP = "root:x:0:\nnogroup:x:65534:\n"


def instructions(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) for every instruction, comments and blank lines left out."""
    joined = (CONTAINERFILE.read_text() if text is None else text).replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def image_stage() -> list[tuple[str, str]]:
    """The instructions of the stage that becomes the image: after the last FROM."""
    ins = instructions()
    last = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last + 1:]


def arg_defaults(stage: list[tuple[str, str]]) -> dict[str, str]:
    """NAME -> default of the stage's `ARG NAME=default` lines."""
    out = {}
    for word, rest in stage:
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            out[name.strip()] = value.strip()
    return out


def expand(text: str, args: dict[str, str]) -> str:
    """`${NAME}` and `$NAME` replaced by the ARG defaults, as the build does without --build-arg."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def user_commands() -> list[list[str]]:
    """The image stage's groupadd and useradd commands, each an argv, in their order."""
    stage = image_stage()
    args = arg_defaults(stage)
    out = []
    for word, rest in stage:
        if word != "RUN" or not any(tool in rest for tool in USER_TOOLS):
            continue
        for part in expand(rest, args).split("&&"):
            argv = shlex.split(part)
            if argv and argv[0] in USER_TOOLS:
                out.append(argv)
    return out


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    group: str  # the name of the group the user's gid belongs to
    options: tuple[str, ...]  # useradd's options, as written


def option(argv: list[str], *names: str) -> str:
    """The value of the first of `names` in `argv` (`--name value` or `--name=value`)."""
    for i, word in enumerate(argv):
        if word in names:
            return argv[i + 1]
        for name in names:
            if name.startswith("--") and word.startswith(name + "="):
                return word.partition("=")[2]
    raise KeyError(names)


def rank_account() -> Account:
    """The user the image creates, with the uid and gid its commands give it."""
    commands = user_commands()
    (useradd,) = [c for c in commands if c[0] == "useradd"]
    (groupadd,) = [c for c in commands if c[0] == "groupadd"]
    gid = int(option(useradd, "--gid", "-g"))
    assert int(option(groupadd, "--gid", "-g")) == gid, "the user's group is the one groupadd makes"
    return Account(useradd[-1], int(option(useradd, "--uid", "-u")), gid, groupadd[-1], tuple(useradd[1:-1]))


def user_db(root: Path) -> Path:
    """Run the image's user commands with `--prefix root` against a base image's user database;
    returns root/etc, holding the passwd and group files the image would have.

    Needs root (shadow's tools write the files under their lock) and shadow's tools on PATH."""
    etc = root / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text(BASE_PASSWD)
    (etc / "group").write_text(BASE_GROUP)
    for name in ("shadow", "gshadow"):
        (etc / name).write_text("")
        (etc / name).chmod(0o640)
    for argv in user_commands():
        tool = shutil.which(argv[0])
        assert tool is not None, argv[0]
        subprocess.run([tool, "--prefix", str(root), *argv[1:]], check=True, capture_output=True, text=True)
    return etc
