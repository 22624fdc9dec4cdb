"""TLS for the HTTP API and the gRPC control plane: `--tls-cert PEM --tls-key PEM` (both or neither).

One certificate and key serve both listeners (aiohttp through an `ssl.SSLContext`, TLS 1.2 or newer; gRPC
through `grpc.ssl_server_credentials`). The key file must not be readable by others (as the API key file).
Clients: `https://` with the certificate's CA; `ft ctl --tls-ca PEM`.
"""
from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None) -> "TlsFiles | None":
        if not cert and not key:
            return None
        if not (cert and key):
            raise ValueError("TLS needs both --tls-cert and --tls-key (PEM files)")
        for path in (cert, key):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"the TLS file {path} does not exist")
        mode = os.stat(key).st_mode
        if mode & (stat.S_IROTH | stat.S_IWOTH):
            raise ValueError(f"the TLS key {key} has mode {stat.S_IMODE(mode):04o}: any local user could read it; "
                             f"chmod o= {key}")
        return cls(os.path.abspath(cert), os.path.abspath(key))

    def http_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"cannot use the TLS certificate {self.cert} with the key {self.key}: {exc}") from None
        return ctx

    def grpc_credentials(self):
        # lazy: gRPC loads only where the control plane serves TLS
        import grpc

        with open(self.key, "rb") as f:
            key = f.read()
        with open(self.cert, "rb") as f:
            cert = f.read()
        return grpc.ssl_server_credentials([(key, cert)])
