"""Mutual TLS between the router and an engine (common/tls.py): the fake gRPC
engine (bench/router_fakes.py) serving with certificates made here, reached
through the router's own pod pool (services/router/pods.py). It serves a
client presenting a certificate of its CA, refuses plaintext and clients
without one, and both sides take new certificates written over the files
without a restart. On Kubernetes the router dials pods by IP and checks one
name every engine's certificate carries instead (`--grpc-tls-server-name`);
the engines' exec probe (common/grpc_health.py) does the same. No mocks; a
few seconds."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import os
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.router_fakes import Timing, start_grpc_server
from common.grpc_health import main as probe
from common.ports import free_port
from common.roles import Role
from common.settings import SettingError
from common.tls import GrpcClientTlsSettings, GrpcTlsSettings, TlsFiles
from services.router.pods import PodPool, open_channel
from services.router.routing import PodSpec, RoutingCore, RoutingSettings

HOST = "127.0.0.1"


class Authority:
    """A CA that issues certificates for 127.0.0.1 and localhost."""

    def __init__(self, name: str) -> None:
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = self._sign(self.name, self.key.public_key(), ca=True)

    def _sign(
        self, subject: x509.Name, public_key, ca: bool = False, dns: tuple[str, ...] = ()
    ) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            # `dns` alone, or where the tests dial: localhost and 127.0.0.1.
            names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns] or [
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address(HOST)),
            ]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(self.key, hashes.SHA256())

    def write(self, folder: Path, name: str, dns: tuple[str, ...] = ()) -> GrpcTlsSettings:
        """A certificate for `name` (carrying the DNS names `dns`, else
        localhost and 127.0.0.1) and its key, and this CA, as files in
        `folder` (overwritten, with a newer modification time)."""
        folder.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._sign(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key.public_key(), dns=dns
        )
        files = {
            "cert.pem": cert.public_bytes(serialization.Encoding.PEM),
            "key.pem": key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            "ca.pem": self.cert.public_bytes(serialization.Encoding.PEM),
        }
        for file, data in files.items():
            path = folder / file
            stamp = path.stat().st_mtime_ns + 1_000_000_000 if path.exists() else None
            path.write_bytes(data)
            if stamp is not None:  # a coarse clock must still see a change
                os.utime(path, ns=(stamp, stamp))
        return GrpcTlsSettings(
            str(folder / "cert.pem"), str(folder / "key.pem"), str(folder / "ca.pem")
        )


async def status(channel: grpc.aio.Channel) -> grpc.StatusCode:
    """What a health check over `channel` gets (OK when served)."""
    async with channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


class Engine:
    """The fake engine over mutual TLS with a certificate of `ca`, which it
    also requires of clients."""

    def __init__(self, ca: Authority, folder: Path) -> None:
        self.port = free_port()
        self.address = f"{HOST}:{self.port}"
        self.tls = ca.write(folder, "engine")
        self.server = None

    async def start(self) -> None:
        self.server = await start_grpc_server(HOST, self.port, Timing(0, 0, 4), tls=self.tls)

    async def stop(self) -> None:
        await self.server.stop(grace=0)


@pytest.fixture
def ca():
    return Authority("one")


@pytest.fixture
async def engine(ca, tmp_path):
    engine = Engine(ca, tmp_path / "engine")
    await engine.start()
    yield engine
    await engine.stop()


def pool_with(address: str, tls: GrpcTlsSettings) -> PodPool:
    pool = PodPool(RoutingCore(RoutingSettings()), poll_interval_s=1.0, tls=TlsFiles(tls))
    pool.add_pod(PodSpec(address, Role.BOTH))
    return pool


async def test_serves_mutual_tls_and_refuses_plaintext(engine, ca, tmp_path):
    tls = ca.write(tmp_path / "router", "router")
    pool = pool_with(engine.address, tls)
    try:
        serving, _ = await pool.get(engine.address).check(timeout=5)
        assert serving
    finally:
        await pool.close()
    assert await status(open_channel(engine.address, None)) == grpc.StatusCode.UNAVAILABLE
    # TLS without a client certificate: refused in the handshake.
    ca_only = grpc.ssl_channel_credentials(root_certificates=Path(tls.grpc_tls_ca).read_bytes())
    assert await status(open_channel(engine.address, ca_only)) == grpc.StatusCode.UNAVAILABLE
    # A client certificate from another CA: refused too.
    stranger = Authority("other").write(tmp_path / "stranger", "router")
    stranger = GrpcTlsSettings(stranger.grpc_tls_cert, stranger.grpc_tls_key, tls.grpc_tls_ca)
    assert (
        await status(open_channel(engine.address, TlsFiles(stranger).channel_credentials()))
        == grpc.StatusCode.UNAVAILABLE
    )


async def test_both_sides_take_new_certificates_without_a_restart(engine, ca, tmp_path):
    tls = ca.write(tmp_path / "router", "router")
    pool = pool_with(engine.address, tls)
    try:
        assert (await pool.get(engine.address).check(timeout=5))[0]
        assert not pool.reload_tls()  # nothing changed
        # Rotate to a new CA: the engine's files, then the router's.
        new = Authority("two")
        new.write(tmp_path / "engine", "engine")
        # The running engine now presents and requires the new CA's
        # certificates: a client with the old files is refused.
        old = TlsFiles(tls).channel_credentials()
        assert await status(open_channel(engine.address, old)) == grpc.StatusCode.UNAVAILABLE
        new.write(tmp_path / "router", "router")
        assert pool.reload_tls()
        # The connection drops (the engine restarts): the router's next
        # connection must use the new files.
        await engine.stop()
        await engine.start()
        assert (await pool.get(engine.address).check(timeout=5))[0]
    finally:
        await pool.close()


async def test_a_certificate_without_the_address_serves_under_its_server_name(ca, tmp_path):
    """A pool's certificate names no pod IP: the router checks the name it
    carries instead, and the probe the kubelet runs does the same."""
    engine = Engine(ca, tmp_path / "engine")
    engine.tls = ca.write(tmp_path / "engine", "engine", dns=("tandem-engine",))
    await engine.start()
    tls = ca.write(tmp_path / "router", "router", dns=("tandem-router",))
    named = GrpcClientTlsSettings(*dataclasses.astuple(tls), grpc_tls_server_name="tandem-engine")
    unnamed = PodPool(RoutingCore(RoutingSettings()), poll_interval_s=1.0, tls=TlsFiles(tls))
    pool = pool_with(engine.address, named)
    try:
        # Dialled by IP and checked against it: refused.
        unnamed.add_pod(PodSpec(engine.address, Role.BOTH))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await unnamed.get(engine.address).check(timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (await pool.get(engine.address).check(timeout=5))[0]
        flags = [
            f"--address={engine.address}",
            f"--grpc-tls-cert={tls.grpc_tls_cert}",
            f"--grpc-tls-key={tls.grpc_tls_key}",
            f"--grpc-tls-ca={tls.grpc_tls_ca}",
        ]
        # The probe blocks: off the loop that serves the engine.
        named_probe = [*flags, "--grpc-tls-server-name=tandem-engine"]
        assert await asyncio.to_thread(probe, named_probe) == 0
        assert await asyncio.to_thread(probe, flags) == 1
        assert await asyncio.to_thread(probe, [f"--address={engine.address}"]) == 1  # plaintext
    finally:
        await pool.close()
        await unnamed.close()
        await engine.stop()


def test_settings_need_all_three_files(tmp_path):
    (tmp_path / "cert.pem").write_text("x")
    with pytest.raises(SettingError, match="--grpc-tls-key, --grpc-tls-ca"):
        GrpcTlsSettings(grpc_tls_cert=str(tmp_path / "cert.pem")).validate()
    with pytest.raises(SettingError, match="no such file"):
        GrpcTlsSettings(
            str(tmp_path / "cert.pem"), str(tmp_path / "k"), str(tmp_path / "c")
        ).validate()
    GrpcTlsSettings().validate()  # off
