"""The bearer token that guards the HTTP API and the gRPC control plane, and the listeners' exposure.

HTTP: `Authorization: Bearer TOKEN` or `x-api-key: TOKEN` (what Anthropic's clients send), on every route;
gRPC: metadata `authorization: Bearer TOKEN`. Liveness probes
(HTTP GET /health, grpc.health.v1) stay open, since they reveal nothing but up or down, and
orchestrators call them without credentials.

The token comes from $FT_API_KEY or a file (`--api-key-file`), never from the command line, which every
local user can read in `ps`. A key file that others may read is refused. An HTTP listener on a non-loopback
address without a token is refused unless `--insecure` says that is meant (then a warning); the gRPC control plane
is never without one (with no API key it takes the key of coordinator/control_key.py).
"""
from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import socket
import stat

log = logging.getLogger("ft.coordinator.auth")

API_KEY_ENV = "FT_API_KEY"


class _RefusedApiKeyFlag(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"--api-key is not accepted: a key on the command line is visible to every local user (ps); "
                     f"set {API_KEY_ENV} or pass --api-key-file PATH")


def add_api_key_flags(parser: argparse.ArgumentParser) -> None:
    """--api-key-file PATH; --api-key itself is refused with the way to go (not only unknown: argparse would
    otherwise take it as an abbreviation of --api-key-file)."""
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help=f"file whose first line is the bearer token (not readable by others) [or env {API_KEY_ENV}]")
    parser.add_argument("--api-key", nargs="?", action=_RefusedApiKeyFlag, help=argparse.SUPPRESS)


def resolve_api_key(key_file: str | None, environ=None) -> str | None:
    """The token of --api-key-file (wins) or $FT_API_KEY; an empty variable means no token."""
    if key_file:
        return read_key_file(key_file)
    env = os.environ if environ is None else environ
    return env.get(API_KEY_ENV) or None


def read_key_file(path: str) -> str:
    """The first line of `path`: refused if others may read it (or write it), or if it is empty."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"the API key file {path} does not exist") from None
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
        raise ValueError(f"the API key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: any local user could "
                         f"read or change the key; make it 0600 (or 0640 for a group): chmod o=,g-w {path}")
    with open(path, encoding="utf-8") as f:
        key = f.readline().strip()
    if not key:
        raise ValueError(f"the API key file {path} is empty")
    return key


def _key_matches(token: str, api_key: str) -> bool:
    """Constant-time comparison. aiohttp decodes header bytes that are not UTF-8 as lone surrogates
    (surrogateescape): they encode back to those bytes, and so simply do not match."""
    return hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), api_key.encode("utf-8"))


def bearer_ok(header_value: str | None, api_key: str | None) -> bool:
    """True when no token is configured or the header carries exactly `Bearer <api_key>`."""
    if api_key is None:
        return True
    if not header_value:
        return False
    scheme, _, token = header_value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return _key_matches(token, api_key)


def http_key_ok(authorization: str | None, x_api_key: str | None, api_key: str | None) -> bool:
    """True when no token is configured, or `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` carries it."""
    if api_key is None:
        return True
    if x_api_key is not None and _key_matches(x_api_key, api_key):
        return True
    return bearer_ok(authorization, api_key)


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


def check_exposure(host: str, api_key: str | None, what: str, insecure: bool = False) -> str | None:
    """A listener off loopback without a token: ValueError, or with `insecure` the warning to print (else None)."""
    if api_key is not None or is_loopback(host):
        return None
    if not insecure:
        raise ValueError(f"the {what} would listen on {host}, which is not loopback, with no API key: anyone who "
                         f"can reach it could generate text with this model. Set {API_KEY_ENV} or "
                         f"--api-key-file, bind to 127.0.0.1, or pass --insecure if that is what you want")
    message = (f"WARNING: the {what} listens on {host}, which is not loopback, and no API key is set (--insecure): "
               f"anyone who can reach it can generate text with this model.")
    return message
