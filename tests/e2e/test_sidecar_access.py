"""Who reaches the sidecar's ext_proc port, through real Envoy and the real sidecar.

A client of the ext_proc port speaks for Envoy: whatever response it reports is counted by the
pool's breaker, whatever it holds takes a slot. So a pod that could reach the port could send a
made-up `:status 503`, trip the shared breaker, reroute every client and page a person. Only
Envoy may reach it:

- beyond loopback, with mutual TLS (listen.tls): Envoy presents its client certificate (the
  template's commented transport_socket, uncommented as written) and its requests are admitted;
  a client without a certificate, with one from another CA, or in plaintext fails its handshake
  and nothing it sends reaches the sidecar;
- in the shipped Kubernetes pod, on loopback: a client on the pod's address cannot connect at
  all, while the kubelet still reads the health on the health port there.

Certificates are made for each test with the `openssl` command. "The pod's address" is one of
this machine's own addresses beyond loopback (tests/e2e/test_security.py explains the choice).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.core.config import ConfigError, parse_config
from extproc.envoy.servicer import SERVICE_NAME
from extproc.server import CannotListen, SidecarServer
from extproc_testbed.envoy_config import SidecarTls
from extproc_testbed.stack import SimSpec, Stack, StackPorts, http_get, metric_sum, parse_samples

from ..conftest import OFFICER_KEY, TIME_SCALE, e2e_config
from .test_security import beyond_loopback_address, source_address_towards
from .test_servicer import Exchange, body_msg, chat_body, headers_msg, response_headers_msg

SERVER_NAME = "extproc"  # the name Envoy's transport_socket checks in the sidecar's certificate
ENVOY_ID = "spiffe://cluster.local/ns/llm/sa/envoy"  # the subject alternative name of Envoy's certificate


# -- certificates -----------------------------------------------------------------------------

def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
            "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert),
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return key, cert


def make_cert(directory: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    key, request, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(key), "-out", str(request))
    (directory / f"{name}.ext").write_text(f"basicConstraints=CA:FALSE\n{extensions}\n")
    openssl("x509", "-req", "-in", str(request), "-CA", str(ca[1]), "-CAkey", str(ca[0]), "-CAcreateserial",
            "-days", "1", "-out", str(cert), "-extfile", str(directory / f"{name}.ext"))
    return key, cert


class Certificates:
    """A CA; the sidecar's certificate from it; Envoy's client certificate from it; another
    workload's from it (the CA is a cluster's, which signs every workload's identity); and a
    client certificate from another CA (a pod's own identity, not Envoy's)."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.ca = make_ca(directory, "extproc-ca")
        self.server = make_cert(directory, "extproc", self.ca,
                                f"subjectAltName=DNS:{SERVER_NAME},IP:127.0.0.1\nextendedKeyUsage=serverAuth")
        self.envoy = make_cert(directory, "envoy", self.ca, f"subjectAltName=URI:{ENVOY_ID}\nextendedKeyUsage=clientAuth")
        self.workload = make_cert(directory, "workload", self.ca,
                                  "subjectAltName=URI:spiffe://cluster.local/ns/llm/sa/some-pod,DNS:envoy.other.svc\n"
                                  "extendedKeyUsage=clientAuth")
        other_ca = make_ca(directory, "other-ca")
        self.other = make_cert(directory, "some-pod", other_ca, "extendedKeyUsage=clientAuth")

    def sidecar_tls(self) -> dict:
        """listen.tls of the sidecar."""
        return {"cert_file": str(self.server[1]), "key_file": str(self.server[0]), "client_ca_file": str(self.ca[1])}

    def envoy_tls(self) -> SidecarTls:
        return SidecarTls(cert_file=str(self.envoy[1]), key_file=str(self.envoy[0]), ca_file=str(self.ca[1]))

    def channel(self, port: int, client: tuple[Path, Path] | None) -> grpc.aio.Channel:
        """A TLS channel to the sidecar that trusts its certificate, presenting `client`'s (or none)."""
        key, cert = (client[0].read_bytes(), client[1].read_bytes()) if client else (None, None)
        credentials = grpc.ssl_channel_credentials(self.ca[1].read_bytes(), key, cert)
        return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials,
                                       options=[("grpc.ssl_target_name_override", SERVER_NAME)])


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Certificates:
    return Certificates(tmp_path_factory.mktemp("certificates"))


