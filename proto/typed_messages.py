"""A typed msgpack codec: frozen dataclasses on the wire as ``[type byte, msgpack map]``, no pickle.

    codec = MessageCodec("engine link", {1: Hello, 2: Welcome, ...})
    frames = codec.encode(Hello(...))          # [b"\\x01", msgpack map of exactly Hello's fields]
    msg = codec.decode(frames)                  # raises MessageError naming what is wrong

Field types allowed in a message dataclass: bool, int, float, str, bytes and list[<one of those>].
Decoding checks the declared types, refuses unknown fields and reports missing ones; numbers declared
float arrive as float.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

import msgpack


SCALARS = (bool, int, float, str, bytes)


class MessageError(ValueError):
    """A message does not match its declared schema (or is not msgpack at all)."""


def _check_value(value: Any, annotation: Any) -> bool:
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation in (str, bytes):
        return isinstance(value, annotation)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_check_value(v, item) for v in value)
    raise TypeError(f"unsupported schema type {annotation!r}")   # a bug in the schema module


def _supported(annotation: Any) -> bool:
    if annotation in SCALARS:
        return True
    return typing.get_origin(annotation) is list and typing.get_args(annotation)[0] in SCALARS


class MessageCodec:
    """Encodes and decodes the message classes of one protocol (type byte -> dataclass)."""

    def __init__(self, protocol: str, types: Mapping[int, type]):
        self.protocol = protocol
        self.types = dict(types)
        self.type_of_class = {cls: t for t, cls in self.types.items()}
        self._hints = {cls: typing.get_type_hints(cls) for cls in self.types.values()}
        for cls, hints in self._hints.items():
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} must be a dataclass")
            for name, annotation in hints.items():
                if not _supported(annotation):
                    raise TypeError(f"{cls.__name__}.{name}: unsupported schema type {annotation!r}")

    def encode(self, msg: Any) -> list[bytes]:
        cls = type(msg)
        if cls not in self.type_of_class:
            raise MessageError(f"{cls.__name__} is not a {self.protocol} message")
        payload = {}
        for name, annotation in self._hints[cls].items():
            value = getattr(msg, name)
            if isinstance(value, tuple):
                value = list(value)
            if not _check_value(value, annotation):
                raise MessageError(f"{cls.__name__}.{name}={value!r:.200} is not {annotation}")
            payload[name] = value
        return [bytes([self.type_of_class[cls]]), msgpack.packb(payload, use_bin_type=True)]

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
            if not _check_value(value, hints[name]):
                raise MessageError(f"{cls.__name__}.{name}={value!r:.200} is not {hints[name]}")
            if hints[name] is float:
                payload[name] = float(value)
        return cls(**payload)
