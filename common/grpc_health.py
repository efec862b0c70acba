"""Ask an engine's grpc.health.v1 whether it serves, over mutual TLS when
its port speaks only that: the engine pods' readiness and startup probe when
the router↔engine link is under mTLS, since the kubelet's own gRPC probe
speaks plaintext only.

    python -m common.grpc_health --address HOST:PORT [--grpc-tls-cert ...]

Exits 0 when the engine answers SERVING, 1 otherwise (saying why on stderr).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.settings import SettingError, add_arguments, from_arguments, group, setting
from common.tls import GrpcClientTlsSettings, TlsFiles

ENV_PREFIX = "TANDEM_PROBE_"


@dataclass(frozen=True)
class ProbeSettings:
    address: str = setting("127.0.0.1:50061", "the engine's gRPC address")
    timeout_s: float = setting(3.0, "how long the check may take")
    tls: GrpcClientTlsSettings = group(GrpcClientTlsSettings, "mutual TLS")


def serving(settings: ProbeSettings) -> tuple[bool, str]:
    """(whether the engine at `settings.address` serves, what it said)."""
    if settings.tls.enabled:
        files = TlsFiles(settings.tls)
        options = (
            [("grpc.ssl_target_name_override", files.server_name)] if files.server_name else []
        )
        channel = grpc.secure_channel(
            settings.address, files.channel_credentials(), options=options
        )
    else:
        channel = grpc.insecure_channel(settings.address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=settings.timeout_s
            )
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.grpc_health", description=__doc__)
    add_arguments(parser, ProbeSettings, ENV_PREFIX)
    settings = from_arguments(ProbeSettings, parser.parse_args(argv))
    try:
        settings.tls.validate()
    except SettingError as exc:
        parser.error(str(exc))
    ok, said = serving(settings)
    if not ok:
        print(f"{settings.address}: {said}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
