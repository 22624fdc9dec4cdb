"""The optional bearer token that guards the HTTP API and the gRPC control plane.

HTTP: `Authorization: Bearer TOKEN`; gRPC: metadata `authorization: Bearer TOKEN`. Liveness probes
(HTTP GET /health, grpc.health.v1) stay open, since they reveal nothing but up or down, and
orchestrators call them without credentials.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket

log = logging.getLogger("ft.coordinator.auth")

API_KEY_ENV = "FT_API_KEY"


def resolve_api_key(flag_value: str | None) -> str | None:
    """--api-key wins over FT_API_KEY; an empty value means no token."""
    key = flag_value if flag_value is not None else os.environ.get(API_KEY_ENV)
    return key or None


def bearer_ok(header_value: str | None, api_key: str | None) -> bool:
    """True when no token is configured or the header carries exactly `Bearer <api_key>`."""
    if api_key is None:
        return True
    if not header_value:
        return False
    scheme, _, token = header_value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode("utf-8"), api_key.encode("utf-8"))


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def warn_if_exposed(host: str, api_key: str | None, what: str) -> str | None:
    """The warning printed when a listener leaves loopback without a token (None when fine)."""
    if api_key is None and not is_loopback(host):
        message = (f"WARNING: the {what} listens on {host}, which is not loopback, and no API token is set: "
                   f"anyone who can reach it can generate and control the service. Set --api-key or "
                   f"{API_KEY_ENV}, or bind to 127.0.0.1.")
        log.warning(message)
        return message
    return None
