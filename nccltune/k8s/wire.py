"""The protocol buffers wire format of the few kubelet device plugin messages the plugin sends and
reads (API v1beta1, the schema in deviceplugin.proto beside this file), without generated code.

Why by hand: the plugin needs six small messages, and generated code ties the image to one
protobuf runtime (a ``_pb2`` module refuses a runtime older than the protoc that made it). The
format is small and stable: a field is a varint key (field number << 3 | wire type) followed by a
varint (type 0) or a length and that many bytes (type 2: strings, nested messages, and a map's
entries, each a message of key = 1 and value = 2). Proto3 leaves a field at its default value out,
and a reader skips fields it does not know, which ``fields`` does too. tests/test_k8s_deviceplugin.py
checks every message against protobuf's own implementation, compiled from deviceplugin.proto.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

VARINT = 0
FIXED64 = 1
LENGTH = 2
FIXED32 = 5


class WireError(ValueError):
    """A message that is not valid protocol buffers wire format."""


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # proto3 int32/int64: two's complement in ten bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def string(number: int, value: str) -> bytes:
    """A string field; empty strings are left out, as proto3 does."""
    if not value:
        return b""
    data = value.encode("utf-8")
    return _key(number, LENGTH) + _varint(len(data)) + data


def message(number: int, body: bytes) -> bytes:
    """A nested message field (also written when empty: it is then present, not default)."""
    return _key(number, LENGTH) + _varint(len(body)) + body


def boolean(number: int, value: bool) -> bytes:
    return _key(number, VARINT) + _varint(1) if value else b""


def strings(number: int, values: Iterable[str]) -> bytes:
    return b"".join(string(number, v) if v else _key(number, LENGTH) + b"\0" for v in values)


def string_map(number: int, values: Mapping[str, str]) -> bytes:
    """A map<string, string> field: one entry message (key = 1, value = 2) per item."""
    return b"".join(message(number, string(1, k) + string(2, v)) for k, v in sorted(values.items()))


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than ten bytes")


@dataclass(frozen=True)
class Field:
    number: int
    wire_type: int
    value: int | bytes


def fields(data: bytes) -> Iterator[Field]:
    """Every field of a message in order, fixed-width ones as their bytes.

    Raises:
        WireError: truncated, or a wire type proto3 does not use.
    """
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wire_type == VARINT:
            value, pos = _read_varint(data, pos)
            yield Field(number, wire_type, value)
        elif wire_type == LENGTH:
            size, pos = _read_varint(data, pos)
            if pos + size > len(data):
                raise WireError(f"field {number}: {size} bytes announced, {len(data) - pos} left")
            yield Field(number, wire_type, data[pos:pos + size])
            pos += size
        elif wire_type in (FIXED64, FIXED32):
            size = 8 if wire_type == FIXED64 else 4
            if pos + size > len(data):
                raise WireError(f"field {number}: truncated fixed-width value")
            yield Field(number, wire_type, data[pos:pos + size])
            pos += size
        else:
            raise WireError(f"field {number}: wire type {wire_type} is not one proto3 writes")


def repeated_bytes(data: bytes, number: int) -> list[bytes]:
    """The values of a repeated length-delimited field (strings, messages)."""
    out = []
    for f in fields(data):
        if f.number == number:
            if not isinstance(f.value, bytes):
                raise WireError(f"field {number}: a varint where a string or message belongs")
            out.append(f.value)
    return out


def repeated_strings(data: bytes, number: int) -> list[str]:
    try:
        return [v.decode("utf-8") for v in repeated_bytes(data, number)]
    except UnicodeDecodeError as exc:
        raise WireError(f"field {number}: not UTF-8") from exc


def one_string(data: bytes, number: int) -> str:
    """A singular string field (the last one wins, as protobuf reads it); "" when absent."""
    found = repeated_strings(data, number)
    return found[-1] if found else ""


def one_varint(data: bytes, number: int) -> int:
    value = 0
    for f in fields(data):
        if f.number == number:
            if not isinstance(f.value, int):
                raise WireError(f"field {number}: a string or message where a varint belongs")
            value = f.value
    return value
