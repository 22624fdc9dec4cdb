"""Paths only this user may change: the engine link's runtime directory and key, the compiled-kernel cache.

`private_dir(path)` creates (0700) or checks a directory: not a symbolic link, owned by this user, open to
nobody else, in a parent that another user cannot swap it out of (this user's or root's; writable by others
only if sticky, as /tmp). `check_private(path)` is the same test for one file (0600); `write_private(path, data)`
and `read_private(path, what, limit)` write such a file (atomically) and read one back after that test. `check_loadable(path)`
is the weaker test for code this process is about to load (a shared library): a regular file of this user
that nobody else may write.
"""
from __future__ import annotations

import os
import stat


class UnsafePath(RuntimeError):
    """A path another user could have written (or could still write): refused."""


def _lstat(path: str, what: str) -> os.stat_result:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"the {what} {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"the {what} {path} is a symbolic link; refusing it (remove it, or pick another path)")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"the {what} {path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}): "
                         f"another user made it; remove it or pick another path")
    return st


def check_private(path: str, what: str = "directory") -> None:
    """Refuse a path that is a symlink, not owned by this user, or open to the group or others at all."""
    st = _lstat(path, what)
    if st.st_mode & 0o077:
        raise UnsafePath(f"the {what} {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 (0600 for a "
                         f"file), open to nobody else: chmod go= {path}")


def check_loadable(path: str, what: str = "shared library") -> None:
    """Refuse code to load that is a symlink, not a regular file, not this user's, or writable by others."""
    st = _lstat(path, what)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"the {what} {path} is not a regular file")
    if st.st_mode & 0o022:
        raise UnsafePath(f"the {what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: its group or others may "
                         f"change it, so it is not loaded; remove it (it is rebuilt)")


def private_dir(path: str, *, tighten: bool = False) -> str:
    """`path` as an absolute path, created mode 0700 if missing (missing parents too) and checked as above.
    tighten: an existing directory of this user that is open to others is chmod-ed to 0700 instead of refused
    (a cache that an older version made 0755)."""
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
        raise UnsafePath(f"the directory {path} sits in {parent}, which another user can change (owner uid "
                         f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): pick a directory of your own")
    if tighten:
        own = _lstat(path, "directory")
        if own.st_mode & 0o077:
            os.chmod(path, 0o700)
    check_private(path)
    return path


def write_private(path: str, data: bytes) -> str:
    """Write `data` to `path`, mode 0600, atomically (a reader sees the old file or the new one, never a part of
    it); a symbolic link planted at the temporary name is not followed. The directory is the caller's to check."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_private(path: str, what: str, limit: int) -> str:
    """Up to `limit` bytes of `path`, stripped: refused (check_private) unless it is this user's, mode 0600."""
    check_private(path, what)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return os.read(fd, limit).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
