"""tls.allowed_client_names (listen.tls, admin.tls): who, among the clients whose certificates
chain to client_ca_file, may use the port.

The TLS handshake checks only that chain. A CA that signs other clients too (a cluster's or a
mesh's, which signs every workload's identity) lets any pod's client through, and a client of
the ext_proc port speaks for Envoy: it can hold slots and report made-up 503s that trip the
shared breaker. With names, its certificate must also carry one of them.
"""

from __future__ import annotations

import grpc

from ..core.listen_config import Tls


def allowed_clients(tls: Tls | None, refused) -> AllowedClients | None:
    """The port's check (`refused`: its extproc_clients_refused_total), or None where it names
    no client: any certificate of client_ca_file is let in."""
    if tls is None or not tls.allowed_client_names:
        return None
    return AllowedClients(tls.allowed_client_names, refused)


class AllowedClients:
    """The names a client's certificate must carry one of."""

    def __init__(self, names: tuple[str, ...], refused):
        self.names = frozenset(name.encode() for name in names)
        self.refused = refused

    def admit(self, context: grpc.aio.ServicerContext) -> bool:
        """Whether the peer is named (once per stream: grpc's peer identity, a fraction of a
        microsecond; grpc shows no connection to check once). Its identity is what the TLS
        handshake verified: the certificate's subject alternative names, or its common name
        when it has none."""
        identities = context.peer_identities()
        if identities is not None and not self.names.isdisjoint(identities):
            return True
        self.refused.inc()
        return False


class AllowedClientsGuard(grpc.aio.ServerInterceptor):
    """The admin API's calls from clients that `clients` does not name: PERMISSION_DENIED."""

    def __init__(self, clients: AllowedClients):
        self.clients = clients

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:  # the admin API's calls are all unary
            return handler
        call, clients = handler.unary_unary, self.clients

        async def checked(request, context):
            if not clients.admit(context):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    "the client's certificate names none of admin.tls.allowed_client_names")
            return await call(request, context)

        return handler._replace(unary_unary=checked)
