"""Services on the host: kube-proxy's userspace mode, and the API server for pods.

Each Service port is served by a TCP listener on the Service's ClusterIP (what
pods reach, by name through their hosts files) and one on a free loopback
port (what the host reaches: printed, and recorded in the cluster's state
file); each connection goes to the next ready endpoint of the Service's
EndpointSlices, round-robin, trying the next one when a connect fails.

Pods reach the API server as in a cluster, over TLS at KUBERNETES_SERVICE_HOST
(the bridge's gateway, port 443) with a service-account token and the CA in
/var/run/secrets/kubernetes.io/serviceaccount: a TLS listener there forwards
to the plain-HTTP API server on loopback. The certificate is made at start by
`make_certificates`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import itertools
import ssl
from collections.abc import Callable
from pathlib import Path

Endpoints = Callable[[], list[tuple[str, int]]]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def splice(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    server_r: asyncio.StreamReader,
    server_w: asyncio.StreamWriter,
) -> None:
    await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))


class Forwarder:
    """Listeners for one Service port, sending each connection to an endpoint."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self._turn = itertools.count()
        self.servers: list[asyncio.Server] = []
        self._conns: set[asyncio.Task] = set()

    async def listen(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        server = await asyncio.start_server(self._handle, host, port, ssl=ssl_context)
        self.servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            targets = self.endpoints()
            start = next(self._turn)
            for i in range(len(targets)):
                host, port = targets[(start + i) % len(targets)]
                try:
                    up_r, up_w = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
                except (OSError, TimeoutError):
                    continue
                await splice(reader, writer, up_r, up_w)
                return
            writer.close()  # no ready endpoint: refused, as kube-proxy rejects it
        finally:
            self._conns.discard(task)

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        for task in list(self._conns):
            task.cancel()
        for server in self.servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self.servers.clear()


def make_certificates(folder: Path, address: str) -> tuple[Path, Path, Path]:
    """A CA and a serving certificate for `address` (and kubernetes.default.svc):
    (ca.crt, tls.crt, tls.key) under `folder`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    life = (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=365))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "devcluster-ca")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(life[0])
        .not_valid_after(life[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [
        x509.IPAddress(ipaddress.ip_address(address)),
        *(
            x509.DNSName(n)
            for n in (
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            )
        ),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(life[0])
        .not_valid_after(life[1])
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    paths = folder / "ca.crt", folder / "tls.crt", folder / "tls.key"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths[2].chmod(0o600)
    return paths


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context
