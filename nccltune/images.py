"""The job's image as bench.image names it: by digest, never by a tag alone (a tag can move to
another image, and the results would then describe an NCCL the jobs do not load).

Two forms, each with its image's digest:
- ``NAME@sha256:HEX``: an image of the runtime's store or a registry (podman, docker; enroot's
  container made of it);
- ``/DIR@sha256:HEX``: the image's root filesystem unpacked in the directory DIR (an absolute
  path), which podman runs as it is (``--rootfs``), read-only. No runtime can recompute an image's
  digest from an unpacked tree, so the digest is recorded as named, as for enroot's container: the
  directory must be made from that image and kept as it was made.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import InputError

# NAME@sha256:HEX, NAME being a registry path with an optional tag (the digest decides).
_DIGEST_RE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._/:-]*)@(?P<digest>sha256:[0-9a-f]{64})$")
# /DIR@sha256:HEX: an absolute, normalised directory path (no '@', whitespace or control character).
_ROOTFS_RE = re.compile(r"^(?P<path>/[^@\s\x00-\x1f\x7f]+)@(?P<digest>sha256:[0-9a-f]{64})$")


@dataclass(frozen=True)
class Image:
    """An image by digest: `ref` as configured (NAME@sha256:HEX or /DIR@sha256:HEX), `digest`
    (sha256:HEX), and `rootfs`, the directory of an unpacked root filesystem (None: by name)."""

    ref: str
    digest: str
    rootfs: str | None = None

    @property
    def enroot_name(self) -> str:
        """The enroot container made of this image (`enroot create --name`): the digest's hex."""
        return "nccltune-" + self.digest.split(":", 1)[1][:32]


def parse_image(ref: str, where: str = "bench.image") -> Image:
    """`ref` if it names its image by digest, by name or as an unpacked root filesystem.

    Raises:
        InputError: a tag alone, a relative or unnormalised directory, or anything else (exit 78)."""
    m = _DIGEST_RE.match(ref)
    if m:
        return Image(ref, m.group("digest"))
    m = _ROOTFS_RE.match(ref)
    if m and os.path.normpath(m.group("path")) == m.group("path"):
        return Image(ref, m.group("digest"), rootfs=m.group("path"))
    raise InputError(where, f"{ref!r} does not name its image by digest",
                     hint="write NAME@sha256:<64 hex digits> (podman image inspect --format '{{.Digest}}' NAME), "
                          "or /DIR@sha256:<64 hex digits> for the image's root filesystem unpacked in DIR")
