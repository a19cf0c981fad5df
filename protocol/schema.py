"""Type-checked conversion between message dataclasses and plain msgpack-able dicts.

Messages arrive from the network as dicts; `from_dict` checks every field against the dataclass's type
hints and raises `SchemaError` naming the bad field, so a malformed message never reaches the runtime.

Rules every converted value obeys, whatever the message:
- floats are finite unless the field's metadata says otherwise (`field(metadata=NONFINITE_OK)`, for
  reported metrics such as a diverged loss); the dataclasses' `__post_init__` add per-field ranges
  (`check_range`) and call `check_finite`, so a value built in code obeys the same rules as one decoded;
- nesting is bounded (`MAX_DEPTH`), so a hostile value cannot exhaust the interpreter's stack;
- an error describes a bad value with `describe`: short, bounded and free of `repr()` (a list nested a
  thousand deep or a 16 MiB string renders in a few dozen characters).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")

MAX_DEPTH = 32
"""Deepest nesting `from_dict` converts (maps, lists and dataclasses together); the messages need 4."""
NONFINITE_OK = types.MappingProxyType({"nonfinite": True})
"""Field metadata: this float field may hold NaN or +-inf (e.g. a loss reported by a diverged run)."""


class ProtocolError(ValueError):
    """Base of every error raised for bad input from the network or a user."""


class SchemaError(ProtocolError):
    """A message does not match its schema; the message names the field."""


class VersionError(ProtocolError):
    """The sender speaks a protocol version this build does not."""


class UntrustedSigner(ProtocolError):
    """The message is validly signed, but by a key the receiver does not trust for this kind."""


def describe(value: object, limit: int = 40) -> str:
    """A short rendering of an untrusted value for an error message: never calls repr() on a container
    or an object, never longer than about `limit` + 30 characters, and escapes control characters (so a
    trailing newline shows as \\n)."""
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return float.__repr__(value)  # at most 24 characters: nan, inf, 1e+308, 1712345678.25
    if isinstance(value, str):
        shown = value[:limit].encode("unicode_escape").decode("ascii").replace("'", "\\'")
        return f"'{shown}'" if len(value) <= limit else f"'{shown}...' ({len(value)} chars)"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{len(value)} bytes"
    if isinstance(value, (list, tuple)):
        if len(value) <= 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return "[" + ", ".join(describe(v) for v in value) + "]"
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"a map of {len(value)} entries"
    return f"a {type(value).__name__}"


def check_range(where: str, value: float, lo: float | None = None, hi: float | None = None) -> None:
    """Raise ValueError naming `where`, the value and the rule unless lo <= value <= hi (and finite)."""
    finite = isinstance(value, int) or math.isfinite(value)  # a huge int does not convert to a float
    if not finite or (lo is not None and value < lo) or (hi is not None and value > hi):
        lo_s = "-inf" if lo is None else f"{lo:g}"
        hi_s = "inf" if hi is None else f"{hi:g}"
        raise ValueError(f"{where}={describe(value)} must be a finite number in [{lo_s}, {hi_s}]")


def check_finite(obj: Any) -> None:
    """Raise ValueError naming the field if a float of dataclass `obj` (directly, or inside one of its
    lists or maps) is NaN or infinite, unless the field is marked NONFINITE_OK. Nested dataclasses
    check themselves."""
    for f in dataclasses.fields(obj):
        if f.metadata.get("nonfinite"):
            continue
        value = getattr(obj, f.name)
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else (value,)
        for v in items:
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{type(obj).__name__}.{f.name}={describe(v)} must be a finite number")


def to_dict(obj: Any) -> Any:
    """A dataclass (recursively) as plain dicts/lists/scalars."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type[T], data: Any, path: str = "", _depth: int = 0) -> T:
    """Build `cls` from `data`, checking types; unknown fields are rejected, missing ones use defaults."""
    where = path or cls.__name__
    if _depth > MAX_DEPTH:
        raise SchemaError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if not isinstance(data, dict):
        raise SchemaError(f"{where}: expected a map, got {describe(data)}")
    hints = get_type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = {f.name for f in fields}
    unknown = [k for k in data if k not in names]
    if unknown:
        shown = ", ".join(describe(k) for k in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise SchemaError(f"{where}: unknown field(s) {shown}{more}")
    kwargs = {}
    for f in fields:
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(f"{where}.{f.name}: required field is missing")
            continue
        finite = not f.metadata.get("nonfinite", False)
        kwargs[f.name] = _check(hints[f.name], data[f.name], f"{where}.{f.name}", finite, _depth + 1)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"{where}: {e}") from e


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _check(tp: Any, value: Any, where: str, finite: bool, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise SchemaError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    origin = get_origin(tp)
    if tp is Any:
        _check_depth(value, where, depth)
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for arm in get_args(tp):
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check(arm, value, where, finite, depth)
            except SchemaError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise SchemaError(errors[0])
        allowed = ", ".join(_type_name(a) for a in get_args(tp))
        raise SchemaError(f"{where}: {describe(value)} matches no allowed type ({allowed})")
    if origin is typing.Literal:
        allowed_values = get_args(tp)
        if not any(type(value) is type(a) and value == a for a in allowed_values):
            raise SchemaError(f"{where}: {describe(value)} is not one of {list(allowed_values)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise SchemaError(f"{where}: expected a list, got {describe(value)}")
        (arm, *_rest) = get_args(tp) or (Any,)
        items = [_check(arm, v, f"{where}[{i}]", finite, depth + 1) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected a map, got {describe(value)}")
        kt, vt = get_args(tp) or (Any, Any)
        return {
            _check(kt, k, f"{where} key", finite, depth + 1): _check(
                vt, v, f"{where}[{describe(k)}]", finite, depth + 1
            )
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where, depth)  # type: ignore[arg-type]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(f"{where}: expected a number, got {describe(value)}")
        try:
            number = float(value)
        except OverflowError:
            raise SchemaError(f"{where}: {describe(value)} is too large for a float") from None
        if finite and not math.isfinite(number):
            raise SchemaError(f"{where}: {describe(number)} is not a finite number")
        return number
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{where}: expected an integer, got {describe(value)}")
        if not -(2**63) <= value < 2**64:  # what msgpack carries; TOML's integers are 64-bit too
            raise SchemaError(f"{where}: {describe(value)} does not fit in 64 bits")
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise SchemaError(f"{where}: expected {tp.__name__}, got {describe(value)}")
        return value
    raise SchemaError(f"{where}: unsupported schema type {_type_name(tp)}")


def _check_depth(value: Any, where: str, depth: int) -> None:
    """Reject an untyped (`Any`) value nested deeper than MAX_DEPTH in all (iteratively: no recursion)."""
    stack = [(value, depth)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, tuple, dict)):
            if d >= MAX_DEPTH:
                raise SchemaError(f"{where}: nested deeper than {MAX_DEPTH} levels")
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