# -- the forged exchange ----------------------------------------------------------------------

async def forge_a_failed_response(channel: grpc.aio.Channel) -> None:
    """What a pod that reaches the ext_proc port would send: a request to admit, then a response
    `:status 503` for it, as if Envoy had seen the backend fail."""
    exchange = Exchange(pb_grpc.ExternalProcessorStub(channel))
    await exchange.send(headers_msg(authorization=f"Bearer {OFFICER_KEY}", x_ticket_type="complaint"))
    await exchange.receive()
    await exchange.send(body_msg(chat_body()))
    admitted = await exchange.receive()
    assert admitted.HasField("request_body")
    await exchange.send(response_headers_msg(503))
    await exchange.receive()
    await exchange.finish()


def counted(metrics_url: str) -> dict[str, float]:
    """What the sidecar recorded: decisions, and the upstream outcomes its breakers count."""
    status, text = http_get(metrics_url)
    assert status == 200
    samples = parse_samples(text)
    return {
        "decisions": metric_sum(samples, "extproc_admission_outcomes_total"),
        "admitted": metric_sum(samples, "extproc_admission_outcomes_total", outcome="admitted"),
        "failures": metric_sum(samples, "extproc_upstream_outcomes_total")
        - metric_sum(samples, "extproc_upstream_outcomes_total", result="success"),
        "successes": metric_sum(samples, "extproc_upstream_outcomes_total", result="success"),
    }


# -- mutual TLS, through real Envoy -------------------------------------------------------------

def test_with_mutual_tls_only_envoys_certificate_reaches_the_sidecar(tmp_path, certificates):
    config = e2e_config(listen={"host": "0.0.0.0", "tls": certificates.sidecar_tls()},
                        retries={"failover": False})  # a counted failure stays one outcome
    config_path = tmp_path / "extproc.yaml"
    config_path.write_text(yaml.safe_dump(config))
    sim_args = ("--time-scale", TIME_SCALE)
    stack = Stack(tmp_path, StackPorts.random(primary=1), config_path,
                  primary=SimSpec("deepseek-sim", sim_args), fallback=SimSpec("deepseek-sim-small", sim_args))
    stack.sidecar_tls = certificates.envoy_tls()
    with stack:  # started once Envoy's health checks, over mutual TLS, see the sidecar healthy
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=OFFICER_KEY, max_retries=0)
        answer = client.chat.completions.create(model="deepseek-sim", max_tokens=4,
                                                messages=[{"role": "user", "content": "hello"}])
        assert answer.choices[0].message.content
        assert counted(stack.metrics_url) == {"decisions": 1, "admitted": 1, "failures": 0, "successes": 1}

        async def forgers() -> list[grpc.StatusCode]:
            codes = []
            for channel in (grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports.grpc}"),  # plaintext
                            certificates.channel(stack.ports.grpc, None),  # TLS, no certificate
                            certificates.channel(stack.ports.grpc, certificates.other)):  # another CA's
                async with channel:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await forge_a_failed_response(channel)
                    codes.append(refused.value.code())
            return codes

        assert asyncio.run(forgers()) == [grpc.StatusCode.UNAVAILABLE] * 3
        # Nothing of theirs was decided or counted: the breaker saw no failure.
        assert counted(stack.metrics_url) == {"decisions": 1, "admitted": 1, "failures": 0, "successes": 1}

        async def with_envoys_certificate() -> None:
            async with certificates.channel(stack.ports.grpc, certificates.envoy) as channel:
                await forge_a_failed_response(channel)

        # The same exchange with Envoy's certificate is decided and counted: the forgeries above
        # were stopped by their handshakes, not by anything in what they sent.
        asyncio.run(with_envoys_certificate())
        assert counted(stack.metrics_url) == {"decisions": 2, "admitted": 2, "failures": 1, "successes": 1}


