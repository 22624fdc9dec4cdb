"""The gRPC control plane's own key, for a server started without an API key.

Without $FT_API_KEY / --api-key-file the control plane still never runs open: at every start `ft serve` makes a
fresh random key, requires it on every control call (grpc.health.v1 stays open, as with an API key), and writes it
to `ft-control-<gRPC port>.key`, mode 0600, in its private runtime directory (0700, this user's:
proto/private_paths.py). `ft ctl` run by the same user on the same host finds that file by the port of its
--address and sends the key; any other local user can neither read the file nor guess the key, so the server
refuses them (UNAUTHENTICATED, saying what to do). The file is removed when the server stops.

Where: the first of $RUNTIME_DIRECTORY (systemd's RuntimeDirectory=), $XDG_RUNTIME_DIR, <tmp>/ft-<uid>
(proto/link_auth.py's base_runtime_dir, as the engine link's key). `ft ctl` looks in each of those, then in
/run/ft (deploy/ft-coordinator.service's RuntimeDirectory=ft), so that `sudo -u ft ft ctl ...` finds it.
"""
from __future__ import annotations

import os
import pwd
import secrets
import tempfile

from ftexpert.coordinator.auth import is_loopback
from ftexpert.proto.link_auth import base_runtime_dir, remove_quietly
from ftexpert.proto.private_paths import UnsafePath, private_dir, read_private, write_private

FILE_NAME = "ft-control-{port}.key"
SYSTEMD_RUNTIME_DIR = "/run/ft"            # deploy/ft-coordinator.service: RuntimeDirectory=ft
KEY_BYTES = 32


def search_dirs(environ=None) -> list[str]:
    """Where `ft ctl` looks for a control key, in order; the first is where `ft serve` writes it."""
    env = os.environ if environ is None else environ
    dirs = [base_runtime_dir(env), env.get("XDG_RUNTIME_DIR") or "",
            os.path.join(tempfile.gettempdir(), f"ft-{os.geteuid()}"), SYSTEMD_RUNTIME_DIR]
    return [d for i, d in enumerate(dirs) if d and d not in dirs[:i]]


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _owner(path: str) -> str:
    try:
        return _user(os.stat(path).st_uid)
    except OSError:
        return "another user"


class ControlKey:
    """The key of one server's control plane: made here, written once its gRPC port is known, removed at stop."""

    def __init__(self, directory: str | None = None):
        self.key = secrets.token_urlsafe(KEY_BYTES)
        self.directory = directory
        self.path: str | None = None

    def write(self, port: int) -> str:
        directory = private_dir(self.directory or search_dirs()[0])
        self.path = write_private(os.path.join(directory, FILE_NAME.format(port=port)),
                                  self.key.encode("ascii") + b"\n")
        return self.path

    def refusal(self) -> str:
        """What a caller without the key is told (the gRPC UNAUTHENTICATED details)."""
        user = _user(os.geteuid())
        return (f"this control plane has no API key, so it answers only its own user ({user}): run `ft ctl` as "
                f"{user} on this host (e.g. sudo -u {user} ft ctl ...), which reads the key from {self.path} "
                f"by itself; or start the server with FT_API_KEY or --api-key-file and give ft ctl the same key")

    def remove(self) -> None:
        remove_quietly(self.path)
        self.path = None


def loopback_port(address: str) -> int | None:
    """The port of a loopback `host:port` gRPC address ([::1]:port too); None for anything else."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or "/" in host or not is_loopback(host):
        return None
    return int(port)


def find(address: str, environ=None) -> tuple[str | None, str | None, list[str]]:
    """(key, its file, notes) for `ft ctl` with no API key: the control key of the server on a loopback
    `address`, if this user can read one. A server elsewhere never gets it. `notes` say why none was read where a
    file or directory is in the way (another user's, or open to others), for the error message."""
    port = loopback_port(address)
    if port is None:
        return None, None, []
    notes = []
    for directory in search_dirs(environ):
        path = os.path.join(directory, FILE_NAME.format(port=port))
        try:
            os.lstat(path)
        except FileNotFoundError:
            continue
        except PermissionError:
            notes.append(f"{directory} belongs to {_owner(directory)} and is closed to you: run ft ctl as that user")
            continue
        try:
            return read_private(path, "control key file", 4 * KEY_BYTES), path, notes
        except (UnsafePath, PermissionError) as exc:
            notes.append(str(exc))
    return None, None, notes
