"""The operator's settings: one object, each setting once with its default
and help; the flags and the environment variables (``TANDEM_OPERATOR_<FLAG>``)
derive from it (``common/settings.py``). ``operators/__main__.py`` builds it
and hands it to the handlers (operators/handlers.py ``register``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.settings import setting

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