def test_with_allowed_client_names_another_workloads_certificate_of_the_ca_is_refused(tmp_path, certificates):
    tls = {**certificates.sidecar_tls(), "allowed_client_names": ["envoy.llm.svc", ENVOY_ID]}
    config = e2e_config(listen={"host": "0.0.0.0", "tls": tls}, retries={"failover": False})
    config_path = tmp_path / "extproc.yaml"
    config_path.write_text(yaml.safe_dump(config))
    sim_args = ("--time-scale", TIME_SCALE)
    stack = Stack(tmp_path, StackPorts.random(primary=1), config_path,
                  primary=SimSpec("deepseek-sim", sim_args), fallback=SimSpec("deepseek-sim-small", sim_args))
    stack.sidecar_tls = certificates.envoy_tls()
    with stack:
        # Envoy, named: admitted.
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=OFFICER_KEY, max_retries=0)
        answer = client.chat.completions.create(model="deepseek-sim", max_tokens=4,
                                                messages=[{"role": "user", "content": "hello"}])
        assert answer.choices[0].message.content
        assert counted(stack.metrics_url) == {"decisions": 1, "admitted": 1, "failures": 0, "successes": 1}

        async def forge(client_certificate: tuple[Path, Path]) -> None:
            async with certificates.channel(stack.ports.grpc, client_certificate) as channel:
                await forge_a_failed_response(channel)

        async def status_of_a_stream(client_certificate: tuple[Path, Path]) -> grpc.StatusCode:
            """The status a stream that sends nothing ends with (a stream the sidecar serves
            ends OK when its client closes it)."""
            async with certificates.channel(stack.ports.grpc, client_certificate) as channel:
                call = pb_grpc.ExternalProcessorStub(channel).Process(iter(()))
                return await asyncio.wait_for(call.code(), 10)

        # Another workload, whose certificate the CA signed too: refused as its stream opens...
        assert asyncio.run(status_of_a_stream(certificates.workload)) is grpc.StatusCode.PERMISSION_DENIED
        # ...so nothing it sends is read. (Its client may report the refusal as PERMISSION_DENIED,
        # or, when the refusal ends the stream while it is still sending, as grpc's own INTERNAL
        # "Internal error from Core": the sidecar's answer is the same either way, and counted.)
        with pytest.raises(grpc.aio.AioRpcError):
            asyncio.run(forge(certificates.workload))
        assert counted(stack.metrics_url) == {"decisions": 1, "admitted": 1, "failures": 0, "successes": 1}
        refusals = parse_samples(http_get(stack.metrics_url)[1])
        assert metric_sum(refusals, "extproc_clients_refused_total", port="ext_proc") == 2

        asyncio.run(forge(certificates.envoy))  # the same exchange from Envoy's certificate: counted
        assert counted(stack.metrics_url) == {"decisions": 2, "admitted": 2, "failures": 1, "successes": 1}


