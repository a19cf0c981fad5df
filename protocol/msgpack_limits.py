"""Bounded msgpack decoding of untrusted bytes: every decoder in protocol/ unpacks through `unpack_bounded`.

msgpack makes one Python object per value, and a value can be a single byte (0x90 is an empty array), so
`msgpack.unpackb` turns a 16 MiB input into 16 M objects (about 1.2 GB and seconds of garbage collection)
before any schema sees it; its C unpacker also allocates room for an array's declared elements up front
(1,023 nested arrays declaring 65,535 elements each: 67 MB for 3 KB of headers). `unpack_bounded` walks
the containers itself, reading each value's type byte and length (the msgpack spec's header table) and
checking the bounds before it makes the value; msgpack decodes every scalar from its slice of the input,
without a copy of the rest. The bounds:
- `max_bytes`: the input's length;
- `max_values`: every value counts once (a map entry counts its key and its value), so an input costs at
  most `max_values` objects, whatever its size; a string or byte string is at most the input long;
- `max_containers`: arrays and maps among those values (default: `max_values`); they cost most, as the
  garbage collector rescans every one it tracks (600,000 empty lists take about a second where torch
  is loaded, 600,000 small integers 0.15 s);
- `max_depth`: levels of containers (a map of scalars has 1, a map of lists of lists 3); at most MAX_DEPTH.
Lists grow as their elements arrive, so a declared length allocates nothing. Map keys must be strings (or
byte strings), as msgpack's `strict_map_key`; extension types are refused. Any violation raises
`SchemaError` naming `what` and the bound, and every msgpack error is wrapped in it.
"""

from __future__ import annotations

from typing import Any

import msgpack

from protocol.schema import MAX_DEPTH, SchemaError, describe

_SCALAR, _ARRAY, _MAP, _BAD = 0, 1, 2, 3


def _header(b: int) -> tuple[int, int, int, int]:
    """(kind, header bytes, width of the big-endian length field after the type byte, fixed length) of the
    value whose type byte is b; a scalar spans header + length bytes, a container holds `length` values."""
    if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):  # fixint, nil, false, true
        return _SCALAR, 1, 0, 0
    if b <= 0x8F:
        return _MAP, 1, 0, b & 0x0F
    if b <= 0x9F:
        return _ARRAY, 1, 0, b & 0x0F
    if b <= 0xBF:  # fixstr
        return _SCALAR, 1, 0, b & 0x1F
    if b in (0xC4, 0xC5, 0xC6, 0xD9, 0xDA, 0xDB):  # bin 8/16/32, str 8/16/32
        width = 1 << ((b - 0xC4) if b <= 0xC6 else (b - 0xD9))
        return _SCALAR, 1 + width, width, 0
    if 0xCA <= b <= 0xD3:  # float 32/64, uint 8-64, int 8-64
        return _SCALAR, 1 + {0xCA: 4, 0xCB: 8}.get(b, 1 << ((b - 0xCC) % 4)), 0, 0
    if b in (0xDC, 0xDD, 0xDE, 0xDF):  # array 16/32, map 16/32
        width = 2 if b in (0xDC, 0xDE) else 4
        return (_ARRAY if b <= 0xDD else _MAP), 1 + width, width, 0
    return _BAD, 1, 0, 0  # 0xC1 (never used), extension types 0xC7-0xC9 and 0xD4-0xD8


_HEADERS = tuple(_header(b) for b in range(256))
_ONE_BYTE: dict[int, Any] = {b: b - 256 * (b >= 0xE0) for b in (*range(0x80), *range(0xE0, 0x100))}
_ONE_BYTE |= {0xC0: None, 0xC2: False, 0xC3: True}


def unpack_bounded(
    data: bytes | bytearray | memoryview,
    what: str,
    *,
    max_bytes: int,
    max_values: int,
    max_containers: int | None = None,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """The one msgpack value in `data` (str for msgpack str, bytes for bin), within the bounds above.

    what: names the input in errors ("envelope", "fragment header"). Raises SchemaError (a ProtocolError).
    """
    view = memoryview(data).cast("B")
    n = len(view)
    if n > max_bytes:
        raise SchemaError(f"{what}: {n} bytes exceeds the {max_bytes}-byte limit")
    assert 0 <= max_depth <= MAX_DEPTH, "deeper than the schemas go, and than Python's stack allows"
    max_containers = max_values if max_containers is None else max_containers
    at, values_left, containers_left = 0, max_values, max_containers

    def value(depth: int) -> Any:
        nonlocal at, values_left, containers_left
        values_left -= 1
        if values_left < 0:
            raise SchemaError(f"{what}: more than {max_values} msgpack values, over the limit")
        if at >= n:
            raise SchemaError(f"{what}: msgpack truncated at byte {n}")
        b = view[at]
        if b in _ONE_BYTE:  # the commonest values (small integers, nil, booleans): decoded here
            at += 1
            return _ONE_BYTE[b]
        kind, head, width, length = _HEADERS[b]
        if kind == _BAD:
            raise SchemaError(f"{what}: byte 0x{b:02x} at {at} is not a msgpack type this protocol uses")
        if at + head > n:
            raise SchemaError(f"{what}: msgpack truncated at byte {n}")
        if width:
            length = int.from_bytes(view[at + 1 : at + head], "big")
        if kind == _SCALAR:
            start, at = at, at + head + length
            if at > n:
                raise SchemaError(f"{what}: msgpack truncated at byte {n}")
            return msgpack.unpackb(view[start:at], raw=False)
        at += head
        if depth >= max_depth:
            raise SchemaError(f"{what}: msgpack nested deeper than {max_depth} level(s) of containers")
        containers_left -= 1
        if containers_left < 0:
            raise SchemaError(f"{what}: more than {max_containers} msgpack arrays and maps, over the limit")
        if kind == _ARRAY:
            return [value(depth + 1) for _ in range(length)]
        out = {}
        for _ in range(length):
            key = value(depth + 1)
            if not isinstance(key, (str, bytes)):
                raise SchemaError(f"{what}: map key {describe(key)} is not a string")
            out[key] = value(depth + 1)
        return out

    try:
        result = value(0)
    except SchemaError:
        raise
    except Exception as e:  # a scalar msgpack refuses: a string that is not UTF-8
        raise SchemaError(f"{what}: not valid msgpack ({type(e).__name__}: {str(e)[:80]})") from e
    if at != n:
        raise SchemaError(f"{what}: {n - at} bytes after the msgpack value")
    return result


__all__ = ["unpack_bounded"]
