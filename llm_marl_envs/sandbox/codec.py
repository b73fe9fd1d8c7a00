"""Wire format for values crossing between the sandbox processes.

Only exact builtin "plain" types are representable: None, bool, int, float, complex, str,
bytes, list, tuple, dict, set, frozenset.  This is deliberate: a value returned by the
untrusted program is decoded by the trusted judge into fresh builtin objects, so no
program-defined ``__eq__``, ``__hash__``, ``__bool__`` or ``__repr__`` ever runs on the
trusted side.  pickle would execute code on load, marshal is documented as unsafe on hostile
input, and JSON cannot tell tuples from lists or represent sets and non-string keys.

Frames are a 4-byte big-endian length followed by the payload.  This module is imported by
the parent, the judge and the worker, so it uses the standard library only and no package
imports.
"""

from __future__ import annotations

import os
import select
import struct
import time

MAX_DEPTH = 100
_LEN = struct.Struct("!I")
_FLOAT = struct.Struct("!d")
_COMPLEX = struct.Struct("!dd")
_SEQ_TAGS = {list: b"l", tuple: b"t", set: b"S", frozenset: b"Z"}
_SEQ_TYPES = {tag[0]: typ for typ, tag in _SEQ_TAGS.items()}


class CodecError(ValueError):
    """The value is not plain, too deep, too large, or the bytes are malformed."""


def encode(value: object, limit: int) -> bytes:
    """Serialize a plain value; raise CodecError if it is not plain or exceeds ``limit``."""
    out = bytearray()
    _encode(value, out, limit, 0)
    if len(out) > limit:
        raise CodecError(f"value larger than {limit} bytes")
    return bytes(out)


def _encode(value: object, out: bytearray, limit: int, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    if len(out) > limit:
        raise CodecError(f"value larger than {limit} bytes")
    kind = type(value)
    if value is None:
        out += b"N"
    elif value is True:
        out += b"T"
    elif value is False:
        out += b"F"
    elif kind is int:
        size = value.bit_length() // 8 + 1
        if size > limit:
            raise CodecError(f"value larger than {limit} bytes")
        out += b"i" + _LEN.pack(size) + value.to_bytes(size, "big", signed=True)
    elif kind is float:
        out += b"f" + _FLOAT.pack(value)
    elif kind is complex:
        out += b"c" + _COMPLEX.pack(value.real, value.imag)
    elif kind is str or kind is bytes:
        data = value.encode("utf-8", "surrogatepass") if kind is str else value
        out += (b"s" if kind is str else b"b") + _LEN.pack(len(data)) + data
    elif kind in _SEQ_TAGS:
        out += _SEQ_TAGS[kind] + _LEN.pack(len(value))
        for item in value:
            _encode(item, out, limit, depth + 1)
    elif kind is dict:
        out += b"d" + _LEN.pack(len(value))
        for key, item in value.items():
            _encode(key, out, limit, depth + 1)
            _encode(item, out, limit, depth + 1)
    else:
        raise CodecError(f"unsupported type {kind.__name__!s:.60}")


def decode(data: bytes) -> object:
    """Rebuild a plain value from bytes produced by :func:`encode` (possibly forged)."""
    try:
        value, pos = _decode(memoryview(data), 0, 0)
    except (struct.error, UnicodeDecodeError, TypeError, IndexError) as exc:
        raise CodecError(f"malformed value: {type(exc).__name__}") from None
    if pos != len(data):
        raise CodecError("malformed value: trailing bytes")
    return value


def _decode(buf: memoryview, pos: int, depth: int) -> tuple[object, int]:
    if depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    tag = buf[pos]
    pos += 1
    if tag in b"NTF":
        return {78: None, 84: True, 70: False}[tag], pos
    if tag == ord("f"):
        return _FLOAT.unpack_from(buf, pos)[0], pos + _FLOAT.size
    if tag == ord("c"):
        real, imag = _COMPLEX.unpack_from(buf, pos)
        return complex(real, imag), pos + _COMPLEX.size
    (size,) = _LEN.unpack_from(buf, pos)
    pos += _LEN.size
    if tag in b"isb":
        chunk = bytes(buf[pos : pos + size])
        if len(chunk) != size:
            raise CodecError("malformed value: truncated")
        if tag == ord("i"):
            return int.from_bytes(chunk, "big", signed=True), pos + size
        return (chunk.decode("utf-8", "surrogatepass") if tag == ord("s") else chunk), pos + size
    if size > len(buf) - pos:  # every item takes at least one byte: reject absurd counts
        raise CodecError("malformed value: truncated")
    items = []
    for _ in range(size * 2 if tag == ord("d") else size):
        item, pos = _decode(buf, pos, depth + 1)
        items.append(item)
    if tag == ord("d"):
        return dict(zip(items[::2], items[1::2], strict=True)), pos
    if tag in _SEQ_TYPES:
        return _SEQ_TYPES[tag](items), pos
    raise CodecError(f"malformed value: unknown tag {tag}")


def write_frame(fd: int, payload: bytes, deadline: float | None = None) -> None:
    """Write one length-prefixed frame; on a non-blocking fd, TimeoutError past deadline."""
    data = memoryview(_LEN.pack(len(payload)) + payload)
    while data:
        try:
            data = data[os.write(fd, data) :]
        except BlockingIOError:
            remaining = float("inf") if deadline is None else deadline - time.monotonic()
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if remaining <= 0 or not poller.poll(None if deadline is None else remaining * 1000):
                raise TimeoutError from None


def read_frame(fd: int, limit: int, deadline: float | None = None) -> bytes | None:
    """Read one frame; None on EOF; TimeoutError past ``deadline`` (time.monotonic)."""
    header = _read_exact(fd, _LEN.size, deadline)
    if header is None:
        return None
    (size,) = _LEN.unpack(header)
    if size > limit:
        raise CodecError(f"message larger than {limit} bytes")
    body = _read_exact(fd, size, deadline)
    if body is None:
        raise CodecError("malformed message: truncated")
    return body


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes | None:
    chunks = bytearray()
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while len(chunks) < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise TimeoutError
        chunk = os.read(fd, size - len(chunks))
        if not chunk:
            if chunks:
                raise CodecError("malformed message: truncated")
            return None
        chunks += chunk
    return bytes(chunks)
