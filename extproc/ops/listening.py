"""Opening the sidecar's gRPC ports (extproc serve): an address as gRPC reads it, TLS
credentials from the configured files, and errors that name the port and why it cannot open."""

from __future__ import annotations

from pathlib import Path

import grpc

from ..core.listen_config import Tls


class CannotListen(Exception):
    """A port cannot be opened as configured; the message says which and why."""


class PortInUse(CannotListen):
    pass


def grpc_address(host: str, port: int) -> str:
    """"HOST:PORT" as gRPC reads it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(server: grpc.aio.Server, host: str, port: int, what: str,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Add a port to `server`, with TLS when given credentials; the port bound."""
    address = grpc_address(host, port)
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:
        why = "port in use?" if credentials is None else "port in use, or a key that is not the certificate's?"
        raise PortInUse(f"cannot listen for {what} on {host}:{port} ({why})") from None


def tls_credentials(tls: Tls | None, key: str) -> grpc.ServerCredentials | None:
    """A port's certificate and key, and the CA its clients' certificates must chain to (None:
    no TLS). The files are read once: a renewed certificate takes a restart."""
    if tls is None:
        return None

    def read(field: str, path: str | None, holds: bytes) -> bytes | None:
        if path is None:
            return None
        try:
            pem = Path(path).read_bytes()
        except OSError as error:
            raise CannotListen(f"{key}.{field}: cannot read {path}: {error.strerror}") from None
        if holds not in pem:
            raise CannotListen(f"{key}.{field}: {path} holds no PEM {holds.decode()}")
        return pem

    cert = read("cert_file", tls.cert_file, b"CERTIFICATE")
    private_key = read("key_file", tls.key_file, b"PRIVATE KEY")
    client_ca = read("client_ca_file", tls.client_ca_file, b"CERTIFICATE")
    return grpc.ssl_server_credentials([(private_key, cert)], root_certificates=client_ca,
                                       require_client_auth=tls.require_client_cert)
