"""The sidecar's own endpoints in the configuration: the ext_proc, health and metrics ports
(`listen`) and the operator API (`admin`), with their TLS. Who may reach which port:
docs/deploy.md#who-reaches-the-sidecar."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from pydantic import Field, model_validator

from .pool_config import StrictModel as _Strict

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")  # a digest as the configuration holds it


def on_loopback(host: str) -> bool:
    """A listening address only this host (this pod) can reach: 127.0.0.0/8, ::1, localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Tls(_Strict):
    """TLS on a gRPC port: this server's certificate chain and key, and the CA whose
    certificates its clients must present (PEM files, read at start)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    require_client_cert: bool = True  # mutual TLS: a client without a certificate of client_ca_file is refused
    # When client_ca_file signs other clients too (a cluster's or a mesh's CA): the names a
    # client's certificate must carry one of, a subject alternative name (DNS, or a URI such as
    # a SPIFFE id; the common name of a certificate without any). Empty: any certificate of the CA.
    allowed_client_names: tuple[Annotated[str, Field(min_length=1)], ...] = ()

    @model_validator(mode="after")
    def _clients_checked(self) -> Tls:
        if self.require_client_cert and self.client_ca_file is None:
            raise ValueError("require_client_cert needs client_ca_file (the CA that signs the clients' certificates)")
        if self.allowed_client_names and not self.require_client_cert:
            raise ValueError("allowed_client_names needs require_client_cert (the names are read from the "
                             "client's certificate)")
        return self


class Listen(_Strict):
    """The sidecar's ports. ext_proc (with grpc.health.v1, which Envoy checks) on `host`: a
    client of that port can hold slots and report responses that trip a pool's breaker, so only
    Envoy may reach it: loopback beside Envoy, or mutual TLS beyond."""

    host: str = "127.0.0.1"
    grpc_port: int = Field(50051, ge=0, le=65535)
    tls: Tls | None = None
    # true: a host beyond loopback without mutual TLS is accepted, every client that reaches the
    # port trusted (only where a network policy lets nothing but Envoy reach it)
    allow_unauthenticated_beyond_loopback: bool = False
    metrics_port: int = Field(9464, ge=0, le=65535)
    metrics_host: str | None = None  # default: host
    # grpc.health.v1 alone, without ext_proc, for probes that cannot reach loopback (the kubelet's)
    health_port: int | None = Field(None, ge=0, le=65535)
    health_host: str | None = None  # default: host

    @property
    def metrics_address(self) -> str:
        return self.metrics_host or self.host

    @property
    def health_address(self) -> str:
        return self.health_host or self.host

    @model_validator(mode="after")
    def _only_envoy(self) -> Listen:
        mutual_tls = self.tls is not None and self.tls.require_client_cert
        if not on_loopback(self.host) and not mutual_tls and not self.allow_unauthenticated_beyond_loopback:
            raise ValueError(
                f"host {self.host} is beyond loopback: the ext_proc port needs tls with require_client_cert "
                "(a client without a certificate of client_ca_file is refused), or "
                "allow_unauthenticated_beyond_loopback: true where a network policy lets nothing but Envoy reach it"
            )
        return self


class Admin(_Strict):
    """The operator API (gRPC, proto/extproc/admin/v1/admin.proto)."""

    host: str = "127.0.0.1"
    port: int = Field(50071, ge=0, le=65535)
    token_sha256: tuple[str, ...] = ()  # required when host is not loopback
    tls: Tls | None = None  # beyond loopback, without it the token travels in clear

    @model_validator(mode="after")
    def _guarded(self) -> Admin:
        for digest in self.token_sha256:
            if not SHA256_HEX.match(digest):
                raise ValueError("token_sha256 entries must be 64 lowercase hex characters")
        if not on_loopback(self.host) and not self.token_sha256:
            raise ValueError("an admin API listening beyond loopback needs token_sha256")
        return self
