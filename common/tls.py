"""Mutual TLS on the router↔engine gRPC link, from PEM files that may be
replaced at run time (cert-manager renews a mounted Secret in place).

Both sides take the same three settings: their own certificate and key, and
the CA that signs the other side's. The engine (server) asks for the files
again at each new handshake and rereads them when their modification time
changed (gRPC's dynamic server credentials); it requires a client
certificate, and a plaintext client fails the handshake. The router (client)
compares the files' modification times at each health poll and, when they
changed, opens new channels with the new files (`TlsFiles.changed`).

On Kubernetes the router dials engine pods by IP, which no shared
certificate names; the router then checks the engines' certificate against
one fixed name instead (`--grpc-tls-server-name`, gRPC's target name
override), and every engine presents a certificate carrying that name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.settings import SettingError, flag_of, setting


@dataclass(frozen=True)
class GrpcTlsSettings:
    grpc_tls_cert: str | None = setting(
        None,
        "PEM certificate (chain) this side presents on the router-engine gRPC link; "
        "with --grpc-tls-key and --grpc-tls-ca, mutual TLS: plaintext is refused. "
        "The files are reread when they change",
        metavar="PATH",
    )
    grpc_tls_key: str | None = setting(None, "PEM private key of --grpc-tls-cert", metavar="PATH")
    grpc_tls_ca: str | None = setting(
        None, "PEM CA certificate(s) the other side's certificate must chain to", metavar="PATH"
    )

    @property
    def enabled(self) -> bool:
        return self.grpc_tls_cert is not None

    def validate(self) -> None:
        names = ("grpc_tls_cert", "grpc_tls_key", "grpc_tls_ca")
        given = [n for n in names if getattr(self, n)]
        if given and len(given) != len(names):
            missing = [flag_of(GrpcTlsSettings, n) for n in names if n not in given]
            raise SettingError(
                flag_of(GrpcTlsSettings, given[0]),
                f"mutual TLS needs all three files: also give {', '.join(missing)}",
            )
        for name in given:
            if not os.path.isfile(getattr(self, name)):
                raise SettingError(
                    flag_of(GrpcTlsSettings, name), f"{getattr(self, name)}: no such file"
                )


@dataclass(frozen=True)
class GrpcClientTlsSettings(GrpcTlsSettings):
    """The client's (router's) side: the three files, and the name the
    server's certificate must carry when it is not the address dialled."""

    grpc_tls_server_name: str | None = setting(
        None,
        "name the engines' certificate must carry (a DNS subject alternative name), "
        "checked instead of the address dialled: engine pods are dialled by IP, which a "
        "certificate shared by a pool cannot name (default: the address)",
        metavar="NAME",
    )


class TlsFiles:
    """The three files of `GrpcTlsSettings`, read together, and whether they
    changed since they were last read."""

    def __init__(self, settings: GrpcTlsSettings) -> None:
        # The name the server's certificate is checked against (client side).
        self.server_name = (
            settings.grpc_tls_server_name if isinstance(settings, GrpcClientTlsSettings) else None
        )
        if not settings.enabled:
            raise ValueError("TLS is off: no --grpc-tls-cert")
        assert settings.grpc_tls_key and settings.grpc_tls_ca  # validate() checked
        self._paths = (
            Path(settings.grpc_tls_cert or ""),
            Path(settings.grpc_tls_key),
            Path(settings.grpc_tls_ca),
        )
        self._stamp: tuple[int, ...] | None = None

    def _mtimes(self) -> tuple[int, ...]:
        return tuple(p.stat().st_mtime_ns for p in self._paths)

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate, key, CA) as they are now."""
        stamp = self._mtimes()
        cert, key, ca = (p.read_bytes() for p in self._paths)
        self._stamp = stamp
        return cert, key, ca

    def changed(self) -> bool:
        """Whether a file changed since the last `read` (a file being replaced
        that cannot be read yet counts as unchanged: next time)."""
        try:
            return self._mtimes() != self._stamp
        except OSError:
            return False

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that require a client certificate signed by the
        CA and pick up new files at the next handshake after they change."""

        def configuration() -> grpc.ServerCertificateConfiguration:
            cert, key, ca = self.read()
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # None keeps the current files: unchanged, or caught mid-replacement
            # (the next handshake tries again).
            if not self.changed():
                return None
            try:
                return configuration()
            except OSError:
                return None

        return grpc.dynamic_ssl_server_credentials(
            configuration(), fetch, require_client_authentication=True
        )
