"""The compiled-kernel cache: built in a private directory (this user's, 0700), and a library there that another
user owns, that others may write, or that is a symbolic link is refused, never loaded (a planted .so)."""
from __future__ import annotations

import os
import shutil
import stat
import tempfile

import pytest

from ftexpert.cpu_expert_pool.native.build import NativeLib, NativeUnavailable, build_library, default_cache_dir

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None and shutil.which("cc") is None,
                              reason="no C compiler")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")


@pytest.fixture
def built(tmp_path):
    cache = tmp_path / "cache"
    return cache, build_library(cache)


@needs_cc
def test_the_cache_is_private_and_a_writable_library_is_refused(built):
    cache, lib = built
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700 and os.stat(lib).st_uid == os.geteuid()
    assert build_library(cache) == lib and NativeLib(lib).best_isa >= 0        # the cached one is fine
    os.chmod(lib, 0o666)                                                       # anyone may have rewritten it
    with pytest.raises(NativeUnavailable, match="group or others may change it"):
        build_library(cache)
    with pytest.raises(NativeUnavailable, match="group or others may change it"):
        NativeLib(lib)


@needs_cc
def test_a_planted_symlink_is_refused(built, tmp_path):
    cache, lib = built
    planted = tmp_path / "evil.so"
    shutil.copy(lib, planted)
    lib.unlink()
    lib.symlink_to(planted)
    with pytest.raises(NativeUnavailable, match="symbolic link"):
        build_library(cache)


@needs_cc
@as_root
def test_a_library_of_another_user_is_refused(built):
    cache, lib = built
    os.chown(lib, 65534, 65534)
    with pytest.raises(NativeUnavailable, match="owned by uid 65534"):
        build_library(cache)


def test_the_temporary_fallback_is_private_or_refused(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked / "cache"))     # the home cache cannot be made
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp", mode=0o1777)
    os.chmod(tmp_path / "tmp", 0o1777)                               # like /tmp: world-writable, sticky
    path = default_cache_dir()
    assert str(path).startswith(str(tmp_path / "tmp" / f"ft-expert-service-{os.geteuid()}"))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    if os.geteuid() == 0:                                            # another user made the directory first
        shutil.rmtree(tmp_path / "tmp" / f"ft-expert-service-{os.geteuid()}")
        os.mkdir(tmp_path / "tmp" / f"ft-expert-service-{os.geteuid()}", 0o777)
        os.chown(tmp_path / "tmp" / f"ft-expert-service-{os.geteuid()}", 65534, 65534)
        with pytest.raises(NativeUnavailable, match="no private directory"):
            default_cache_dir()


def test_an_own_cache_left_open_by_an_older_version_is_tightened(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    old = tmp_path / "ft-expert-service" / "cpu_kernels"
    old.mkdir(parents=True)
    os.chmod(old, 0o755)
    assert default_cache_dir() == old and stat.S_IMODE(os.stat(old).st_mode) == 0o700
