"""The listeners' exposure: no API key on the command line (`ps` shows it), a key file others can read is
refused, a non-loopback HTTP listener without a key is refused unless --insecure, and TLS serves HTTPS and gRPC
(a self-signed certificate made here)."""
from __future__ import annotations

import datetime
import io
import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.request
from unittest import mock

import grpc
import pytest

from ftexpert.coordinator.auth import check_exposure, resolve_api_key
from ftexpert.coordinator.cli import build_parser
from ftexpert.coordinator.server import ListenConfig
from ftexpert.coordinator.tls import TlsFiles
from ftexpert.proto import control_rpc as rpc

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import MODEL_NAME, live_server  # noqa: E402


def self_signed(tmp_path) -> tuple[str, str]:
    """(cert.pem, key.pem) for 127.0.0.1 and localhost: with the cryptography package, else the openssl CLI."""
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is installed")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                        "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    else:
        import ipaddress
        private = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
        now = datetime.datetime.now(datetime.timezone.utc)
        certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                       .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                       .not_valid_after(now + datetime.timedelta(days=1))
                       .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                                   x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                      critical=False)
                       .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                       .sign(private, hashes.SHA256()))
        with open(cert, "wb") as f:
            f.write(certificate.public_bytes(serialization.Encoding.PEM))
        with open(key, "wb") as f:
            f.write(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    os.chmod(key, 0o600)
    return cert, key


@pytest.mark.parametrize("command", [["serve"], ["ctl", "stats"]], ids=["serve", "ctl"])
def test_the_api_key_is_not_a_command_line_flag(command, capsys):
    argv = [command[0], "--api-key", "s3cret", *command[1:]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "--api-key is not accepted" in capsys.readouterr().err


def test_the_key_comes_from_the_environment_or_a_private_file(tmp_path):
    assert resolve_api_key(None, environ={"FT_API_KEY": "from-env"}) == "from-env"
    assert resolve_api_key(None, environ={"FT_API_KEY": ""}) is None
    path = tmp_path / "api.key"
    path.write_text("from-file\n")
    os.chmod(path, 0o600)
    assert resolve_api_key(str(path), environ={"FT_API_KEY": "from-env"}) == "from-file"
    os.chmod(path, 0o640)                                  # a group (root:ft, as ft.env) may read it
    assert resolve_api_key(str(path), environ={}) == "from-file"
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="mode 0644: any local user could read"):
        resolve_api_key(str(path), environ={})
    path.write_text("")
    os.chmod(path, 0o600)
    with pytest.raises(ValueError, match="is empty"):
        resolve_api_key(str(path), environ={})


def test_a_non_loopback_http_listener_needs_a_key_or_insecure():
    with pytest.raises(ValueError, match="HTTP API would listen on 0.0.0.0, which is not loopback, with no API "
                                         "key.*--insecure"):
        ListenConfig(host="0.0.0.0").check()
    assert ListenConfig(host="0.0.0.0", api_key="k").check() == []
    warnings = ListenConfig(host="0.0.0.0", insecure=True).check()
    assert len(warnings) == 1 and "HTTP API" in warnings[0] and "--insecure" in warnings[0]
    assert check_exposure("::1", None, "HTTP API") is None
    # the gRPC listener is never open: without an API key it requires the control key (test_control_key.py)
    assert ListenConfig(host="127.0.0.1", grpc_host="0.0.0.0").check() == []


def test_ft_serve_refuses_an_open_listener_before_loading_anything():
    from ftexpert.coordinator import serve_cli

    for workers in ("process", "inline"):
        args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--workers", workers,
                                          "--model", "/nonexistent/model"])
        with mock.patch.dict(os.environ, {"FT_API_KEY": ""}):
            with pytest.raises(ValueError, match="not loopback, with no API key"):   # not: the model is missing
                serve_cli.run(args)


def test_tls_files_are_checked(tmp_path):
    cert, key = self_signed(tmp_path)
    assert TlsFiles.from_flags(None, None) is None
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        TlsFiles.from_flags(cert, None)
    os.chmod(key, 0o604)
    with pytest.raises(ValueError, match="any local user could read it"):
        TlsFiles.from_flags(cert, key)
    os.chmod(key, 0o600)
    with pytest.raises(ValueError, match="cannot use the TLS certificate"):
        TlsFiles.from_flags(key, key).http_context()


def test_tls_serves_https_and_grpc(tmp_path):
    from ftexpert.coordinator import ctl_cli

    cert, key = self_signed(tmp_path)
    with live_server(tmp_path, api_key="k", tls=TlsFiles.from_flags(cert, key)) as server:
        assert server.base_url.startswith("https://")
        trusted = ssl.create_default_context(cafile=cert)
        request = urllib.request.Request(server.base_url + "/v1/models", headers={"Authorization": "Bearer k"})
        with urllib.request.urlopen(request, context=trusted, timeout=10) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == MODEL_NAME
        with pytest.raises(OSError):                       # the plain-text protocol is not spoken there
            urllib.request.urlopen(server.base_url.replace("https://", "http://") + "/health", timeout=10).read()
        with open(cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(f"localhost:{server.grpc_address.rsplit(':', 1)[1]}", creds) as channel:
            stats = rpc.ControlStub(channel).GetStats(rpc.msg.GetStatsRequest(), timeout=10,
                                                      metadata=(("authorization", "Bearer k"),))
            assert stats.uptime_s > 0
        args = build_parser().parse_args(["ctl", "--address", f"localhost:{server.grpc_address.rsplit(':', 1)[1]}",
                                          "--tls-ca", cert, "--timeout-s", "10", "health"])
        out = io.StringIO()
        with mock.patch.dict(os.environ, {"FT_API_KEY": "k"}):
            assert ctl_cli.run(args, out=out) == 0
        assert "SERVING" in out.getvalue()
