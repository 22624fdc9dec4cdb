"""Who may speak on the engine link: a private runtime directory and a per-run secret proven by HMAC.

The coordinator makes a fresh 32-byte secret at every start and writes it, hex, to ``engine.key``
(mode 0600) in its runtime directory; the engine link's ipc socket sits beside it. That directory is
mode 0700 and owned by the service user (`private_dir` refuses any other), so by default no other user
can even connect. On top of that every peer proves the secret, both ways, before it learns anything:

    worker                                               coordinator
    KNOCK (worker nonce, protocol)                 ->
                                                   <-    CHALLENGE (worker nonce, its nonce,
                                                                    HMAC(secret, "coordinator" | nw | nc))
    (checks the coordinator's proof: a process that bound the address without the key is refused here)
    HELLO (..., HMAC(secret, "worker" | nc | nw | ZMQ identity))  ->
                                                   <-    WELCOME, or REJECT "not authorized" (nothing else)

HMAC-SHA256 and not ZMQ CURVE: CURVE needs a libzmq built with libsodium (distribution builds vary;
`zmq.has("curve")`), a ZAP handler thread and a key pair per side to distribute; the link's traffic
never leaves the host (ipc in a private directory, or loopback TCP), so what it needs is proof of
who is at the other end, which one file readable only by the service user and the standard library give.

A worker reads the key again at every KNOCK, so a coordinator restarted with a new key is found without
restarting the worker.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile

from ftexpert.proto.private_paths import UnsafePath, private_dir, read_private, write_private

__all__ = ["UnsafePath", "private_dir", "new_secret", "new_nonce", "prove", "verify", "default_engine_addr",
           "key_file_for", "write_secret", "read_secret"]

SECRET_BYTES = 32
NONCE_BYTES = 32
KEY_FILE_NAME = "engine.key"
SOCKET_NAME = "engine.sock"
KEY_FILE_ENV = "FT_ENGINE_KEY_FILE"
COORDINATOR, WORKER = b"ft-engine-link coordinator", b"ft-engine-link worker"


class LinkAuthError(RuntimeError):
    """A key file that does not hold a key, or a TCP link without a key file named."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def prove(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over the role and the parts (each length-prefixed: no two splits give one input)."""
    mac = hmac.new(secret, role, hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def verify(secret: bytes, role: bytes, proof: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(prove(secret, role, *parts), proof)


# ---------------------------------------------------------------- the runtime directory

def base_runtime_dir(environ=None) -> str:
    """$RUNTIME_DIRECTORY (systemd's RuntimeDirectory=), else $XDG_RUNTIME_DIR, else <tmp>/ft-<uid>."""
    env = os.environ if environ is None else environ
    if env.get("RUNTIME_DIRECTORY"):
        return env["RUNTIME_DIRECTORY"].split(":")[0]
    if env.get("XDG_RUNTIME_DIR"):
        return env["XDG_RUNTIME_DIR"]
    return os.path.join(tempfile.gettempdir(), f"ft-{os.geteuid()}")


def default_runtime_dir(port: int, environ=None) -> str:
    """Where the coordinator on HTTP port `port` keeps its engine socket and key (not created here)."""
    env = os.environ if environ is None else environ
    if env.get("RUNTIME_DIRECTORY"):
        return base_runtime_dir(env)
    return os.path.join(base_runtime_dir(env), f"ft-{port}")


def default_engine_addr(port: int, environ=None) -> str:
    return f"ipc://{os.path.join(default_runtime_dir(port, environ), SOCKET_NAME)}"


def ipc_path(addr: str) -> str | None:
    return addr[len("ipc://"):] if addr.startswith("ipc://") else None


def key_file_for(addr: str, key_file: str | None = None, environ=None) -> str:
    """The worker's key file: given, $FT_ENGINE_KEY_FILE, or beside an ipc socket; a TCP link needs one named."""
    env = os.environ if environ is None else environ
    key_file = key_file or env.get(KEY_FILE_ENV)
    if key_file:
        return key_file
    path = ipc_path(addr)
    if path is None:
        raise LinkAuthError(f"the engine link {addr} is TCP: name the coordinator's key file with --engine-key-file "
                            f"(or ${KEY_FILE_ENV}); the coordinator logs where it wrote it")
    return os.path.join(os.path.dirname(path), KEY_FILE_NAME)


# ---------------------------------------------------------------- the key file

def write_secret(directory: str, secret: bytes) -> str:
    """Write the key, hex, to <directory>/engine.key mode 0600 (atomically: a reader sees the old or the new)."""
    return write_private(os.path.join(directory, KEY_FILE_NAME), secret.hex().encode("ascii") + b"\n")


def read_secret(path: str) -> bytes:
    """The key in `path`; refused unless the file is this user's and mode 0600 (or stricter)."""
    text = read_private(path, "engine-link key file", 4 * SECRET_BYTES)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise LinkAuthError(f"the engine-link key file {path} does not hold a {SECRET_BYTES}-byte key")
    return secret


def remove_quietly(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
