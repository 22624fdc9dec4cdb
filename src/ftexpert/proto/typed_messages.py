"""A typed msgpack codec: frozen dataclasses on the wire as ``[type byte, msgpack map]``, no pickle.

    codec = MessageCodec("engine link", {1: Hello, 2: Welcome, ...})
    frames = codec.encode(Hello(...))          # [b"\\x01", msgpack map of exactly Hello's fields]
    msg = codec.decode(frames)                  # raises MessageError naming what is wrong

Field types allowed in a message dataclass: bool, int, float, str, bytes, list[<one of those>] and
tuple[<one of those>, ...], `<scalar> | None`, and a nested dataclass of such fields, or `<dataclass> | None` (sent
as a map or nil; e.g. ADD_REQUEST's SamplingParams and its GrammarSpec). Decoding checks the declared types, refuses unknown fields and reports
missing ones; numbers declared float arrive as float; a nested dataclass that refuses its values (its
__post_init__ raises ValueError) is a MessageError.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping

import msgpack


SCALARS = (bool, int, float, str, bytes)


class MessageError(ValueError):
    """A message does not match its declared schema (or is not msgpack at all)."""


def _optional_of(annotation: Any) -> Any:
    """X for `X | None` (or Optional[X]), else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0]
    return None


def _sequence_item(annotation: Any) -> Any:
    """X for list[X] and tuple[X, ...], else None."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and len(args) == 1:
        return args[0]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def _check_value(value: Any, annotation: Any) -> bool:
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation in (str, bytes):
        return isinstance(value, annotation)
    inner = _optional_of(annotation)
    if inner is not None:
        return value is None or _check_value(value, inner)
    item = _sequence_item(annotation)
    if item is not None:
        return isinstance(value, list) and all(_check_value(v, item) for v in value)
    raise TypeError(f"unsupported schema type {annotation!r}")   # a bug in the schema module


def _supported(annotation: Any) -> bool:
    if annotation in SCALARS or _is_nested(annotation):
        return True
    inner = _optional_of(annotation)
    item = _sequence_item(annotation)
    return (inner in SCALARS) or _is_nested(inner) or (item in SCALARS)


def _is_nested(annotation: Any) -> bool:
    return dataclasses.is_dataclass(annotation) and isinstance(annotation, type)


def _nested_of(annotation: Any) -> Any:
    """The dataclass of a `D` or `D | None` field, else None."""
    if _is_nested(annotation):
        return annotation
    inner = _optional_of(annotation)
    return inner if _is_nested(inner) else None


class MessageCodec:
    """Encodes and decodes the message classes of one protocol (type byte -> dataclass)."""

    def __init__(self, protocol: str, types: Mapping[int, type]):
        self.protocol = protocol
        self.types = dict(types)
        self.type_of_class = {cls: t for t, cls in self.types.items()}
        self._hints: dict[type, dict[str, Any]] = {}
        for cls in self.types.values():
            self._learn(cls)

    def _learn(self, cls: type) -> None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass")
        hints = self._hints[cls] = typing.get_type_hints(cls)
        for name, annotation in hints.items():
            if not _supported(annotation):
                raise TypeError(f"{cls.__name__}.{name}: unsupported schema type {annotation!r}")
            nested = _nested_of(annotation)
            if nested is not None and nested not in self._hints:
                self._learn(nested)

    def encode(self, msg: Any) -> list[bytes]:
        cls = type(msg)
        if cls not in self.type_of_class:
            raise MessageError(f"{cls.__name__} is not a {self.protocol} message")
        return [bytes([self.type_of_class[cls]]), msgpack.packb(self._to_map(msg), use_bin_type=True)]

    def _to_map(self, msg: Any) -> dict[str, Any]:
        cls = type(msg)
        payload = {}
        for name, annotation in self._hints[cls].items():
            value = getattr(msg, name)
            nested = _nested_of(annotation)
            if nested is not None and not (value is None and nested is not annotation):
                if not isinstance(value, nested):
                    raise MessageError(f"{cls.__name__}.{name}={value!r:.200} is not {nested.__name__}")
                payload[name] = self._to_map(value)
                continue
            if nested is not None:            # None for a `D | None` field
                payload[name] = None
                continue
            if isinstance(value, tuple):
                value = list(value)
            if not _check_value(value, annotation):
                raise MessageError(f"{cls.__name__}.{name}={value!r:.200} is not {annotation}")
            payload[name] = value
        return payload

    def decode(self, frames: list[bytes]) -> Any:
        if len(frames) != 2 or len(frames[0]) != 1:
            raise MessageError(f"a {self.protocol} message is [type byte, msgpack map]; got {len(frames)} "
                               f"frame(s)")
        cls = self.types.get(frames[0][0])
        if cls is None:
            raise MessageError(f"unknown {self.protocol} message type {frames[0][0]}")
        try:
            payload = msgpack.unpackb(frames[1], raw=False, strict_map_key=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise MessageError(f"{cls.__name__}: payload is not msgpack ({exc})") from None
        return self._from_map(cls, payload)

    def _from_map(self, cls: type, payload: Any) -> Any:
        if not isinstance(payload, dict):
            raise MessageError(f"{cls.__name__}: payload must be a map, got {type(payload).__name__}")
        hints = self._hints[cls]
        unknown = sorted(map(str, set(payload) - set(hints)))
        if unknown:
            raise MessageError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = [n for n, f in fields.items() if n not in payload
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise MessageError(f"{cls.__name__}: missing field(s) {', '.join(missing)}")
        for name, value in payload.items():
            annotation = hints[name]
            nested = _nested_of(annotation)
            if nested is not None:
                if not (value is None and nested is not annotation):
                    payload[name] = self._from_map(nested, value)
                continue
            if not _check_value(value, annotation):
                raise MessageError(f"{cls.__name__}.{name}={value!r:.200} is not {annotation}")
            if annotation is float or (value is not None and _optional_of(annotation) is float):
                payload[name] = float(value)
            elif typing.get_origin(annotation) is tuple:
                payload[name] = tuple(value)
        try:
            return cls(**payload)
        except ValueError as exc:
            raise MessageError(f"{cls.__name__}: {exc}") from None
