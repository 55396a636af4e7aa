"""TLS for both servers: one certificate and key, checked once.

``ServerTls.from_files(cert, key)`` reads a PEM certificate (chain) and its
PEM private key and checks them before any server uses them: each file is
readable, the certificate is a certificate, the key a private key (not
encrypted: a server starts unattended), and the key belongs to the
certificate. A problem raises ``TlsError`` naming the file and what is
wrong (not, as grpcio would report it, as a port that failed to bind).
``GrpcServer(tls=...)`` and ``HttpServer(tls=...)`` take the same object:
``grpc_credentials()`` for one, ``ssl_context()`` for the other.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ServerTls", "TlsError"]


class TlsError(ValueError):
    """A TLS certificate or key that cannot be used; the message names the file."""


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and private key (PEM), checked.

    Build it with ``from_files``. ``cert_file`` and ``key_file`` are where
    they were read from (the HTTP server's ``ssl`` loads them by path)."""

    cert_file: Path
    key_file: Path
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)

    @staticmethod
    def from_files(cert_file: str | os.PathLike, key_file: str | os.PathLike) -> ServerTls:
        """Reads and checks a certificate and its key.

        Raises:
            TlsError: a file is unreadable, holds no PEM certificate or
                private key, the key is encrypted, or it does not belong to
                the certificate.
        """
        cert_path, key_path = Path(cert_file), Path(key_file)
        cert = _read(cert_path, "certificate")
        key = _read(key_path, "private key")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_verify_locations(cadata=cert.decode("ascii", errors="replace"))
        except ssl.SSLError as error:
            raise TlsError(
                f"TLS certificate {cert_path} holds no PEM certificate "
                f"(-----BEGIN CERTIFICATE-----): {error.reason or error}"
            ) from None
        if b"PRIVATE KEY-----" not in key:
            raise TlsError(
                f"TLS key {key_path} holds no PEM private key (-----BEGIN PRIVATE KEY-----)"
            )
        try:
            context.load_cert_chain(cert_path, key_path, password=_no_password(key_path))
        except ssl.SSLError as error:
            if error.reason == "KEY_VALUES_MISMATCH":
                raise TlsError(
                    f"TLS key {key_path} does not belong to the certificate {cert_path}"
                ) from None
            raise TlsError(
                f"TLS certificate {cert_path} and key {key_path} cannot be used: "
                f"{error.reason or error}"
            ) from None
        return ServerTls(cert_path, key_path, cert, key)

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side context for HTTPS."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def grpc_credentials(self) -> Any:
        """``grpc.ServerCredentials`` for a secure port."""
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)])


def _read(path: Path, what: str) -> bytes:
    kind = "certificate" if what == "certificate" else "key"
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TlsError(f"TLS {kind} {path} cannot be read: {error.strerror or error}") from None
    if not data.strip():
        raise TlsError(f"TLS {kind} {path} is empty; expected a PEM {what}")
    return data


def _no_password(path: Path) -> Any:
    def refuse() -> bytes:
        raise TlsError(
            f"TLS key {path} is encrypted; a server needs it unencrypted "
            f"(openssl pkey -in {path} -out plain.pem)"
        )

    return refuse
