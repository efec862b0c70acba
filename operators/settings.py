"""The operator's settings: one object, each setting once with its default
and help; the flags and the environment variables (``TANDEM_OPERATOR_<FLAG>``)
derive from it (``common/settings.py``). ``operators/__main__.py`` builds it
and hands it to the handlers (operators/handlers.py ``register``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.kube import own_namespace
from common.settings import SettingError, flag_of, setting

ENV_PREFIX = "TANDEM_OPERATOR_"


@dataclass(frozen=True)
class OperatorSettings:
    kubeconfig: str | None = setting(
        None,
        "kubeconfig file (default: $KUBECONFIG; in a pod: the service account)",
        factory=lambda: os.environ.get("KUBECONFIG"),
        env=False,
    )
    namespaces: list[str] = setting(
        [],
        "watch only this namespace (repeatable; a glob such as 'team-*' works); "
        "default: every namespace",
        flag="--namespace",
        aliases=("-n",),
        metavar="NAMESPACE",
    )
    health_port: int = setting(8080, "liveness endpoint http://0.0.0.0:PORT/healthz (kopf's)")
    metrics_port: int = setting(9090, "Prometheus /metrics port (0 = off)")
    resync_seconds: float = setting(
        30.0,
        "how often every TandemDeployment is compared again in full (besides every "
        "change it, its pools or its objects see)",
    )
    scaling_seconds: float = setting(
        15.0,
        "how often the rate-matching controller decides for each TandemDeployment "
        "whose scaling.mode is Recommend or Auto",
    )
    leader_election: bool = setting(
        True,
        "run as one of several replicas: only the holder of the Lease --lease-name "
        "reconciles and runs the loops, the others stand by (off: this process "
        "acts alone, whatever else runs)",
    )
    lease_name: str = setting("tandem-operator", "the coordination.k8s.io Lease elected over")
    lease_namespace: str = setting(
        "",
        "namespace of the Lease (default: $POD_NAMESPACE, else the service account's, "
        "else 'default')",
        factory=lambda: os.environ.get("POD_NAMESPACE") or own_namespace(),
    )
    lease_duration_seconds: float = setting(
        15.0,
        "a standby takes over when the leader has not renewed the Lease for this long "
        "(the leader killed); a leader stopped cleanly releases it at once",
    )
    lease_renew_deadline_seconds: float = setting(
        10.0,
        "a leader that cannot renew the Lease for this long stops leading (and exits, "
        "so Kubernetes restarts it as a standby); below --lease-duration-seconds",
    )
    lease_retry_seconds: float = setting(
        2.0, "how often the leader renews the Lease and a standby tries to take it"
    )

    def __post_init__(self) -> None:
        if not self.leader_election:
            return
        if self.lease_retry_seconds <= 0:
            raise SettingError(flag_of(type(self), "lease_retry_seconds"), "must be positive")
        if self.lease_renew_deadline_seconds <= self.lease_retry_seconds:
            raise SettingError(
                flag_of(type(self), "lease_renew_deadline_seconds"),
                "must be above --lease-retry-seconds (the leader renews several times in it)",
            )
        if self.lease_duration_seconds <= self.lease_renew_deadline_seconds:
            raise SettingError(
                flag_of(type(self), "lease_duration_seconds"),
                "must be above --lease-renew-deadline-seconds (a leader that cannot renew "
                "stops before a standby may take over)",
            )
