"""The gRPC control plane of a server started without an API key: it requires the control key that it writes,
mode 0600, for its own user; `ft ctl` of that user finds it with default settings; a client without it, and
another local user, are refused and told what to do."""
from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import textwrap
from unittest import mock

import grpc
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import live_server  # noqa: E402
from serve_support import ENV  # noqa: E402

from ftexpert.coordinator import control_key  # noqa: E402
from ftexpert.coordinator.cli import build_parser  # noqa: E402
from ftexpert.proto import control_rpc as rpc  # noqa: E402

OTHER_UID = 65534                     # nobody


def ctl_default(address: str, *argv: str) -> tuple[int, str]:
    """`ft ctl` as an operator types it: no FT_API_KEY, no --api-key-file."""
    from ftexpert.coordinator import ctl_cli

    args = build_parser().parse_args(["ctl", "--address", address, "--timeout-s", "20", *argv])
    out = io.StringIO()
    with mock.patch.dict(os.environ, {"FT_API_KEY": ""}):
        rc = ctl_cli.run(args, out=out)
    return rc, out.getvalue()


def test_a_server_without_an_api_key_requires_its_private_control_key(tmp_path, capsys):
    with live_server(tmp_path) as ls:
        path = ls.server.control_key.path
        port = ls.grpc_address.rsplit(":", 1)[1]
        assert path == os.path.join(control_key.search_dirs()[0], f"ft-control-{port}.key")
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        with grpc.insecure_channel(ls.grpc_address) as channel:
            control, health = rpc.ControlStub(channel), rpc.HealthStub(channel)
            for metadata in ((), (("authorization", "Bearer not-the-key"),)):
                with pytest.raises(grpc.RpcError) as info:
                    control.RestartWorker(rpc.msg.RestartWorkerRequest(name="engine"), timeout=10, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "run `ft ctl` as" in info.value.details() and path in info.value.details()
            assert ls.engine_box and len(ls.engine_box) == 1                  # nothing was restarted
            assert health.Check(rpc.health.HealthCheckRequest(service=""), timeout=10).status == \
                rpc.SERVING_STATUS.Value("SERVING")                         # probes stay open
        rc, out = ctl_default(ls.grpc_address, "workers")
        assert rc == 0 and "name: engine" in out, capsys.readouterr().err
        rc, out = ctl_default(ls.grpc_address, "restart", "engine")
        assert rc == 0 and "restarts: 1" in out and len(ls.engine_box) == 2
    assert not os.path.exists(path)                                          # removed at stop


def test_an_api_key_replaces_the_control_key(tmp_path, capsys):
    with live_server(tmp_path, api_key="k") as ls:
        assert ls.server.control_key is None
        rc, _ = ctl_default(ls.grpc_address, "stats")
        assert rc == 1
        err = capsys.readouterr().err
        assert "UNAUTHENTICATED" in err and "no key to send" in err and "FT_API_KEY" in err


def test_ft_ctl_sends_the_control_key_only_to_a_loopback_server_and_only_from_a_private_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = {"RUNTIME_DIRECTORY": str(run)}
    key = control_key.ControlKey(str(run))
    path = key.write(4242)
    assert control_key.find("127.0.0.1:4242", env)[:2] == (key.key, path)
    assert control_key.find("localhost:4242", env)[0] == key.key
    assert control_key.find("[::1]:4242", env)[0] == key.key
    assert control_key.find("10.1.2.3:4242", env) == (None, None, [])      # a server elsewhere never gets it
    assert control_key.find("127.0.0.1:4243", env)[0] is None
    os.chmod(path, 0o644)
    found, _, notes = control_key.find("127.0.0.1:4242", env)
    assert found is None and any("mode 0644" in n for n in notes)
    key.remove()
    assert not os.path.exists(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run ft ctl as another user")
def test_another_local_user_is_refused_and_told_what_to_do(tmp_path):
    """ft ctl with default settings, as uid 65534 (nobody): the interpreter starts as root (it lives where nobody
    may not read), imports what ft ctl needs, then drops to nobody before it looks for a key or connects."""
    script = textwrap.dedent(f"""
        import io, os, sys
        from ftexpert.coordinator import control_key, ctl_cli
        from ftexpert.coordinator.cli import build_parser
        import contextlib
        args = build_parser().parse_args(["ctl", "--address", sys.argv[1], "--timeout-s", "20", "restart", "engine"])
        # a refused call as root with a wrong key first: it imports every module the refused path needs (the
        # interpreter's own folder may be closed to nobody, as CI's mktemp'd venv is); it restarts nothing
        os.environ["FT_API_KEY"] = "not-the-key"
        with contextlib.redirect_stderr(io.StringIO()):
            assert ctl_cli.run(args, out=io.StringIO()) == 1
        del os.environ["FT_API_KEY"]
        os.setgroups([]); os.setgid({OTHER_UID}); os.setuid({OTHER_UID})
        try:
            open(sys.argv[2]).read()
            print("READ THE KEY")
        except PermissionError:
            print("key file closed")
        sys.exit(ctl_cli.run(args, out=io.StringIO()))
    """)
    with live_server(tmp_path) as ls:
        env = {k: v for k, v in ENV.items() if k not in ("FT_API_KEY", "XDG_RUNTIME_DIR", "RUNTIME_DIRECTORY")}
        done = subprocess.run([sys.executable, "-c", script, ls.grpc_address, ls.server.control_key.path], env=env,
                              cwd="/", capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == "key file closed", done.stdout + done.stderr
        assert done.returncode == 1, done.stderr
        assert "UNAUTHENTICATED" in done.stderr and "run `ft ctl` as root" in done.stderr, done.stderr
        assert len(ls.engine_box) == 1                                        # the restart did not happen