def test_the_ext_proc_port_refuses_to_listen_beyond_loopback_without_mutual_tls(certificates):
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(ConfigError, match="allow_unauthenticated_beyond_loopback"):
            parse_config(e2e_config(listen={"host": host}))
        without_client_certificates = {**certificates.sidecar_tls(), "require_client_cert": False}
        with pytest.raises(ConfigError, match="require_client_cert"):
            parse_config(e2e_config(listen={"host": host, "tls": without_client_certificates}))
        parse_config(e2e_config(listen={"host": host, "tls": certificates.sidecar_tls()}))
        parse_config(e2e_config(listen={"host": host, "allow_unauthenticated_beyond_loopback": True}))
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        parse_config(e2e_config(listen={"host": host}))
    with pytest.raises(ConfigError, match="client_ca_file"):
        parse_config(e2e_config(listen={"tls": {"cert_file": "a.crt", "key_file": "a.key"}}))
    names_without_certificates = {**certificates.sidecar_tls(), "require_client_cert": False,
                                  "allowed_client_names": [ENVOY_ID]}
    for section in ("listen", "admin"):
        with pytest.raises(ConfigError, match=rf"{section}\.tls.*allowed_client_names needs require_client_cert"):
            parse_config(e2e_config(**{section: {"tls": names_without_certificates}}))


@pytest.mark.parametrize("broken", ["cert_file", "key_file", "client_ca_file"])
async def test_an_unusable_certificate_file_is_named_at_start(tmp_path, certificates, broken):
    tls = {**certificates.sidecar_tls(), broken: str(tmp_path / "bad.pem")}
    config = parse_config(e2e_config(listen={"grpc_port": 0, "metrics_port": 0, "tls": tls}, admin={"port": 0}))
    with pytest.raises(CannotListen, match=rf"^listen\.tls\.{broken}: cannot read .*bad\.pem"):
        await SidecarServer(config).start()
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(CannotListen, match=rf"^listen\.tls\.{broken}: .*bad\.pem holds no PEM"):
        await SidecarServer(config).start()


# -- the shipped pod: ext_proc on loopback, health on the pod's address --------------------------

def deployed_listen() -> dict:
    configmap = next(d for d in yaml.safe_load_all((Path(__file__).parents[2] / "deploy/k8s/extproc-config.yaml")
                                                   .read_text()))
    return yaml.safe_load(configmap["data"]["extproc.yaml"])["listen"]


