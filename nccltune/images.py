"""The job's image as bench.image names it: by digest, never by a tag alone (a tag can move to
another image, and the results would then describe an NCCL the jobs do not load)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InputError

# NAME@sha256:HEX, NAME being a registry path with an optional tag (the digest decides).
_DIGEST_RE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._/:-]*)@(?P<digest>sha256:[0-9a-f]{64})$")


@dataclass(frozen=True)
class Image:
    """An image by digest: `ref` as configured (name@sha256:HEX), `digest` (sha256:HEX)."""

    ref: str
    digest: str

    @property
    def enroot_name(self) -> str:
        """The enroot container made of this image (`enroot create --name`): the digest's hex."""
        return "nccltune-" + self.digest.split(":", 1)[1][:32]


def parse_image(ref: str, where: str = "bench.image") -> Image:
    """`ref` if it names its image by digest.

    Raises:
        InputError: a tag alone or anything else (exit 78)."""
    m = _DIGEST_RE.match(ref)
    if not m:
        raise InputError(where, f"{ref!r} does not name its image by digest",
                         hint="write NAME@sha256:<64 hex digits> (podman image inspect --format '{{.Digest}}' NAME)")
    return Image(ref, m.group("digest"))
