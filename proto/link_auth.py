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
import stat
import tempfile

SECRET_BYTES = 32
NONCE_BYTES = 32
KEY_FILE_NAME = "engine.key"
SOCKET_NAME = "engine.sock"
KEY_FILE_ENV = "FT_ENGINE_KEY_FILE"
COORDINATOR, WORKER = b"ft-engine-link coordinator", b"ft-engine-link worker"


class LinkAuthError(RuntimeError):
    """A runtime directory or key file that must not be trusted, or a missing key."""


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

def check_private(path: str, what: str = "runtime directory") -> None:
    """Refuse a path that is a symlink, not owned by this user, or open to the group or others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise LinkAuthError(f"the {what} {path} does not exist") from None
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise LinkAuthError(f"the {what} {path} is a symbolic link; refusing it (remove it, or point "
                            f"--engine-addr elsewhere)")
    if st.st_uid != uid:
        raise LinkAuthError(f"the {what} {path} is owned by uid {st.st_uid}, not by this user ({uid}): another user "
                            f"could read the engine link's key or take its socket; remove it or pick another path")
    if st.st_mode & 0o077:
        raise LinkAuthError(f"the {what} {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 (0600 for "
                            f"a file), open to nobody else: chmod go= {path}")


def private_dir(path: str) -> str:
    """`path`, created mode 0700 if missing (missing parents too), checked by check_private; its parent must be
    this user's or root's, and writable by others only if sticky (/tmp): else someone else could swap it."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        private_dir(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.stat(parent)
    if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise LinkAuthError(f"the runtime directory {path} sits in {parent}, which another user can change "
                            f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): pick a directory of your "
                            f"own (--engine-addr ipc://DIR/engine.sock, or $XDG_RUNTIME_DIR)")
    check_private(path)
    return path


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
    path = os.path.join(directory, KEY_FILE_NAME)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secret.hex().encode("ascii") + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_secret(path: str) -> bytes:
    """The key in `path`; refused unless the file is this user's and mode 0600 (or stricter)."""
    check_private(path, "engine-link key file")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        text = os.read(fd, 4 * SECRET_BYTES).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
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
