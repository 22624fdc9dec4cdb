"""A gRPC channel for the tests that sends the key `ft ctl` would send with its default settings."""
from __future__ import annotations

import os

import grpc

from ftexpert.coordinator import control_key


class _Details(grpc.ClientCallDetails):
    def __init__(self, details, key: str):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)
        self.metadata = [*(details.metadata or ()), ("authorization", f"Bearer {key}")]


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, key: str):
        self.key = key

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_Details(details, self.key), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_Details(details, self.key), request)


def control_channel(address: str) -> grpc.Channel:
    """A channel to `address` whose calls carry $FT_API_KEY, else the control key the server there wrote for this
    user (coordinator/control_key.py); none when neither is found."""
    key = os.environ.get("FT_API_KEY") or control_key.find(address)[0]
    channel = grpc.insecure_channel(address)
    return grpc.intercept_channel(channel, _Bearer(key)) if key else channel
