"""Type-checked conversion between message dataclasses and plain msgpack-able dicts.

Messages arrive from the network as dicts; `from_dict` checks every field against the dataclass's type
hints and raises `SchemaError` naming the bad field, so a malformed message never reaches the runtime.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ProtocolError(ValueError):
    """Base of every error raised for bad input from the network or a user."""


class SchemaError(ProtocolError):
    """A message does not match its schema; the message names the field."""


class VersionError(ProtocolError):
    """The sender speaks a protocol version this build does not."""


class UntrustedSigner(ProtocolError):
    """The message is validly signed, but by a key the receiver does not trust for this kind."""


def to_dict(obj: Any) -> Any:
    """A dataclass (recursively) as plain dicts/lists/scalars."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build `cls` from `data`, checking types; unknown fields are rejected, missing ones use defaults."""
    where = path or cls.__name__
    if not isinstance(data, dict):
        raise SchemaError(f"{where}: expected a map, got {type(data).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - names
    if unknown:
        raise SchemaError(f"{where}: unknown field(s) {sorted(map(str, unknown))}")
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(f"{where}.{f.name}: required field is missing")
            continue
        kwargs[f.name] = _check(hints[f.name], data[f.name], f"{where}.{f.name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"{where}: {e}") from e


def _check(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for arm in get_args(tp):
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check(arm, value, where)
            except SchemaError as e:
                errors.append(str(e))
        raise SchemaError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches no allowed type")
    if origin is typing.Literal:
        if value not in get_args(tp):
            raise SchemaError(f"{where}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise SchemaError(f"{where}: expected a list, got {type(value).__name__}")
        (arm, *_rest) = get_args(tp) or (Any,)
        items = [_check(arm, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected a map, got {type(value).__name__}")
        kt, vt = get_args(tp) or (Any, Any)
        return {_check(kt, k, f"{where} key"): _check(vt, v, f"{where}[{k!r}]") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)  # type: ignore[arg-type]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise SchemaError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise SchemaError(f"{where}: unsupported schema type {tp!r}")