async def test_in_the_shipped_pod_no_other_pod_reaches_ext_proc_and_the_kubelet_reads_health():
    listen = {**deployed_listen(), "grpc_port": 0, "metrics_port": 0, "health_port": 0}
    server = SidecarServer(parse_config(e2e_config(listen=listen, admin={"port": 0}, retries={"failover": False})))
    await server.start()
    pod_address = beyond_loopback_address()
    try:
        assert source_address_towards(pod_address, server.health_port) == pod_address  # not loopback
        # The kubelet's probe, on the pod's address: the health port answers.
        async with grpc.aio.insecure_channel(f"{pod_address}:{server.health_port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                                    timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as not_there:  # health only: no ext_proc
                await forge_a_failed_response(channel)
            assert not_there.value.code() is grpc.StatusCode.UNIMPLEMENTED
        # Another pod, on the pod's address: nothing listens for ext_proc there.
        async with grpc.aio.insecure_channel(f"{pod_address}:{server.grpc_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await forge_a_failed_response(channel)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        samples = parse_samples(server.metrics.render().decode())
        assert metric_sum(samples, "extproc_admission_outcomes_total") == 0
        assert metric_sum(samples, "extproc_upstream_outcomes_total") == 0
        # Envoy, in the pod, on loopback: decided and counted as before.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            await forge_a_failed_response(channel)
        samples = parse_samples(server.metrics.render().decode())
        assert metric_sum(samples, "extproc_upstream_outcomes_total", result="http_5xx") == 1
    finally:
        await server.stop()


# -- the operator API with TLS -------------------------------------------------------------------

async def test_the_admin_api_with_tls_answers_extproc_admin_with_a_client_certificate_only(certificates):
    config = parse_config(e2e_config(listen={"grpc_port": 0, "metrics_port": 0},
                                     admin={"port": 0, "tls": certificates.sidecar_tls()}))
    server = SidecarServer(config)
    await server.start()
    try:
        def admin(*tls: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "extproc", "admin", "--address", f"127.0.0.1:{server.admin_port}",
                                   *tls, "state"], capture_output=True, text=True, timeout=60)

        ca = ("--ca-file", str(certificates.ca[1]))
        answered = await asyncio.to_thread(admin, *ca, "--cert-file", str(certificates.envoy[1]),
                                           "--key-file", str(certificates.envoy[0]))
        assert answered.returncode == 0 and "primary" in answered.stdout, answered.stderr
        for refused in [(), ca, (*ca, "--cert-file", str(certificates.other[1]), "--key-file", str(certificates.other[0]))]:
            result = await asyncio.to_thread(admin, *refused)
            assert result.returncode == 2 and "UNAVAILABLE" in result.stderr, (refused, result.stdout)
    finally:
        await server.stop()


def extproc_admin(port: int, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "extproc", "admin", "--address", f"127.0.0.1:{port}", *flags, "state"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


async def test_the_admin_api_with_allowed_client_names_refuses_another_workloads_certificate(certificates):
    tls = {**certificates.sidecar_tls(), "allowed_client_names": [ENVOY_ID]}
    config = parse_config(e2e_config(listen={"grpc_port": 0, "metrics_port": 0}, admin={"port": 0, "tls": tls}))
    server = SidecarServer(config)
    await server.start()
    try:
        def presenting(client: tuple[Path, Path]) -> tuple[str, ...]:
            return "--ca-file", str(certificates.ca[1]), "--cert-file", str(client[1]), "--key-file", str(client[0])

        refused = await asyncio.to_thread(extproc_admin, server.admin_port, *presenting(certificates.workload))
        assert refused.returncode == 2 and "PERMISSION_DENIED" in refused.stderr, refused.stderr
        answered = await asyncio.to_thread(extproc_admin, server.admin_port, *presenting(certificates.envoy))
        assert answered.returncode == 0 and "primary" in answered.stdout, answered.stderr
        samples = parse_samples(server.metrics.render().decode())
        assert metric_sum(samples, "extproc_clients_refused_total", port="admin") == 1
    finally:
        await server.stop()


async def test_extproc_admin_speaks_tls_whenever_a_tls_flag_is_given(tmp_path, certificates):
    token = "admin-token-never-in-clear"
    (tmp_path / "token").write_text(token)
    heard: list[bytes] = []

    async def listen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heard.append(await reader.read(65536))  # what a client sends first, before any answer
        writer.close()

    listener = await asyncio.start_server(listen, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    envoy = ("--cert-file", str(certificates.envoy[1]), "--key-file", str(certificates.envoy[0]))
    async with listener:
        # A client certificate without a CA: TLS (checked against the system's roots), never
        # the token in a plaintext request.
        result = await asyncio.to_thread(extproc_admin, port, "--token-file", str(tmp_path / "token"), *envoy)
        assert result.returncode == 2 and "UNAVAILABLE" in result.stderr
        assert heard and all(first.startswith(b"\x16\x03") for first in heard)  # a TLS handshake record
        assert not any(token.encode() in first for first in heard)
        heard.clear()
        # Half a client certificate: refused before anything is sent.
        for flags, missing in [(envoy[:2], "--key-file"), (envoy[2:], "--cert-file")]:
            result = await asyncio.to_thread(extproc_admin, port, *flags)
            assert result.returncode == 2 and f"needs {missing}" in result.stderr, (flags, result.stderr)
        assert heard == []

    # Against admin.tls, with the system's roots made the sidecar's CA: answered.
    config = parse_config(e2e_config(listen={"grpc_port": 0, "metrics_port": 0},
                                     admin={"port": 0, "tls": certificates.sidecar_tls()}))
    server = SidecarServer(config)
    await server.start()
    try:
        roots = {"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(certificates.ca[1])}
        answered = await asyncio.to_thread(extproc_admin, server.admin_port, *envoy, env=roots)
        assert answered.returncode == 0 and "primary" in answered.stdout, answered.stderr
    finally:
        await server.stop()
